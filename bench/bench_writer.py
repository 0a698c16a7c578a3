"""The results writer alone: record 10^6 request rows in 5,000 chunks, and the old rewrite-per-chunk writer beside it.

Question (issue 17): does recording a landed chunk cost O(chunk)? The old ``ResultWriter`` rewrote the whole gzip'd
HDF5 file for every chunk (quadratic over a run); the new one appends each chunk to a checksummed journal on a
writer thread and rewrites the HDF5 snapshot only at the start, the end and at a bounded rate.

Figures printed (all from this one run):

- ``new``, ``--rows`` rows in ``--chunks`` chunks: the caller's time per ``append`` (what the dispatch loop pays),
  the last chunk's latency until it is on disk (``append`` + ``flush``: journal written and fsync'd), the total until
  ``finish`` returned (final snapshot written, fsync'd, renamed; journal removed), the writer thread's busy seconds,
  and the file read back (every row present).
- ``old`` vs ``new`` at ``--small-rows`` / ``--small-chunks``: total seconds each, last chunk's seconds each, ratio.

Wall and CPU seconds both: on a shared machine the wall time measures the machine's load as much as the writer.

Last line: ``RATIO writer_old_vs_new <old total / new total>`` at the small size.
Run: ``python bench/bench_writer.py`` (no MPI, no model; about a minute on a 2-core VM).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from mpitp.results.rows import read_requests  # noqa: E402
from mpitp.results.schema import REQUEST_FIELDS, STATS_FIELDS, STR, open_h5  # noqa: E402
from mpitp.results.store import ResultWriter  # noqa: E402

META = dict(model="bench", tokenizer="bench", dtype="float32", world_size=1, tp=1, dp=1, config_json="{}")
TASKS = ("bench_mc", "bench_gen")


def chunk_rows(c: int, per_chunk: int) -> dict[str, list[dict]]:
    """``per_chunk`` rows shaped like real ones (a hash, a generation every 10th row), split over two tasks."""
    out: dict[str, list[dict]] = {t: [] for t in TASKS}
    for i in range(per_chunk):
        n = c * per_chunk + i
        gen = n % 10 == 0
        out[TASKS[gen]].append(dict(doc_id=n // 4, idx=n % 4, kind="generate_until" if gen else "loglikelihood",
                                    loglikelihood=math.nan if gen else -0.001 * n, is_greedy=bool(n & 1),
                                    generation="The answer is 42.\n" if gen else "", n_tokens=7 + n % 50,
                                    args_hash=f"{n * 2654435761 % (1 << 64):016x}", repeat=0))
    return out


class RewriteWriter:
    """The writer before issue 17 (``mpitp/results/store.py`` at 56e0b3f), reduced to the row path: every ``append``
    rewrites the whole gzip'd file to a temporary and renames it into place."""

    def __init__(self, path: str, meta: dict):
        self.path, self.attrs, self.tasks = path, dict(meta, status="running"), {}
        self.save()

    def append(self, task: str, rows: list[dict]) -> None:
        cols = self.tasks.setdefault(task, {k: [] for k in REQUEST_FIELDS})
        for r in rows:
            for k in REQUEST_FIELDS:
                cols[k].append(r[k])
        self.save()

    def finish(self) -> None:
        self.attrs["status"] = "complete"
        self.save()

    def save(self) -> None:
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open_h5(tmp, "w") as f:
            for k, v in self.attrs.items():
                f.attrs[k] = v
            tasks = f.create_group("tasks")
            for name, rows in self.tasks.items():
                req = tasks.create_group(name).create_group("requests")
                n = len(rows["doc_id"])
                for col, dt in REQUEST_FIELDS.items():
                    data = np.asarray(rows[col], dtype=object if dt == STR else dt).reshape(n)
                    req.create_dataset(col, data=data, dtype=dt, maxshape=(None,), chunks=(max(1, min(n, 4096)),),
                                       compression="gzip", compression_opts=4)
        os.replace(tmp, self.path)


def run_new(path: str, rows: int, chunks: int, interval: float) -> dict:
    per = rows // chunks
    data = [chunk_rows(c, per) for c in range(chunks)]  # built up front: the rows are the caller's, not timed
    w = ResultWriter(path, META, snapshot_interval_s=interval)
    t0, cpu0 = time.perf_counter(), time.process_time()
    calls = []
    for c in range(chunks - 1):
        ta = time.perf_counter()
        for task, rs in data[c].items():
            w.append(task, rs)
        calls.append(time.perf_counter() - ta)
    td = time.perf_counter()
    w.flush()  # the writer thread catches up with the chunks queued in a tight loop
    drain = time.perf_counter() - td
    ta, tc, wc = time.perf_counter(), time.thread_time(), w.cpu_s
    for task, rs in data[-1].items():  # the last chunk alone: until it is in the journal and fsync'd
        w.append(task, rs)
    w.flush()
    last = time.perf_counter() - ta
    last_cpu = time.thread_time() - tc + w.cpu_s - wc
    w.write_stats([{k: 1.0 for k in STATS_FIELDS}])
    tf = time.perf_counter()
    w.finish({"results": {}}, 0.0)
    finish_s = time.perf_counter() - tf
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    n = sum(len(read_requests(path, t)["doc_id"]) for t in TASKS)
    assert n == per * chunks, (n, per * chunks)
    return dict(total=total, cpu=cpu, last=last, last_cpu=last_cpu, append_mean=sum(calls) / len(calls),
                append_max=max(calls), drain=drain,
                finish=finish_s, busy=w.busy_s, snapshots=w.snapshots, rows=n, size=os.path.getsize(path))


def run_old(path: str, rows: int, chunks: int) -> dict:
    per = rows // chunks
    data = [chunk_rows(c, per) for c in range(chunks)]
    w = RewriteWriter(path, META)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for c in range(chunks):
        ta = time.perf_counter()
        for task, rs in data[c].items():
            if rs:
                w.append(task, rs)  # the old path: one rewrite per task per chunk, as run.py called it
        last = time.perf_counter() - ta
    w.finish()
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return dict(total=total, cpu=cpu, last=last)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--chunks", type=int, default=5_000)
    ap.add_argument("--small-rows", type=int, default=200_000)
    ap.add_argument("--small-chunks", type=int, default=400)
    ap.add_argument("--interval", type=float, default=120.0, help="snapshot_interval_s of the new writer")
    ap.add_argument("--skip-eager", action="store_true", help="skip the snapshot-at-every-doubling run")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="bench_writer-", dir=args.dir)
    try:
        print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; files in {d}")
        big = run_new(os.path.join(d, "big.h5"), args.rows, args.chunks, args.interval)
        print(f"new writer, {args.rows} rows in {args.chunks} chunks: total {big['total']:.2f} s wall, "
              f"{big['cpu']:.2f} s CPU "
              f"(backlog drained {big['drain']:.2f} s, final snapshot {big['finish']:.2f} s), last chunk on disk "
              f"{big['last'] * 1e3:.1f} ms ({big['last_cpu'] * 1e3:.1f} ms CPU), "
              f"append call {big['append_mean'] * 1e3:.3f} ms mean / {big['append_max'] * 1e3:.2f} ms max, "
              f"writer thread "
              f"busy {big['busy']:.2f} s, {big['snapshots']} snapshots, {big['rows']} rows read back, "
              f"{big['size'] / 1e6:.1f} MB")
        eager = None if args.skip_eager else run_new(os.path.join(d, "eager.h5"), args.rows, args.chunks, 0.0)
        if eager:
            print(f"new writer, snapshot at every doubling (interval 0): total {eager['total']:.2f} s wall, "
                  f"{eager['cpu']:.2f} s CPU, {eager['snapshots']} snapshots, last chunk on disk "
                  f"{eager['last'] * 1e3:.1f} ms")
        new = run_new(os.path.join(d, "new.h5"), args.small_rows, args.small_chunks, args.interval)
        old = run_old(os.path.join(d, "old.h5"), args.small_rows, args.small_chunks)
        print(f"\n{args.small_rows} rows in {args.small_chunks} chunks    total s (wall / CPU)    last chunk s")
        print(f"old (rewrite per chunk)        {old['total']:8.2f} / {old['cpu']:8.2f}    {old['last']:10.4f}")
        print(f"new (journal + snapshots)      {new['total']:8.2f} / {new['cpu']:8.2f}    {new['last']:10.4f}")
        print(f"ratio old / new                {old['total'] / new['total']:8.1f} / {old['cpu'] / new['cpu']:8.1f}")
        print(f"TARGET {args.rows} rows / {args.chunks} chunks <= 10 s total, last chunk <= 10 ms: "
              f"{big['total']:.2f} s wall ({big['cpu']:.2f} s CPU), last chunk {big['last'] * 1e3:.1f} ms wall "
              f"({big['last_cpu'] * 1e3:.1f} ms CPU); load average now {os.getloadavg()[0]:.1f}")
        print(f"RATIO writer_old_vs_new {old['total'] / new['total']:.1f}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
