"""Run lm-eval's stock tasks on local JSONL files instead of the Hugging Face Hub.

Compute nodes often have no network, and lm-eval's stock tasks name Hub datasets. lm-eval can read a local JSON(L)
file instead when a task YAML sets ``dataset_path: json`` and ``dataset_kwargs: {data_files: {split: file}}``. Rather
than copying the stock task definitions (prompts, metrics, filters, ``!function`` hooks) and letting them drift from
the installed lm-eval, each override YAML written here ``include``s the stock YAML and only replaces where the data
comes from.

A data directory is laid out ``DIR/<task>/<split>.jsonl`` with split names ``train``, ``validation`` and ``test``,
e.g. ``DIR/arc_easy/test.jsonl``, each row in the schema of the Hub dataset the stock task reads. Files as people
actually download them are found too, because renaming them by hand on every cluster is where mistakes creep in:

- the task's folder may carry a common alternative name (``wikitext2``, ``lambada``, ``ARC-Easy``, ...);
- without ``<split>.jsonl``, any ``*.jsonl`` in the folder whose name has the split as a word (``_``, ``-`` or ``.``
  separated; ``val``, ``valid`` and ``dev`` count as ``validation``) is a candidate, e.g. ``hellaswag_val.jsonl`` or
  ``wikitext-2-raw-v1_test_documents.jsonl``;
- a candidate must have, in its first row, the fields the stock task reads (wikitext's ``page``: the document-level
  file, not the line-level one). More than one candidate left is an error naming them, never a guess.

How lm-eval 0.4.x treats the override YAMLs (checked against lm-eval 0.4.13):

- **Same name as the stock task.** ``TaskManager`` indexes its own task directory first and the ``--include-path``
  directories after it; a later task of the same name replaces the earlier one, with a logged warning
  (``Task 'arc_easy' from OUT/arc_easy.yaml overrides existing task from .../arc/arc_easy.yaml``). So
  ``--tasks arc_easy --include-path OUT`` runs the offline task, and results keep the stock name.
- **Tags are dropped** (``tag: null``). A tag declared by a YAML in the include path replaces the stock tag of the
  same name wholesale: an override inheriting ``tag: [ai2_arc]`` would shrink ``ai2_arc`` to ``{arc_easy}``, silently
  dropping ``arc_challenge``. Without the tag, the stock ``ai2_arc`` still lists ``arc_easy`` and now gets the offline
  one.
- **``include`` must be absolute.** A relative ``include`` is resolved against the including YAML's directory, so the
  stock YAML's path is computed at run time from the installed lm-eval.
- **``!function`` hooks keep working.** lm-eval loads an included YAML with its own directory as the base for
  ``!function`` (hellaswag's ``utils.process_docs``, wikitext's ``preprocess_wikitext.*``), so they resolve to the
  stock modules even though the override lives elsewhere.
- **``data_files`` are resolved against the current directory** by ``datasets``, not against the YAML, so the written
  paths are absolute.
- Every split the stock task names but the data directory lacks is set to ``null``; otherwise lm-eval would ask
  ``datasets`` for a split that does not exist.

**A data directory is untrusted input** (a group shares one; anyone who may write it names its files). An override
YAML is task code to lm-eval (``doc_to_text`` is a Jinja template rendered without a sandbox), so every byte of it is
written by ``yaml.safe_dump`` (:func:`write_override`: a file's name is a quoted, escaped YAML string, never text a
newline could end), and a file or folder whose name holds a control character (newline, CR, ESC, C1 codes, U+2028,
bidi overrides: whatever :func:`mpitp.results.untrusted.shown` would escape) is refused by name wherever a data
directory is read (:func:`unsafe_name`): no honest download is named so, and such a name shown on a terminal or
written into a file is how one turns data into commands.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import yaml

from mpitp.errors import UsageError

SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
"""The task-config keys that name a dataset split."""


class DataDirError(UsageError):
    """``--data-dir`` is unusable (missing, not a directory, or lacking the files a requested task needs)."""


class UnsafeName(DataDirError):
    """A data directory or file whose name holds a control character (:func:`refuse_unsafe`): no download fixes it."""


@dataclass(frozen=True)
class StockTask:
    """One stock lm-eval task we can serve from local files.

    ``yaml``: the stock YAML, relative to the installed ``lm_eval/tasks`` directory.
    ``splits``: every split the stock YAML names, as (task-config key, split name) pairs, e.g.
    ``("test_split", "test")``; these are the keys an override must set, to the split or to ``null``.
    ``required``: the splits without which the task cannot run the way the stock one does (the split it evaluates,
    and for gsm8k the ``train`` split its default 5-shot prompt is drawn from). The other splits are used if present.
    ``fields``: the row fields the stock task reads (its prompt, target and ``process_docs``); a file found by name
    must have them. ``folders``: other common names of the task's data folder, tried after the task's own name.
    """

    yaml: str
    splits: tuple[tuple[str, str], ...]
    required: tuple[str, ...]
    fields: tuple[str, ...] = ()
    folders: tuple[str, ...] = ()

    @property
    def split_names(self) -> tuple[str, ...]:
        """The distinct split names the stock task reads, in order of first mention."""
        return tuple(dict.fromkeys(split for _, split in self.splits))


STOCK_TASKS: Mapping[str, StockTask] = MappingProxyType(
    {
        "arc_easy": StockTask(
            yaml="arc/arc_easy.yaml",
            splits=(("training_split", "train"), ("validation_split", "validation"), ("test_split", "test")),
            required=("test",),
            fields=("question", "choices", "answerKey"),
            folders=("ARC-Easy", "arc-easy", "ai2_arc"),
        ),
        "hellaswag": StockTask(
            yaml="hellaswag/hellaswag.yaml",
            splits=(("training_split", "train"), ("validation_split", "validation")),
            required=("validation",),
            fields=("activity_label", "ctx_a", "ctx_b", "endings", "label"),
        ),
        "piqa": StockTask(
            yaml="piqa/piqa.yaml",
            splits=(("training_split", "train"), ("validation_split", "validation")),
            required=("validation",),
            fields=("goal", "sol1", "sol2", "label"),
        ),
        "lambada_openai": StockTask(
            yaml="lambada/lambada_openai.yaml",
            splits=(("test_split", "test"),),
            required=("test",),
            fields=("text",),
            folders=("lambada",),
        ),
        "wikitext": StockTask(
            yaml="wikitext/wikitext.yaml",
            splits=(("training_split", "train"), ("validation_split", "validation"), ("test_split", "test")),
            required=("test",),
            fields=("page",),
            folders=("wikitext2", "wikitext-2", "wikitext_document_level", "wikitext-2-raw-v1"),
        ),
        "gsm8k": StockTask(
            yaml="gsm8k/gsm8k.yaml",
            splits=(("training_split", "train"), ("fewshot_split", "train"), ("test_split", "test")),
            required=("train", "test"),
            fields=("question", "answer"),
        ),
    }
)
"""The stock tasks served offline, by their stock (and override) name. Read-only."""


def stock_tasks_dir() -> Path:
    """The installed ``lm_eval/tasks`` directory, found without importing ``lm_eval.tasks`` (which is slow)."""
    spec = importlib.util.find_spec("lm_eval.tasks")
    if spec is None or spec.origin is None:
        raise RuntimeError("lm_eval is not installed: cannot locate its stock task YAMLs")
    return Path(spec.origin).resolve().parent


def unsafe_name(path: str | Path) -> str | None:
    """The characters of ``path`` that no data file's name may hold (control characters, line and paragraph
    separators, bidi overrides: what :func:`mpitp.results.untrusted.shown` escapes), escaped and comma-separated;
    None when it holds none. Such a name ends a line wherever it is printed or written: refused, never served."""
    text = str(path)
    if text.isprintable():
        return None
    from mpitp.results.untrusted import shown

    return ", ".join(shown(c) for c in dict.fromkeys(c for c in text if not c.isprintable()))


def refuse_unsafe(path: str | Path, what: str) -> None:
    """Raise :class:`UnsafeName` (one line, the name escaped) when ``path`` holds a character :func:`unsafe_name`
    finds. ``what`` says what the path is (``--data-dir``, ``data file``)."""
    bad = unsafe_name(path)
    if bad:
        from mpitp.results.untrusted import shown

        raise UnsafeName(f"{what} {shown(path)} has control characters in its name ({bad}); mpitp does not "
                           f"read a file so named (it would end a line of the task YAML or of the terminal): "
                           f"rename or remove it")


#: What ``datasets`` expands in a ``data_files`` path (fsspec's glob): a data directory whose path holds one is read as
#: a pattern (``d[1]`` matched nothing: a StopIteration traceback; ``d*x`` also read a neighbour's ``dEVILx``).
GLOB_CHARS = "*?["


def refuse_glob(path: Path) -> None:
    """Raise :class:`UnsafeName` when the data directory ``path`` (resolved) holds one of :data:`GLOB_CHARS`."""
    bad = "".join(dict.fromkeys(c for c in str(path) if c in GLOB_CHARS))
    if bad:
        from mpitp.results.untrusted import shown

        raise UnsafeName(f"--data-dir {shown(path)} has glob characters in its path ({bad}): datasets would read "
                         f"every file the pattern matches, not just the ones in it; use a path without them")


def resolved(data_dir: str | Path) -> Path:
    """``data_dir`` absolute, its links resolved; a link loop (RuntimeError before Python 3.13, then OSError: a
    traceback from ``mpitp tasks``/``check``/``prefetch``) is kept as written: no directory is found there, one line."""
    path = Path(data_dir).expanduser()
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return path.absolute()


def data_dir_problem(data_dir: str | Path) -> str | None:
    """The one line for a ``--data-dir`` that is not a directory (None when it is): every command that takes one
    (eval, check, tasks, prefetch) says the same, escaped."""
    from mpitp.results.untrusted import shown

    path = Path(data_dir).expanduser()
    if path.is_dir():
        return None
    return f"--data-dir {shown(data_dir)}: {'not a directory' if path.exists() else 'no such directory'}"


def safe_data_dir(data_dir: str | Path) -> Path:
    """``data_dir`` :func:`resolved`, refused when its real name holds a control character or glob characters (a link
    in a group folder may point at any name; ``datasets`` expands a glob in a data file's path)."""
    path = resolved(data_dir)
    refuse_unsafe(path, "--data-dir")
    refuse_glob(path)
    return path


def _check_data_dir(data_dir: str | Path) -> Path:
    problem = data_dir_problem(data_dir)
    if problem:
        raise DataDirError(problem)
    return safe_data_dir(data_dir)


SPLIT_WORDS = MappingProxyType({"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
                                "test": ("test",)})
"""The words in a file name that mark it as holding a split (``hellaswag_val.jsonl`` is the validation split)."""


#: Bytes of a candidate file read to find its first row (:func:`_first_row_fields`): a data folder is untrusted, and a
#: file of no newline was one "line" as large as itself (a sparse 30 GB ``*.jsonl``: 22 GB of memory, then killed).
FIRST_ROW_BYTES = 16 << 20


def _first_row_fields(path: Path) -> set[str] | None:
    """The keys of the first non-empty row of a JSONL file, or None when it is unreadable, not a JSON object, or not
    found in the file's first :data:`FIRST_ROW_BYTES`."""
    left = FIRST_ROW_BYTES
    try:
        with path.open("rb") as fh:
            while left > 0:
                line = fh.readline(left)
                if not line:
                    return set()
                left -= len(line)
                if line.strip():
                    row = json.loads(line)
                    return set(row) if isinstance(row, dict) else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return None


def _split_file(data_dir: Path, task: str, split: str) -> Path | None:
    """The file holding ``split`` of ``task`` under ``data_dir`` (see the module docstring), or None.

    Raises :class:`DataDirError` when more than one file could be it.
    """
    stock = STOCK_TASKS[task]
    for folder in (task, *stock.folders):
        base = data_dir / folder
        if not base.is_dir():
            continue
        exact = base / f"{split}.jsonl"
        if exact.is_file():
            return exact
        words = set(SPLIT_WORDS.get(split, (split,)))
        listed = sorted(base.glob("*.jsonl"))
        for f in listed:  # every name the glob sees: a newline in one may also fake the split word
            refuse_unsafe(f.relative_to(data_dir), "data file")
        named = [f for f in listed if f.is_file() and words & set(re.split(r"[^a-z0-9]+", f.stem.lower()))]
        fits = [f for f in named if set(stock.fields) <= (_first_row_fields(f) or set())]
        if len(fits) > 1:
            raise DataDirError(f"{task} {split} split: {', '.join(str(f.relative_to(data_dir)) for f in fits)} "
                               f"all fit; keep one or name it {folder}/{split}.jsonl")
        if fits:
            return fits[0]
    return None


def split_files(data_dir: str | Path, task: str) -> dict[str, Path]:
    """``{split: file}`` for every split of ``task`` found under ``data_dir``."""
    path = _check_data_dir(data_dir)
    found = {s: _split_file(path, task, s) for s in STOCK_TASKS[task].split_names}
    return {s: f for s, f in found.items() if f is not None}


def _missing(task: str, files: dict[str, Path]) -> list[str]:
    """The required splits of ``task`` that ``files`` (:func:`split_files`) lacks, as ``arc_easy/test.jsonl``."""
    return [f"{task}/{split}.jsonl" for split in STOCK_TASKS[task].required if split not in files]


class OfflineStatus(NamedTuple):
    """One row of ``mpitp tasks --data-dir``: whether ``task`` runs offline, what it lacks, which files it reads."""

    task: str
    runnable: bool
    missing: list[str]
    files: dict[str, Path]


def offline_status(data_dir: str | Path) -> list[OfflineStatus]:
    """For each task of :data:`STOCK_TASKS`: its :class:`OfflineStatus`, for ``mpitp tasks --data-dir``.

    ``missing`` lists the required split files absent from ``data_dir`` (relative to it), or why a folder's files
    could not be told apart; a task is runnable when it is empty. Optional splits do not count: without them the task
    still runs as the stock one does.
    """
    path = _check_data_dir(data_dir)
    out = []
    for task in STOCK_TASKS:
        try:
            files = split_files(path, task)
            missing = _missing(task, files)
        except DataDirError as exc:
            missing, files = [str(exc)], {}
        out.append(OfflineStatus(task, not missing, missing, files))
    return out


def task_config(task: str, data_dir: str | Path) -> dict:
    """The override config for ``task`` reading its splits from ``data_dir`` (see the module docstring).

    Raises :class:`DataDirError` when a required split file is missing.
    """
    path = _check_data_dir(data_dir)
    stock = STOCK_TASKS[task]
    present = split_files(path, task)
    missing = _missing(task, present)
    if missing:
        raise DataDirError(f"--data-dir {data_dir}: task {task} needs {', '.join(missing)}")
    stock_yaml = stock_tasks_dir() / stock.yaml
    if not stock_yaml.is_file():
        raise RuntimeError(f"stock task YAML {stock_yaml} not found: is this lm-eval version supported?")

    cfg: dict = {
        "include": str(stock_yaml),
        "task": task,
        "tag": None,
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {s: str(f) for s, f in present.items()}},
    }
    for key, split in stock.splits:
        cfg[key] = split if split in present else None
    return cfg


def write_task_yamls(
    data_dir: str | Path, out_dir: str | Path, tasks: Iterable[str] | None = None
) -> dict[str, str]:
    """Write an override YAML ``out_dir/<task>.yaml`` per runnable stock task; return ``{task: yaml_path}``.

    Pass ``out_dir`` to lm-eval as ``--include-path`` (``TaskManager(include_path=out_dir)``); the overrides keep the
    stock names, so ``--tasks arc_easy`` then reads ``data_dir/arc_easy/*.jsonl``.

    ``tasks=None`` writes every task of :data:`STOCK_TASKS` whose required files exist and skips the others
    (:func:`offline_status` says why). Naming tasks asks for exactly those: a name outside :data:`STOCK_TASKS`, or one
    whose files are missing, raises :class:`DataDirError` rather than letting lm-eval fall back to the Hub
    (callers mixing offline and other tasks should pass ``[t for t in tasks if t in STOCK_TASKS]``).
    """
    path = _check_data_dir(data_dir)
    if tasks is None:
        names = [row.task for row in offline_status(path) if row.runnable]
    else:
        names = list(dict.fromkeys([tasks] if isinstance(tasks, str) else tasks))
        unknown = [t for t in names if t not in STOCK_TASKS]
        if unknown:
            raise DataDirError(
                f"--data-dir {data_dir}: no offline version of {', '.join(unknown)} "
                f"(offline tasks: {', '.join(STOCK_TASKS)})"
            )
    configs = {t: task_config(t, path) for t in names}  # all checks before writing anything

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for task, cfg in configs.items():
        written[task] = write_override(out / f"{task}.yaml", cfg)
    return written


OVERRIDE_HEADER = "# Written by mpitp: an lm-eval task override; what it reads is under dataset_kwargs.\n"
"""The one comment line of an override YAML: fixed text, so that no name (a data file's, a folder's) can end it and
turn the rest of the name into task keys."""


def write_override(target: Path, cfg: dict) -> str:
    """Write the override config ``cfg`` to ``target`` through ``yaml.safe_dump`` alone (after the fixed
    :data:`OVERRIDE_HEADER`): names from a data directory are YAML strings, quoted and escaped by the dumper, never
    text formatted into the file. ``str(target)``."""
    target.write_text(OVERRIDE_HEADER + yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return str(target)
