"""Rank 0 as a coordinator, without models: many light DP groups through the real dispatcher and results path.

Question (issue 17): how many requests per second can global rank 0 hand out and record, and what does each chunk cost
it? Every rank of ``mpiexec -n N`` is a DP group of one; its "compute" returns synthetic scoring results after
``--per-request-ms`` per request (rank 0's own group too, calling ``tick()`` as real compute does). Rank 0 runs the real
:class:`mpitp.evaluation.dispatch.Dispatcher` (token-balanced chunks, two in flight per remote group) and records every
landed chunk as ``mpitp eval`` does: :func:`mpitp.evaluation.request_rows.request_row` per request (on the writer
thread) through :class:`mpitp.results.store.ResultWriter` (journal + HDF5 snapshot). Requests are lm-eval-like:
``--tokens`` token ids per row, arguments of ~300 characters (hashed into the resume key before dispatch), eight tasks.

Printed: sustained requests/s (all requests / wall of the dispatch), rank 0's CPU seconds per chunk on the dispatch
thread and per request on the writer thread, the remote groups' waits for their next chunk (the answer latency),
and a projection to 256 and 1024 groups:

    sustained(G) = min(G * r_group, 1 / (c_chunk / q(G) + c_row))

``r_group`` one group's requests/s, ``c_chunk`` rank 0's dispatch-thread CPU seconds per chunk, ``c_row`` its
writer-thread CPU seconds per request (the two threads share one interpreter lock, so their costs add), ``q(G)`` the
mean requests per chunk that :func:`mpitp.evaluation.dispatch.make_chunks` cuts for G groups from
``--projection-requests``.

Run: ``python bench/bench_coordinator.py --ranks 64`` (launches ``mpiexec -n 64`` itself). Last line:
``RATIO coordinator_requests_per_s <sustained requests/s>`` (target >= 20,000).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64, help="MPI ranks = DP groups (one rank each)")
    ap.add_argument("--requests", type=int, default=400_000)
    ap.add_argument("--tokens", type=int, default=96, help="mean token ids per request row")
    ap.add_argument("--per-request-ms", type=float, default=2.0, help="synthetic compute per request, per group")
    ap.add_argument("--projection-requests", type=int, default=1_000_000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


class _Stats:
    mpi_bytes = 0


class _Layout:
    def __init__(self, comm):
        self.dp_leader_comm = comm
        self.dp = comm.Get_size()


class _Inst:
    """The fields of an lm-eval ``Instance`` that the results path reads."""

    __slots__ = ("task_name", "doc_id", "idx", "args")

    def __init__(self, task_name, doc_id, idx, args):
        self.task_name, self.doc_id, self.idx, self.args = task_name, doc_id, idx, args


def synthetic(n: int, tokens: int, seed: int = 0):
    rng = random.Random(seed)
    items, weights, insts = [], [], []
    for i in range(n):
        length = max(8, int(rng.gauss(tokens, tokens / 4)))
        row = (list(range(i % 50000, i % 50000 + length)), rng.randint(1, 8))
        items.append(row)
        weights.append(length)
        ctx = f"Question {i}: " + "lorem ipsum dolor sit amet " * 10
        insts.append(_Inst(f"task_{i % 8}", i // 4, i % 4, (ctx, f" answer {i % 4}")))
    return items, weights, insts


def child(args) -> None:
    from mpi4py import MPI

    from mpitp.evaluation.dispatch import Dispatcher, serve_remote
    from mpitp.parallel.comm import barrier, gather_obj

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    per_req = args.per_request_ms / 1e3
    marks: list[tuple[float, float]] = []

    def compute(kind, items, tick=None):
        t0 = time.perf_counter()
        end = t0 + per_req * len(items)
        while True:  # real compute calls tick() between batches; ~8 batches a chunk here
            left = end - time.perf_counter()
            if left <= 0:
                break
            time.sleep(min(left, per_req * max(1, len(items) // 8)))
            if tick is not None:
                tick()
        marks.append((t0, time.perf_counter()))
        return [(-0.5 * len(row), True, n) for row, n in items]

    layout = _Layout(comm)
    if rank != 0:
        barrier(comm, 600.0)  # polled with backoff: 63 spinning ranks would starve rank 0 while it sets up
        serve_remote(layout, compute, timeout=600.0)
        gaps = [b[0] - a[1] for a, b in zip(marks, marks[1:])]
        gather_obj((len(marks), gaps), comm, root=0, timeout=600.0)
        return

    from mpitp.evaluation.lm import KIND_SCORE, request_keys
    from mpitp.evaluation.request_rows import request_row
    from mpitp.results.store import ResultWriter

    items, weights, insts = synthetic(args.requests, args.tokens)
    keys = request_keys(insts)  # as the LM does before it hands the requests to the runner
    writer = ResultWriter(args.out, dict(model="bench", tokenizer="bench", dtype="float32", world_size=size, tp=1,
                                         dp=size, config_json="{}"))
    stats = _Stats()
    dispatcher = Dispatcher(layout, compute, 600.0, stats)
    landed = [0]

    def on_chunk(indices, res):  # as run.py's runner: rows built and written on the writer thread
        landed[0] += 1

        def rows():
            by_task: dict[str, list] = {}
            for i, r in zip(indices, res):
                by_task.setdefault(keys[i][0], []).append(request_row(keys[i], r, KIND_SCORE))
            return by_task

        writer.record(rows)

    barrier(comm, 600.0)
    cpu_main0 = time.thread_time()
    t0 = time.perf_counter()
    dispatcher.run(KIND_SCORE, items, weights, on_chunk)
    wall = time.perf_counter() - t0
    cpu_main = time.thread_time() - cpu_main0
    own_busy = sum(b - a for a, b in marks)
    dispatcher.shutdown()
    tf = time.perf_counter()
    writer.flush()
    lag = time.perf_counter() - tf
    tf = time.perf_counter()
    writer.finish({"results": {}}, wall)
    finish_s = time.perf_counter() - tf
    writer_cpu = writer.cpu_s  # CPU seconds of the writer thread
    remote = gather_obj((0, []), comm, root=0, timeout=600.0)[1:]
    gaps = sorted(g for _, gs in remote for g in gs)
    chunks_remote = sum(n for n, _ in remote)
    n_chunks = landed[0]
    from mpitp.results.rows import request_counts

    stored = sum(request_counts(args.out).values())
    assert stored == args.requests, (stored, args.requests)
    rate = args.requests / wall
    own_cpu = 0.0  # rank 0's stub compute sleeps: its CPU is the dispatch loop's ticks, already in cpu_main
    c_chunk = (cpu_main - own_cpu) / n_chunks
    c_row = writer_cpu / args.requests
    r_group = 1.0 / (args.per_request_ms / 1e3)
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} (1 min); {size} ranks = {size} DP groups")
    print(f"{args.requests} requests ({args.tokens} tokens mean), {n_chunks} chunks ({chunks_remote} remote, "
          f"{n_chunks - chunks_remote} on rank 0's group, busy {own_busy:.1f} s), {args.per_request_ms} ms/request "
          f"per group (one group: {r_group:.0f} requests/s; all groups: {size * r_group:.0f} requests/s)")
    print(f"dispatch wall {wall:.2f} s -> {rate:.0f} requests/s sustained; writer caught up {lag:.2f} s later, "
          f"final snapshot {finish_s:.2f} s; {stored} rows stored")
    print(f"rank 0 per chunk: {c_chunk * 1e3:.3f} ms CPU on the dispatch thread ({cpu_main:.2f} s in all); "
          f"writer thread {c_row * 1e6:.2f} us CPU per request ({writer_cpu:.2f} s CPU, {writer.busy_s:.2f} s wall, "
          f"{writer.snapshots} snapshots)")
    if gaps:
        def pct(p):
            return gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1e3

        print(f"remote groups' wait between chunks: median {pct(0.5):.2f} ms, p99 {pct(0.99):.2f} ms, "
              f"max {gaps[-1] * 1e3:.2f} ms over {len(gaps)} gaps")
    from mpitp.evaluation.dispatch import make_chunks

    print(f"\nprojection (sustained(G) = min(G * r_group, 1 / (c_chunk / q(G) + c_row)); "
          f"c_chunk {c_chunk * 1e3:.3f} ms, c_row {c_row * 1e6:.2f} us, r_group {r_group:.0f}/s, "
          f"{args.projection_requests} requests)")
    print(f"{'groups':>7} {'chunks':>7} {'q(G)':>8} {'groups demand/s':>16} {'rank 0 limit/s':>15} "
          f"{'sustained/s':>12}")
    pw = [max(8, int(w * args.projection_requests / len(weights))) for w in weights]
    pw = (pw * (args.projection_requests // len(pw) + 1))[: args.projection_requests]
    for g in (size, 256, 1024):
        ch = make_chunks(KIND_SCORE, list(range(len(pw))), pw, g)
        q = args.projection_requests / len(ch)
        limit = 1.0 / (c_chunk / q + c_row)
        print(f"{g:>7} {len(ch):>7} {q:>8.1f} {g * r_group:>16.0f} {limit:>15.0f} {min(g * r_group, limit):>12.0f}")
    print(f"RATIO coordinator_requests_per_s {rate:.0f}")


def main() -> None:
    args = parse()
    if args.child:
        from mpitp.errors import install_excepthook

        install_excepthook()  # one rank's failure ends the job now, not after the others' 600 s deadlines
        child(args)
        return
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    d = tempfile.mkdtemp(prefix="bench_coordinator-")
    try:
        cmd = [mpiexec, "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()), "--child",
               "--out", os.path.join(d, "coord.h5"), *sys.argv[1:]]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env)
        print(f"(mpiexec -n {args.ranks} ran {time.perf_counter() - t0:.0f} s including start-up)")
        sys.exit(proc.returncode)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
