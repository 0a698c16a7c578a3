"""Reading an mpitp HDF5 results file (see :mod:`mpitp.results.schema`) into plain objects for
``mpitp inspect``: the run's attributes, its tasks and their metrics (:class:`RunFile`), request rows and samples on
demand, and one :class:`MetricRow` per (task, metric, filter).

Files are only ever opened read-only (:func:`mpitp.results.schema.open_h5`, HDF5 file locking off by default), so
reading a file that a running evaluation is writing is safe: each open sees one complete snapshot, merged with the
rows of the journal beside it (:func:`mpitp.results.rows.load_rows`). What h5py raises on a damaged or foreign file
becomes one :class:`BadInput` line; a TypeError or AttributeError is a bug of ours and surfaces as itself.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mpitp.results.untrusted import BadInput, load_json, mapping, shown

if TYPE_CHECKING:
    import numpy as np

# numpy and h5py (through mpitp.results.schema) are imported inside the functions that use them, so that registering
# ``mpitp inspect`` costs ``mpitp --help`` nothing.

# Keys of /tasks/<task>/metrics (and of results_json["results"][task]) that are not metrics.
NON_METRIC_KEYS = {"name", "alias", "sample_len", "samples"}




_SHOWN = "replace"  # attribute bytes that are not UTF-8 are shown with U+FFFD, never fail the print


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _not_mpitp(path: str, reason: str) -> BadInput:
    return BadInput(f"{path} is not an mpitp results file ({reason})")


def check_path(path: str) -> None:
    if not os.path.exists(path):
        raise BadInput(f"{path}: no such file")
    if os.path.isdir(path):
        raise _not_mpitp(path, "it is a directory")
    if not os.access(path, os.R_OK):
        raise BadInput(f"{path}: permission denied")


@dataclass
class TaskInfo:
    name: str
    attrs: dict
    metrics: dict
    n_rows: int


@dataclass
class RunFile:
    """Everything but the request rows and samples (read on demand: they can be large)."""

    path: str
    attrs: dict
    tasks: dict[str, TaskInfo]
    stats: dict[str, np.ndarray] | None
    results_json: dict | None = None
    extra_results: dict = field(default_factory=dict)  # results_json entries with no /tasks group (lm-eval groups)

    @property
    def status(self) -> str:
        return str(self.attrs.get("status", "unknown"))

    def task(self, name: str) -> TaskInfo:
        if name in self.extra_results:  # an lm-eval group: its aggregate, no rows of its own
            raise BadInput(f"{self.path}: '{name}' is a group, whose rows and samples are its tasks' (tasks: "
                           f"{', '.join(self.tasks) or 'none'})")
        if name not in self.tasks:
            known = ", ".join(self.tasks) or "none"
            groups = f"; groups: {', '.join(self.extra_results)}" if self.extra_results else ""
            raise BadInput(f"{self.path} has no task '{name}' (tasks: {known}{groups})")
        return self.tasks[name]


def load(path: str) -> RunFile:
    """Read the summary of ``path``; any failure is a one-line :class:`BadInput`."""
    from mpitp.results.rows import request_counts
    from mpitp.results.schema import open_h5, py_value

    check_path(path)
    try:
        with open_h5(path) as f:
            attrs = {k: py_value(v, _SHOWN) for k, v in f.attrs.items()}
            if "tasks" not in f:
                raise _not_mpitp(path, "no /tasks group")
            if "status" not in attrs:
                raise _not_mpitp(path, "no 'status' attribute")
            import h5py

            if not isinstance(f["tasks"], h5py.Group):
                raise _not_mpitp(path, "/tasks is not a group")
            tasks = {}
            for name, g in f["tasks"].items():
                if not isinstance(g, h5py.Group) or not isinstance(g.get("requests", g), h5py.Group):
                    raise _not_mpitp(path, f"/tasks/{shown(name)} is not a task group")
                metrics = g.get("metrics")
                tasks[name] = TaskInfo(
                    name=name,
                    attrs={k: py_value(v, _SHOWN) for k, v in g.attrs.items()},
                    metrics={k: py_value(v, _SHOWN) for k, v in metrics.attrs.items()} if metrics is not None else {},
                    n_rows=0,  # counted below, journal included
                )
            stats = _stats(f["stats"]) if "stats" in f else None
        for name, n in request_counts(path).items():  # a running or killed run's rows are partly in its journal
            if name in tasks:
                tasks[name].n_rows = n
            else:
                tasks[name] = TaskInfo(name=name, attrs={}, metrics={}, n_rows=n)
    except BadInput as exc:
        raise exc if str(exc).startswith(path) else _not_mpitp(path, str(exc)) from None
    except (OSError, KeyError, ValueError, RuntimeError) as exc:  # what h5py raises on a damaged or foreign file;
        raise _not_mpitp(path, one_line(exc)) from None  # a TypeError/AttributeError is a bug of ours: it surfaces
    run = RunFile(path=path, attrs=attrs, tasks=tasks, stats=stats)
    if "results_json" in attrs:
        try:
            if not isinstance(attrs["results_json"], str):
                raise ValueError(f"a {type(attrs['results_json']).__name__}, not a JSON string")
            run.results_json = _results_json(load_json(attrs["results_json"], "results_json"))
        except ValueError as exc:
            raise _not_mpitp(path, f"results_json is not valid: {one_line(exc)}") from None
        res = run.results_json.get("results", {})
        run.extra_results = {k: v for k, v in res.items() if k not in tasks and isinstance(v, dict)}
    return run


def _stats(st) -> dict[str, np.ndarray]:
    """/stats: one-dimensional number columns of one length (the file is untrusted; check_h5 bounded the sizes)."""
    import h5py
    import numpy as np

    from mpitp.results.schema import STATS_FIELDS

    if not isinstance(st, h5py.Group):
        raise BadInput("/stats is not a group")
    out = {}
    for k in ("dp_rank", *STATS_FIELDS):
        if k in st:
            d = st[k]
            if not isinstance(d, h5py.Dataset) or d.ndim != 1 or d.dtype.kind not in "biuf":
                raise BadInput(f"/stats/{k} is not a column of numbers")
            out[k] = np.asarray(d[()], dtype=np.float64 if k != "dp_rank" else np.int64)
    if len({len(v) for v in out.values()}) > 1:
        raise BadInput("/stats columns have different lengths")
    return out


def _results_json(res) -> dict:
    """lm-eval's results dict as stored: the parts mpitp reads must have their types (dicts of dicts)."""
    mapping(res, "results_json")
    for key in ("results", "n-samples", "higher_is_better", "configs", "n-shot", "versions"):
        for name, v in mapping(res.get(key, {}), f"results_json['{key}']").items():
            if key in ("results", "n-samples", "higher_is_better", "configs"):
                mapping(v, f"results_json['{key}'][{shown(repr(name))}]")
    return res


def load_requests(path: str, task: str) -> dict[str, np.ndarray]:
    """The request rows of ``task`` sorted by (doc_id, idx), strings decoded (as
    :func:`mpitp.results.rows.read_requests`, but a damaged file gives a one-line error)."""
    from mpitp.results.rows import read_requests

    try:
        cols = read_requests(path, task)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise _not_mpitp(path, f"requests of task {task}: {one_line(exc)}") from None
    return cols


def load_samples(path: str, task: str) -> list[str] | None:
    from mpitp.results.schema import open_h5

    try:
        with open_h5(path) as f:
            g = f.get(f"tasks/{task}")  # None: an unfinished run whose rows of the task are in its journal only
            if g is None or "samples" not in g:
                return None
            return [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in g["samples"][()]]
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise _not_mpitp(path, f"samples of task {task}: {one_line(exc)}") from None


@dataclass
class MetricRow:
    task: str
    metric: str
    filter: str
    value: object
    stderr: object  # a float, "N/A" or None
    n: int | None


def as_number(v: object) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _metric_rows(task: str, metrics: dict, n: int | None) -> list[MetricRow]:
    rows = []
    for key, value in metrics.items():
        if key in NON_METRIC_KEYS or "," not in key:
            continue
        metric, _, filt = key.partition(",")
        if metric.endswith("_stderr"):
            continue
        rows.append(MetricRow(task, metric, filt, value, metrics.get(f"{metric}_stderr,{filt}"), n))
    return rows


def _count(v) -> int | None:
    """A document count as a file stores it: a finite number (a NaN, text or list there is no count)."""
    x = as_number(v)
    return int(x) if x is not None and not isinstance(v, bool) and math.isfinite(x) else None


def task_n_docs(run: RunFile, t: TaskInfo) -> int | None:
    for v in (t.attrs.get("n_docs"), t.metrics.get("sample_len")):
        if _count(v) is not None:
            return _count(v)
    ns = (run.results_json or {}).get("n-samples", {}).get(t.name, {})
    return _count(ns.get("effective", ns.get("original"))) if isinstance(ns, dict) else None


def metric_rows(run: RunFile, task: str | None = None) -> list[MetricRow]:
    """One row per (task, metric, filter): every task's ``/metrics`` attrs, then lm-eval group aggregates."""
    rows = []
    for name, t in run.tasks.items():
        if task is None or name == task:
            rows += _metric_rows(name, t.metrics, task_n_docs(run, t))
    for name, res in run.extra_results.items():
        if task is None or name == task:
            rows += _metric_rows(name, res, None)
    return rows
