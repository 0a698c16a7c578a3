"""Reading the request rows and metrics of a results file (schema: :mod:`mpitp.results.schema`): the HDF5 snapshot
merged with the journal that a running or killed run left beside it (:mod:`mpitp.results.journal`), so a reader sees
every row that reached the disk, whenever it reads."""

from __future__ import annotations

import time

import numpy as np

from mpitp.results.journal import journal_path, read_journal
from mpitp.results.schema import REQUEST_FIELDS, STR, open_h5, py_value


def _decode(a: np.ndarray) -> np.ndarray:
    if a.dtype == object:
        return np.array([x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in a], dtype=object)
    return a


def _column(values: list, name: str) -> np.ndarray:
    dt = REQUEST_FIELDS[name]
    return np.asarray(values, dtype=object if dt == STR else dt).reshape(len(values))


class _StaleSnapshot(Exception):
    """The journal was rotated after the snapshot we read: a newer snapshot is in place, read again."""


def _journal_tail(path: str, attrs: dict, tasks: set | None) -> tuple[dict[str, dict[str, list]], int]:
    """Rows in ``path``'s journal that the snapshot (root ``attrs``) does not hold, and the last record's seq."""
    seq0 = int(attrs.get("journal_seq", 0))
    run_id = attrs.get("run_id")
    if not run_id or attrs.get("status") == "complete":
        return {}, seq0
    header, records = read_journal(journal_path(path))
    if header is None or header.get("run_id") != run_id:
        return {}, seq0
    if int(header.get("base_seq", 0)) > seq0:
        raise _StaleSnapshot
    out: dict[str, dict[str, list]] = {}
    last = seq0
    for rec in records:
        if int(rec.get("seq", 0)) <= seq0:
            continue
        last = max(last, int(rec["seq"]))
        for task, cols in rec.get("tasks", {}).items():
            if tasks is not None and task not in tasks:
                continue
            dst = out.setdefault(task, {k: [] for k in REQUEST_FIELDS})
            for k in REQUEST_FIELDS:  # a journal from before the repeat column: no clone but the first
                dst[k].extend(cols[k] if k in cols else [0] * len(cols["doc_id"]))
    return out, last


def load_rows(path: str, tasks: set | None = None, with_task_attrs: bool = False, counts_only: bool = False):
    """Root attrs and every request row of a results file: the HDF5 snapshot merged with the journal a running or
    killed run left beside it. Returns ``(attrs, {task: columns})`` (``{task: (task_attrs, columns)}`` with
    ``with_task_attrs``; ``{task: n_rows}`` with ``counts_only``). ``attrs["journal_seq"]`` is the last record read.
    """
    for attempt in range(20):
        try:
            return _load_rows_once(path, tasks, with_task_attrs, counts_only)
        except _StaleSnapshot:
            time.sleep(0.01 * (attempt + 1))
    raise OSError(f"{path}: the snapshot kept changing while it was read")


def _load_rows_once(path, tasks, with_task_attrs, counts_only):
    with open_h5(path) as f:
        attrs = {k: py_value(v) for k, v in f.attrs.items()}
        tail, last = _journal_tail(path, attrs, tasks)
        out = {}
        for task, g in f.get("tasks", {}).items():
            if tasks is not None and task not in tasks:
                continue
            req = g.get("requests")
            if counts_only:
                cols = int(req["doc_id"].shape[0]) if req is not None and "doc_id" in req else 0
            else:
                cols = {name: _decode(req[name][()]) for name in REQUEST_FIELDS if req is not None and name in req}
                if "doc_id" in cols and "repeat" not in cols:  # a file from before the column: first clones only
                    cols["repeat"] = np.zeros(len(cols["doc_id"]), dtype=np.int32)
            out[task] = ({k: py_value(v) for k, v in g.attrs.items()}, cols)
    for task, jcols in tail.items():
        tattrs, cols = out.get(task, ({}, 0 if counts_only else {}))
        if counts_only:
            cols += len(jcols["doc_id"])
        else:
            cols = {k: np.concatenate([cols[k], _column(jcols[k], k)]) if k in cols else _column(jcols[k], k)
                    for k in REQUEST_FIELDS}
        out[task] = (tattrs, cols)
    attrs["journal_seq"] = last
    return attrs, (out if with_task_attrs else {t: c for t, (_, c) in out.items()})


def request_counts(path: str) -> dict[str, int]:
    """Request rows per task, journal included (cheap: no row is read from the snapshot)."""
    return load_rows(path, counts_only=True)[1]


def read_requests(path: str, task: str) -> dict[str, np.ndarray]:
    """All request rows of ``task`` (the journal's included), sorted by (doc_id, idx); strings decoded."""
    _, rows = load_rows(path, tasks={task})
    if task not in rows:
        raise KeyError(f"no task {task!r} in {path}")
    cols = rows[task]
    if set(cols) != set(REQUEST_FIELDS):
        raise KeyError(f"requests of task {task}: missing columns {sorted(set(REQUEST_FIELDS) - set(cols))}")
    if len({len(v) for v in cols.values()}) > 1:
        raise ValueError(f"requests of task {task}: columns of different lengths")
    order = np.lexsort((cols["repeat"], cols["idx"], cols["doc_id"]))
    return {k: v[order] for k, v in cols.items()}


def read_metrics(path: str, task: str) -> dict:
    with open_h5(path) as f:
        return {k: (v.item() if hasattr(v, "item") else v) for k, v in f[f"tasks/{task}/metrics"].attrs.items()}
