"""Reading a job file's YAML: the safe loader with duplicate keys refused and aliases bounded, and the one error every
job-file refusal is (:class:`JobFileError`). Kept apart from :mod:`mpitp.jobs.jobfile`, which checks the fields."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

MAX_VALUES = 1_000_000
"""Values a job file may hold with its aliases copied out: a campaign of thousands of runs holds tens of thousands."""


class JobFileError(ValueError):
    """A job file is unreadable or invalid; ``str()`` is the full one-line message."""

    def __init__(self, message: str, *, path: str | None = None, run: int | None = None,
                 run_name: str | None = None, field: str | None = None):
        super().__init__(message)
        self.path, self.run, self.run_name, self.field = path, run, run_name, field


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: PyYAML keeps the last one silently,
    which would turn a copy-paste slip into a quietly wrong run."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:  # unhashable key; SafeLoader reports it
                    continue
                if dup:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path, shown: str) -> Any:
    """The job file's YAML (safe loader, duplicate keys refused, aliases bounded) or the :class:`JobFileError` that
    names the file and, where YAML says, the line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise JobFileError(f"{shown}: cannot read job file: {exc.strerror or exc}", path=shown) from None
    except UnicodeDecodeError as exc:
        raise JobFileError(f"{shown}: not a UTF-8 text file ({exc.reason})", path=shown) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - SafeLoader subclass
        values = _expanded_values(data, {})
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = exc.problem or exc.context or "syntax error"
        raise JobFileError(f"{shown}: {where}invalid YAML: {problem}", path=shown) from None
    except yaml.YAMLError as exc:
        raise JobFileError(f"{shown}: invalid YAML: {exc}", path=shown) from None
    except RecursionError:  # PyYAML's composer recurses per level: [[[...]]] 3000 deep was its traceback
        raise JobFileError(f"{shown}: invalid YAML: nested deeper than {sys.getrecursionlimit()} levels",
                           path=shown) from None
    if values > MAX_VALUES:
        raise JobFileError(f"{shown}: holds {values} values with its aliases (*name) copied out, more than the "
                           f"{MAX_VALUES} a job file may: each run's settings are copied out that far", path=shown)
    return data


def _expanded_values(node: Any, memo: dict[int, int]) -> int:
    """How many values ``node`` holds once every alias is copied out (what thawing a run's settings and writing them
    as JSON into its results file do), each shared object counted once per time it is used."""
    if not isinstance(node, (dict, list)):
        return 1
    if id(node) not in memo:
        memo[id(node)] = 0  # a recursive alias counts once
        items = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        memo[id(node)] = 1 + sum(_expanded_values(x, memo) for x in items)
    return memo[id(node)]
