"""Writing the HDF5 results file (schema: :mod:`mpitp.results.schema`; reading: :mod:`mpitp.results.rows`): rank 0's
:class:`ResultWriter`, an HDF5 snapshot plus the journal of :mod:`mpitp.results.journal`, on a background thread."""

from __future__ import annotations

import errno
import json
import os
import queue
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import h5py
import numpy as np

from mpitp.errors import JobError
from mpitp.escape import shown
from mpitp.results.journal import Journal, RecordTooLong, journal_path
from mpitp.results.rows import load_rows
from mpitp.results.safefile import new_mode, remove_own_temps, write_failure, write_replace
from mpitp.results.schema import REQUEST_FIELDS, STATS_FIELDS, STR, h5_attr, py_value

if TYPE_CHECKING:
    from collections.abc import Callable

    from mpitp.results.docscores import DocScores


class ResultsWriteError(JobError):
    """The file system refused a write of the results file or its journal (full, over quota, failing, read-only):
    one line saying which file, why and what is kept (:mod:`mpitp.errors` prints a :class:`JobError` so, without a
    traceback), since nothing is lost and the remedy is the user's: free space and resume."""


_REMEDY = {errno.ENOSPC: "free space", errno.EDQUOT: "free space or raise the quota",
           errno.EFBIG: "raise the file size limit", errno.EROFS: "make the file system writable",
           errno.ENOENT: "see who removed the folder", errno.EACCES: "make the folder writable again",
           errno.EPERM: "make the folder writable again"}


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
        # A snapshot or journal a killed run did not finish writing: only our own (name pattern, owner, not a link);
        # rank 0 holds the output's claim by now, so no live writer of ours is using one.
        remove_own_temps(path)
        remove_own_temps(journal_path(path))
        self.attrs: dict = {}
        self.tasks: dict[str, dict] = {}
        self.stats: list[dict] | None = None
        self.seq = 0
        if resume and os.path.exists(path):
            self._load(path)
        self.attrs.setdefault("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
        self.attrs.setdefault("run_id", uuid.uuid4().hex)
        self.attrs.update({k: h5_attr(v) for k, v in meta.items()})
        self.attrs["status"] = "running"
        self.attrs.pop("results_json", None)
        self.busy_s = 0.0  # writer-thread seconds (journal + snapshots), for the phase timings
        self.cpu_s = 0.0  # of which CPU (the rest: waiting for the disk or the interpreter lock)
        self.snapshots = 0
        self._pending: dict[str, dict[str, list]] = {}
        self._journal: Journal | None = None  # None until the first snapshot and journal are written
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
                    t["rows"][name] = [py_value(x) for x in cols[name]]

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
        with _WriteFailures(self, journal=True):
            self._append_rows(self._pending)
            self._journal.sync()
        self._pending = {}

    def _append_rows(self, tasks: dict[str, dict[str, list]]) -> None:
        """``tasks``' rows as one journal record of ``self.seq``, or as several (halves, recursively) where one would
        be longer than a reader takes (:data:`mpitp.results.journal.MAX_RECORD_BYTES`): a whole batch of queued
        chunks, or a resume's reused rows, can be."""
        try:
            self._journal.append({"seq": self.seq, "tasks": tasks})
        except RecordTooLong:
            halves = _halves(tasks)
            if halves is None:  # one row longer than a record: no reader could take it
                raise
            for half in halves:
                self._append_rows(half)

    def _snapshot_and_rotate(self) -> None:
        """Write the snapshot (all rows up to ``self.seq``), then start an empty journal after it."""
        self._write_snapshot()
        if self._journal is not None:
            self._journal.close()
        with _WriteFailures(self, journal=True):
            self._journal = Journal(journal_path(self.path), {"run_id": self.attrs["run_id"], "base_seq": self.seq},
                                    mode=new_mode(self.path))  # the rows are the results file's: its mode
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
            # every waiter of the batch is woken, also after a failure (it then raises it): one left waiting for an
            # op that failed never returned (save() after a refused snapshot hung)
            done = [op for op in ops if op is not None and not callable(op)]
            try:
                if self._error is None:
                    for op in ops:
                        if callable(op):
                            op()
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
        if isinstance(self._error, ResultsWriteError):
            raise ResultsWriteError(str(self._error)) from self._error.__cause__  # the same line on every call
        if self._error is not None:
            err, self._error = self._error, RuntimeError("results writer failed earlier")
            raise RuntimeError(f"writing results to {self.path} failed: {err}") from err

    def stored_rows(self) -> dict[tuple, dict]:
        """Every stored request row by its resume key ``(task, doc_id, idx, args_hash, repeat)`` (call before
        appending)."""
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

    def record(self, make_rows: Callable[[], dict[str, list[dict]]]) -> None:
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
        def op() -> None:
            t = self._task(task)
            t["attrs"].update({k: h5_attr(v) for k, v in attrs.items()})
            t["metrics"] = {k: h5_attr(v) for k, v in metrics.items()}
            if samples is not None:
                t["samples"] = [json.dumps(s, default=str) for s in samples]

        self._check()
        self._queue.put(op)

    def write_doc_scores(self, task: str, scores: DocScores) -> None:
        """lm-eval's per-document metric values (a :class:`mpitp.results.docscores.DocScores`), written with the
        file."""
        self._check()
        self._queue.put(lambda: self._task(task).__setitem__("doc_scores", scores))

    def write_stats(self, per_group: list[dict]) -> None:
        self._check()
        self._queue.put(lambda: setattr(self, "stats", per_group))

    def extra_attrs(self, **attrs: object) -> None:
        """Root attrs added to the next snapshot (e.g. ``phases_json``)."""
        self._check()
        self._queue.put(lambda: self.attrs.update({k: h5_attr(v) for k, v in attrs.items()}))

    def finish(self, results_json: dict, wall_time_s: float) -> None:
        """Write the complete file (status ``complete``) and remove the journal; stops the writer thread."""
        def op() -> None:
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
        """The snapshot: built in memory, then written whole to a new temporary beside the output (a random name,
        created exclusively, never through a planted link, with the mode of the file it replaces), fsync'd and
        renamed into place (:func:`mpitp.results.safefile.write_replace`, which removes its temporary on failure).

        Why in memory: HDF5 writing a file on disk writes also when an object's last reference goes, and a refused
        write there (a full disk) comes from a deallocation, which Cython reports to ``sys.excepthook`` (mpitp's
        aborts the job mid-write, temporary left behind), and after which HDF5 is not safe to go on with (a
        segmentation fault closing the file). Written by ``os.write``, a refusal is an ``OSError`` here like any
        other and the error is one line. It costs the file's size in memory, briefly:
        less than the rows the writer holds."""
        t0 = time.perf_counter()
        self.attrs["journal_seq"] = int(self.seq)
        image = self._h5_image()
        with _WriteFailures(self, journal=False):
            write_replace(self.path, image, new_mode(self.path))
        self.snapshots += 1
        self.snapshot_s = getattr(self, "snapshot_s", 0.0) + time.perf_counter() - t0

    def _h5_image(self) -> bytes:
        """The snapshot's bytes: an HDF5 file in memory only (the core driver without a backing store), flushed."""
        f = h5py.File(f"mpitp-snapshot-{uuid.uuid4().hex}.h5", "w", driver="core", backing_store=False,
                      block_size=1 << 20)  # the name: nothing on disk, unique among the files open in HDF5
        try:
            self._write_h5(f)  # its groups and datasets are closed on return: the flush writes everything
            f.flush()
            return f.id.get_file_image()
        finally:
            f.close()

    def _failure_line(self, failure: tuple[int, str], journal: bool) -> str:
        """The one line for a refused write: which file, why, what is kept and what to do."""
        code, text = failure
        out, jp = shown(self.path), shown(journal_path(self.path))
        what = f"the results journal {jp}" if journal else f"the results file {out}"
        remedy = _REMEDY.get(code, "check the file system")
        if not (os.path.lexists(self.path) or os.path.lexists(journal_path(self.path))):  # the folder removed
            kept = f"neither {out} nor its journal is there any more: the rows that landed are lost"
            again = "run again"
        elif self._journal is None:  # the first snapshot or journal, at the start
            kept = "nothing of this run was computed yet"
            again = "run again" + (" with --resume" if os.path.lexists(self.path) else "")  # it is there now
        elif journal:  # a record may be torn: readers stop at the last whole one
            kept = f"the rows that landed are in {out} and its journal up to the last whole record"
            again = "rerun with --resume"
        else:
            kept = f"the rows that landed are in its journal {jp}"
            again = "rerun with --resume"
        return f"cannot write {what}: {text} (errno {code}); {kept}: {remedy} and {again}"

    def _write_h5(self, f) -> None:
        """The snapshot's content, from memory, into the new file ``f``."""
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


class _WriteFailures:
    """Turns the file system refusing a write inside the block (:func:`mpitp.results.safefile.write_failure`) into
    one :class:`ResultsWriteError` line; anything else (a bug) goes on as it is."""

    def __init__(self, writer: ResultWriter, journal: bool):
        self.writer, self.journal = writer, journal

    def __enter__(self) -> _WriteFailures:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        failure = None if isinstance(exc, ResultsWriteError) else write_failure(exc)
        if failure is not None:
            raise ResultsWriteError(self.writer._failure_line(failure, self.journal)) from exc
        return False


def _halves(tasks: dict[str, dict[str, list]]) -> tuple[dict, dict] | None:
    """``tasks``' rows in two parts: its tasks halved, or a single task's rows; None for a single row."""
    names = list(tasks)
    if len(names) > 1:
        cut = len(names) // 2
        return {k: tasks[k] for k in names[:cut]}, {k: tasks[k] for k in names[cut:]}
    cols = tasks[names[0]]
    n = len(cols["doc_id"])
    if n < 2:
        return None
    return ({names[0]: {c: v[: n // 2] for c, v in cols.items()}},
            {names[0]: {c: v[n // 2:] for c, v in cols.items()}})
