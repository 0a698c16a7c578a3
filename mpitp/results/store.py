"""The HDF5 results file: one per evaluation run, written by global rank 0 only (PyPI h5py has no MPI-IO).

Schema (stable; extend, don't break):

- root attrs: ``mpitp_version``, ``created``, ``model``, ``tokenizer``, ``dtype``, ``world_size``, ``tp``, ``dp``,
  ``command``, ``lm_eval_version``, ``torch_version``, ``transformers_version``, ``mpi_version``, ``status``
  (``running`` until metrics are written, then ``complete``), ``config_json`` (the settings resume must match),
  ``wall_time_s``, ``results_json`` (lm-eval's results dict, for ``inspect --json``).
- ``/tasks/<task>`` attrs ``output_type``, ``num_fewshot``, ``n_docs``; ``/tasks/<task>/metrics`` one attr per
  lm-eval metric key (``acc,none``, ``acc_stderr,none``, ...).
- ``/tasks/<task>/requests``: equal-length datasets, one row per lm-eval request instance: ``doc_id`` int64,
  ``idx`` int32, ``kind`` str, ``loglikelihood`` float64 (NaN for generations), ``is_greedy`` bool, ``generation``
  str, ``n_tokens`` int32, ``args_hash`` str (the resume key with task, doc_id and idx). Rows are appended as chunks
  complete, so their order is completion order; sort by (doc_id, idx) to compare.
- ``/stats``: one row per DP group: ``dp_rank``, ``busy_s``, ``requests``, ``tokens_scored``, ``tokens_generated``,
  ``forwards``, ``tp_bytes`` (all TP traffic this group's leader sent), ``tp_score_bytes`` (the scoring reductions
  alone), ``mpi_bytes`` (work and results between DP groups), ``pp_bytes`` (activations and scores all ranks of the
  group sent between pipeline stages; 0 without stages). With stages, ``tp_score_bytes`` is the last stage's (where
  scoring happens). ``requests`` counts a rolling request's windows as shares of it (they may run in different
  groups), so a group's value can be fractional; the sum over groups is whole.
- ``/tasks/<task>/samples`` (with ``--log-samples``): one JSON document per lm-eval sample record.
- root attrs ``run_id`` (names the journal that belongs to this file) and ``journal_seq`` (the last journal record
  the snapshot holds); ``phases_json`` (rank 0's seconds per phase: checks, load, building requests, tokenising,
  dispatch, metrics, writing; written at the end).
- ``<file>.journal`` beside the file while a run is going (or was killed): the rows landed since the last snapshot,
  in the format of :mod:`mpitp.results.journal`. Read the file with :func:`load_rows` / :func:`read_requests` (or
  ``mpitp inspect``), which merge both; a finished run (``status`` ``complete``) has no journal.
- ``/tasks/<task>/doc_scores``: lm-eval's per-document metric values (see :mod:`mpitp.results.docscores`).

Files are opened with HDF5 file locking off by default: lock failures on Lustre and NFS are a common h5py failure
on clusters and there is only ever one writer. Set ``MPITP_HDF5_LOCKING=1`` to turn it back on.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import threading
import time
import uuid
from datetime import datetime, timezone

import h5py
import numpy as np

from mpitp.results.journal import Journal, fsync_dir, journal_path, read_journal

STR = h5py.string_dtype()
REQUEST_FIELDS = {
    "doc_id": np.int64,
    "idx": np.int32,
    "kind": STR,
    "loglikelihood": np.float64,
    "is_greedy": np.bool_,
    "generation": STR,
    "n_tokens": np.int32,
    "args_hash": STR,
    "repeat": np.int32,  # 0..k-1 for the k clones of a request of an lm-eval task with ``repeats: k``
}
STATS_FIELDS = ("busy_s", "requests", "tokens_scored", "tokens_generated", "forwards", "tp_bytes", "tp_score_bytes",
                "mpi_bytes", "pp_bytes")


def _locking() -> bool:
    return os.environ.get("MPITP_HDF5_LOCKING", "0") not in ("0", "", "false", "False")


def open_h5(path: str, mode: str = "r") -> h5py.File:
    return h5py.File(path, mode, locking=_locking())


def _attr(v):
    if v is None:
        return "None"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, default=str)
    if isinstance(v, str):
        return "".join([v])  # a plain str: numpy's str_ would become a fixed-width type h5py cannot store
    if isinstance(v, (bool, int, float, np.generic)):
        return v
    return str(v)


class ResultWriter:
    """Rank 0's results file: an HDF5 snapshot plus an append-only journal of the rows landed since (see
    :mod:`mpitp.results.journal`), written by a background thread so that recording a chunk never holds up dispatch.

    Recording a chunk costs O(chunk): its rows go to memory and, as one checksummed record, to the journal, fsync'd
    once per batch of queued chunks (group commit). The HDF5 snapshot is rewritten from memory (to a temporary,
    fsync'd, ``os.replace``, directory fsync'd) at the start, at the end, and in between at a bounded rate: only when
    the rows have doubled since the last snapshot and ``snapshot_interval_s`` has passed, so the total snapshot cost
    is O(rows). A kill -9 or node crash at any instant leaves a readable snapshot and a journal whose torn tail, if
    any, is ignored: at most the chunks in flight are lost. Readers (:func:`read_requests`, :func:`load_rows`,
    ``inspect``, ``--resume``) merge both; a finished run leaves the snapshot alone (journal removed).
    """

    def __init__(self, path: str, meta: dict, resume: bool = False, snapshot_interval_s: float = 120.0):
        self.path = path
        self.snapshot_interval_s = snapshot_interval_s
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        for stale in glob.glob(glob.escape(path) + ".tmp*") + glob.glob(glob.escape(journal_path(path)) + ".tmp*"):
            os.remove(stale)  # a snapshot or journal a killed run did not finish writing
        self.attrs: dict = {}
        self.tasks: dict[str, dict] = {}
        self.stats: list[dict] | None = None
        self.seq = 0
        if resume and os.path.exists(path):
            self._load(path)
        self.attrs.setdefault("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
        self.attrs.setdefault("run_id", uuid.uuid4().hex)
        self.attrs.update({k: _attr(v) for k, v in meta.items()})
        self.attrs["status"] = "running"
        self.attrs.pop("results_json", None)
        self.busy_s = 0.0  # writer-thread seconds (journal + snapshots), for the phase timings
        self.cpu_s = 0.0  # of which CPU (the rest: waiting for the disk or the interpreter lock)
        self.snapshots = 0
        self._pending: dict[str, dict[str, list]] = {}
        self._journal: Journal | None = None
        self._snapshot_and_rotate()
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="mpitp-results", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ state (touched by the writer thread only)
    def _task(self, task: str) -> dict:
        return self.tasks.setdefault(task, {"attrs": {}, "metrics": {}, "rows": {k: [] for k in REQUEST_FIELDS},
                                            "samples": None, "doc_scores": None})

    def _load(self, path: str) -> None:
        attrs, tasks = load_rows(path, with_task_attrs=True)
        self.attrs = attrs
        self.seq = int(attrs.get("journal_seq", 0))
        for task, (tattrs, cols) in tasks.items():
            t = self._task(task)
            t["attrs"] = tattrs
            for name in REQUEST_FIELDS:
                if name in cols:
                    t["rows"][name] = [_py(x) for x in cols[name]]

    def _add_rows(self, task: str, rows: list[dict]) -> None:
        cols = self._task(task)["rows"]
        pend = self._pending.setdefault(task, {k: [] for k in REQUEST_FIELDS})
        for k in REQUEST_FIELDS:
            vals = [r.get(k, 0) if k == "repeat" else r[k] for r in rows]  # repeat: 0 unless a clone
            cols[k].extend(vals)
            pend[k].extend(vals)

    def _n_rows(self) -> int:
        return sum(len(t["rows"]["doc_id"]) for t in self.tasks.values())

    def _flush_journal(self) -> None:
        if not self._pending:
            return
        self.seq += 1
        self._journal.append({"seq": self.seq, "tasks": self._pending})
        self._pending = {}
        self._journal.sync()

    def _snapshot_and_rotate(self) -> None:
        """Write the snapshot (all rows up to ``self.seq``), then start an empty journal after it."""
        self._write_snapshot()
        if self._journal is not None:
            self._journal.close()
        self._journal = Journal(journal_path(self.path), {"run_id": self.attrs["run_id"], "base_seq": self.seq})
        self._snap_rows, self._snap_time = self._n_rows(), time.monotonic()

    def _maybe_snapshot(self) -> None:
        n = self._n_rows()
        if n >= 2 * max(1, self._snap_rows) and time.monotonic() - self._snap_time >= self.snapshot_interval_s:
            self._snapshot_and_rotate()

    def _loop(self) -> None:
        while True:
            ops = [self._queue.get()]
            while True:  # drain: one journal record and one fsync for everything queued (group commit)
                try:
                    ops.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            t0, c0 = time.perf_counter(), time.thread_time()
            done = []
            try:
                if self._error is None:
                    for op in ops:
                        if callable(op):
                            op()
                        elif op is not None:
                            done.append(op)
                    self._flush_journal()
                    self._maybe_snapshot()
            except BaseException as exc:  # noqa: BLE001 - surfaced on the caller's next call
                self._error = exc
            self.busy_s += time.perf_counter() - t0
            self.cpu_s += time.thread_time() - c0
            for ev in done:
                ev.set()
            if None in ops:
                return

    # ------------------------------------------------------------------ the caller's side (dispatch thread)
    def _check(self) -> None:
        if self._error is not None:
            err, self._error = self._error, RuntimeError("results writer failed earlier")
            raise RuntimeError(f"writing results to {self.path} failed: {err}") from err

    def stored_rows(self) -> dict[tuple, dict]:
        """Every stored request row by its resume key ``(task, doc_id, idx, args_hash, repeat)`` (call before appending)."""
        out = {}
        for task, t in self.tasks.items():
            cols = t["rows"]
            for i in range(len(cols["doc_id"])):
                row = {k: cols[k][i] for k in REQUEST_FIELDS}
                out[(task, int(row["doc_id"]), int(row["idx"]), row["args_hash"], int(row["repeat"]))] = row
        return out

    def append(self, task: str, rows: list[dict]) -> None:
        """Queue ``rows`` of ``task``; returns at once (:meth:`flush` waits until they are on disk)."""
        self._check()
        if rows:
            self._queue.put(lambda: self._add_rows(task, rows))

    def record(self, make_rows) -> None:
        """Queue a callable returning ``{task: rows}``, run on the writer thread: the caller pays O(1) per chunk."""
        self._check()
        self._queue.put(lambda: [self._add_rows(task, rows) for task, rows in make_rows().items() if rows])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far is in the journal and fsync'd."""
        ev = threading.Event()
        self._queue.put(ev)
        if not ev.wait(timeout):
            raise RuntimeError(f"results writer did not flush within {timeout} s")
        self._check()

    def write_task(self, task: str, attrs: dict, metrics: dict, samples: list | None = None) -> None:
        def op():
            t = self._task(task)
            t["attrs"].update({k: _attr(v) for k, v in attrs.items()})
            t["metrics"] = {k: _attr(v) for k, v in metrics.items()}
            if samples is not None:
                t["samples"] = [json.dumps(s, default=str) for s in samples]

        self._check()
        self._queue.put(op)

    def write_doc_scores(self, task: str, scores) -> None:
        """lm-eval's per-document metric values (a :class:`mpitp.results.docscores.DocScores`), written with the file."""
        self._check()
        self._queue.put(lambda: self._task(task).__setitem__("doc_scores", scores))

    def write_stats(self, per_group: list[dict]) -> None:
        self._check()
        self._queue.put(lambda: setattr(self, "stats", per_group))

    def extra_attrs(self, **attrs) -> None:
        """Root attrs added to the next snapshot (e.g. ``phases_json``)."""
        self._check()
        self._queue.put(lambda: self.attrs.update({k: _attr(v) for k, v in attrs.items()}))

    def finish(self, results_json: dict, wall_time_s: float) -> None:
        """Write the complete file (status ``complete``) and remove the journal; stops the writer thread."""
        def op():
            self.attrs["results_json"] = json.dumps(results_json, default=str)
            self.attrs["wall_time_s"] = float(wall_time_s)
            self.attrs["status"] = "complete"
            self._flush_journal()
            self._write_snapshot()
            self._journal.remove()

        self._check()
        self._queue.put(op)
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """Write out what is queued and stop the writer thread (the journal stays: the run is not finished)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        if self._journal is not None:
            self._journal.close()
        self._check()

    def save(self) -> None:
        """Write the snapshot now (everything queued first)."""
        self.flush()
        done = threading.Event()
        self._queue.put(self._snapshot_and_rotate)
        self._queue.put(done)
        done.wait()
        self._check()

    def _write_snapshot(self) -> None:
        t0 = time.perf_counter()
        tmp = f"{self.path}.tmp{os.getpid()}"
        self.attrs["journal_seq"] = int(self.seq)
        with open_h5(tmp, "w") as f:
            for k, v in self.attrs.items():
                f.attrs[k] = v
            tasks = f.create_group("tasks")
            for name, t in self.tasks.items():
                g = tasks.create_group(name)
                for k, v in t["attrs"].items():
                    g.attrs[k] = v
                m = g.create_group("metrics")
                for k, v in t["metrics"].items():
                    m.attrs[k] = v
                req = g.create_group("requests")
                n = len(t["rows"]["doc_id"])
                for col, dt in REQUEST_FIELDS.items():
                    data = np.asarray(t["rows"][col], dtype=object if dt == STR else dt).reshape(n)
                    req.create_dataset(col, data=data, dtype=dt, maxshape=(None,), chunks=(max(1, min(n, 4096)),),
                                       compression="gzip", compression_opts=4)
                if t["samples"] is not None:
                    g.create_dataset("samples", data=np.asarray(t["samples"], dtype=object), dtype=STR)
                if t.get("doc_scores") is not None:
                    from mpitp.results.docscores import write as write_doc_scores

                    write_doc_scores(g, t["doc_scores"])
            if self.stats is not None:
                st = f.create_group("stats")
                st.create_dataset("dp_rank", data=np.arange(len(self.stats), dtype=np.int32))
                for col in STATS_FIELDS:
                    st.create_dataset(col, data=np.asarray([s.get(col, 0) for s in self.stats], dtype=np.float64))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.path)
        self.snapshots += 1
        self.snapshot_s = getattr(self, "snapshot_s", 0.0) + time.perf_counter() - t0



def _py(v):
    """HDF5 value -> plain Python (bytes decoded, numpy scalars unwrapped)."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    if isinstance(v, np.generic):
        return v.item()
    return v


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
        attrs = {k: _py(v) for k, v in f.attrs.items()}
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
            out[task] = ({k: _py(v) for k, v in g.attrs.items()}, cols)
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
