"""Which task names lm-eval's stock task directory can know, read in well under a second.

lm-eval's ``TaskManager`` builds its index by YAML-parsing all ~14k stock task files with their includes resolved:
8-12 s on one core, 26 s on an overloaded one. A run of a stock task needs that index anyway, but a mistyped task
name should not keep every rank waiting that long for its error message (the bad-input bound is 20 s from launch).

So before building the index, rank 0 reads the stock files as text and collects every value of a ``task``,
``group`` or ``tag`` key (scalars, flow lists ``[a, b]`` and block lists, keys quoted or not), in every file that may
be YAML, including the extension-less templates (``_default_template_yaml``) that declare tags for the files that
include them. That is a superset of the index's names (checked against the installed lm-eval in the tests): a name
missing from it is certainly unknown and is refused at once; a name in it still goes through lm-eval's own index.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection

_KEY = re.compile(r"""^['"]?(\w+)['"]?\s*:\s*(.*?)\s*(?:#.*)?$""")  # a top-level key
_ITEM = re.compile(r"^\s*-\s+(.*?)\s*(?:#.*)?$")
_NAME = re.compile(r"""[^\s{}\[\],'"!]+""")  # one token: no spaces, brackets, quotes or YAML tags
_NOT_YAML = (".py", ".pyc", ".md", ".txt", ".json", ".jsonl", ".csv", ".tsv", ".sh", ".ipynb")
_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}


def _values(text: str) -> list[str]:
    """``a`` / ``'a'`` / ``[a, "b"]`` -> the names in it."""
    if text.startswith("["):
        parts = text.strip("[]").split(",")
    else:
        parts = [text]
    return [p.strip().strip("'\"") for p in parts]


def key_values(path: str | Path, keys: Collection[str] = ("task", "group", "tag")) -> set[str]:
    """The values of the top-level ``keys`` of one file, read line by line (no YAML parsing)."""
    found: set[str] = set()
    in_list = False
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            key = _KEY.match(line)
            if key:
                value = key.group(2)
                in_list = key.group(1) in keys and value == ""
                if value and key.group(1) in keys:
                    found.update(_values(value))
                continue
            if in_list:
                item = _ITEM.match(line)
                if item:
                    found.update(_values(item.group(1)))
                elif line.strip() and not line[0].isspace():
                    in_list = False
    return {n for n in found if _NAME.fullmatch(n)}


def names_in_file(path: str | Path) -> set[str]:
    """The ``task``/``group``/``tag`` values of one file, read line by line (no YAML parsing)."""
    return key_values(path)


def scan_task_names(root: str | Path) -> set[str]:
    """Every name any task file under ``root`` may declare (a superset of what ``TaskManager`` indexes there)."""
    names: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for fn in filenames:
            if not fn.endswith(_NOT_YAML):
                names |= names_in_file(os.path.join(dirpath, fn))
    return names


def stock_task_names() -> set[str]:
    """:func:`scan_task_names` of the installed ``lm_eval/tasks`` directory."""
    from mpitp.tasks.offline import stock_tasks_dir

    return scan_task_names(stock_tasks_dir())


def task_file_hint(name: str) -> str:
    """What to pass instead of a task YAML file (or a folder of them) given where a task name goes, else "".

    ``lm_eval --tasks my.yaml`` reads the file; mpitp, whose results, resume and rescore know a task by its name,
    reads task files through ``--include_path``. A plain 'unknown task' sent a user of lm-eval's form looking for a
    typo. The file's names are read as the stock ones are (its ``task``/``group`` lines, no YAML parsing)."""
    from mpitp.escape import shown

    if not (name.endswith((".yaml", ".yml")) or os.sep in name) or not os.path.exists(name):
        return ""
    if os.path.isdir(name):
        return (f": a folder, not a task name: pass it as --include_path {shown(name)} and the names its YAML files "
                "give (task: or group:) to --tasks")
    try:
        names = sorted(key_values(name, ("task", "group")))
    except OSError:
        names = []
    said = f"its name ({', '.join(shown(n) for n in names[:8])})" if names else "the name its task: line gives"
    folder = shown(os.path.dirname(os.path.abspath(name)))
    return f": a file, not a task name: pass its folder as --include_path {folder} and {said} to --tasks"
