"""Reading the request rows and metrics of a results file (schema: :mod:`mpitp.results.schema`): the HDF5 snapshot
merged with the journal that a running or killed run left beside it (:mod:`mpitp.results.journal`), so a reader sees
every row that reached the disk, whenever it reads."""

from __future__ import annotations

import time

import numpy as np

from mpitp.results.journal import journal_path, read_journal
from mpitp.results.schema import REQUEST_FIELDS, STR, open_h5, py_value
from mpitp.results.untrusted import BadInput, int_attr, mapping, shown


def _decode(a: np.ndarray) -> np.ndarray:
    if a.dtype == object:
        return np.array([x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in a], dtype=object)
    return a


def _column(values, name: str) -> np.ndarray:
    """A request column of its schema type (a file is untrusted: anything else there is :class:`BadInput`)."""
    dt = REQUEST_FIELDS[name]
    if not isinstance(values, (list, np.ndarray)) or np.ndim(values) != 1:
        raise BadInput(f"request column {name} is not a list of values")
    if dt == STR:
        return np.asarray([v if isinstance(v, str) else str(v) for v in values], dtype=object).reshape(len(values))
    try:
        return np.asarray(values, dtype=dt).reshape(len(values))
    except (TypeError, ValueError, OverflowError):
        raise BadInput(f"request column {name} holds values that are not {np.dtype(dt).name}") from None


def _group(obj, what: str):
    """``obj`` when it is an HDF5 group (a file may put a dataset, or nothing usable, where a group belongs)."""
    import h5py

    if not isinstance(obj, h5py.Group):
        raise BadInput(f"{shown(what)} is not a group")
    return obj


def _dataset_1d(obj, what: str):
    import h5py

    if not isinstance(obj, h5py.Dataset) or obj.ndim != 1:
        raise BadInput(f"{shown(what)} is not a one-dimensional dataset")
    return obj


class _StaleSnapshot(Exception):
    """The journal was rotated after the snapshot we read: a newer snapshot is in place, read again."""


def _journal_tail(path: str, attrs: dict, tasks: set | None) -> tuple[dict[str, dict[str, list]], int]:
    """Rows in ``path``'s journal that the snapshot (root ``attrs``) does not hold, and the last record's seq."""
    seq0 = int_attr(attrs, "journal_seq")
    run_id = attrs.get("run_id")
    if not run_id or attrs.get("status") == "complete":
        return {}, seq0
    header, records = read_journal(journal_path(path))
    if header is None or header.get("run_id") != run_id:
        return {}, seq0
    if int_attr(header, "base_seq") > seq0:
        raise _StaleSnapshot
    out: dict[str, dict[str, list]] = {}
    last = seq0
    for i, rec in enumerate(records, 1):
        rec = mapping(rec, f"journal record {i}")
        seq = int_attr(rec, "seq")
        if seq <= seq0:
            continue
        last = max(last, seq)
        for task, cols in mapping(rec.get("tasks", {}), f"journal record {i}'s tasks").items():
            if tasks is not None and task not in tasks:
                continue
            cols = mapping(cols, f"journal record {i}'s task {shown(task)}")
            n = len(_column(cols.get("doc_id"), "doc_id"))
            dst = out.setdefault(task, {k: [] for k in REQUEST_FIELDS})
            for k in REQUEST_FIELDS:  # a journal from before the repeat column: no clone but the first
                col = _column(cols[k], k) if k in cols else np.zeros(n, dtype=np.int32)
                if len(col) != n:
                    raise BadInput(f"journal record {i}: task {shown(task)}'s columns have different lengths")
                dst[k].extend(col.tolist())
    return out, last


def load_rows(path: str, tasks: set | None = None, with_task_attrs: bool = False,
              counts_only: bool = False) -> tuple[dict, dict]:
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
        groups = f.get("tasks")
        for task, g in (() if groups is None else _group(groups, "/tasks").items()):
            if tasks is not None and task not in tasks:
                continue
            req = _group(g, f"/tasks/{task}").get("requests")
            req = None if req is None else _group(req, f"/tasks/{task}/requests")
            names = [name for name in REQUEST_FIELDS if req is not None and name in req]
            data = {name: _dataset_1d(req[name], f"/tasks/{task}/requests/{name}") for name in names}
            if counts_only:
                cols = int(data["doc_id"].shape[0]) if "doc_id" in data else 0
            else:
                cols = {name: _column(_decode(d[()]), name) for name, d in data.items()}
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
