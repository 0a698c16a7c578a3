"""Object broadcast: mpitp's ``bcast_obj`` vs ``torch.distributed.broadcast_object_list`` (gloo), same launch.

    mpiexec -n 4 python bench/bench_bcast.py [--sizes 1,64,512] [--reps 7,5,3] [--no-mpi4py]

The object is a dict holding two float64 numpy arrays whose sizes add up to the nominal size (MiB), plus a little
metadata. Every repetition starts after an MPI barrier; its time is the slowest rank's (the moment every rank holds
the object). Reported: the median over the repetitions. Methods are interleaved within each repetition, after one
untimed warm-up each, and every method's result is checked against the original on every rank once per size.

For context the table also times mpi4py's own pickle-based ``comm.bcast`` (disable with --no-mpi4py).
The last line is ``RATIO bcast_64MB <torch median / mpitp median>``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from mpitp.parallel.comm import bcast_obj

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
ROOT = 0
MiB = 1024 * 1024


def say(*args):
    if RANK == 0:
        print(*args, flush=True)


def init_torch_world() -> None:
    """A gloo world over every rank of the launch, rendezvous on a TCPStore on 127.0.0.1 (port from the OS)."""
    timeout = timedelta(seconds=600)
    if RANK == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size=SIZE, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        port = COMM.bcast(store.port, root=0)
    else:
        port = COMM.bcast(None, root=0)
        store = dist.TCPStore("127.0.0.1", port, world_size=SIZE, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=SIZE, timeout=timeout)


def make_object(mib: int) -> dict:
    n = mib * MiB // 8
    rng = np.random.default_rng(mib)
    a = rng.random(n // 2)
    b = rng.random(n - n // 2)
    return {"name": f"payload-{mib}MB", "arrays": {"a": a, "b": b}, "meta": {"shape": [n], "dtype": "float64"}}


def same(got, want) -> bool:
    return (got["name"] == want["name"] and got["meta"] == want["meta"]
            and all(np.array_equal(got["arrays"][k], want["arrays"][k]) for k in want["arrays"]))


def via_mpitp(obj):
    return bcast_obj(obj if RANK == ROOT else None, COMM, root=ROOT)


def via_torch(obj):
    box = [obj if RANK == ROOT else None]
    dist.broadcast_object_list(box, src=ROOT)
    return box[0]


def via_mpi4py(obj):
    return COMM.bcast(obj if RANK == ROOT else None, root=ROOT)


def timed(fn, obj) -> tuple[float, object]:
    COMM.Barrier()
    t0 = time.perf_counter()
    got = fn(obj)
    dt = time.perf_counter() - t0
    return COMM.allreduce(dt, op=MPI.MAX), got


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,64,512", help="payload sizes in MiB, comma-separated")
    ap.add_argument("--reps", default="7,5,3", help="timed repetitions per size, comma-separated")
    ap.add_argument("--no-mpi4py", action="store_true", help="skip mpi4py's comm.bcast")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    reps = [int(x) for x in args.reps.split(",")]
    reps += [reps[-1]] * (len(sizes) - len(reps))

    torch.set_num_threads(1)
    init_torch_world()
    methods = {"mpitp": via_mpitp, "torch": via_torch}
    if not args.no_mpi4py:
        methods["mpi4py"] = via_mpi4py

    mpi = " ".join(MPI.Get_library_version().split()[:3])
    say(f"bench_bcast: {SIZE} ranks, root {ROOT}, {os.cpu_count()} CPUs, {mpi}, torch {torch.__version__} (gloo)")
    results = {}
    for mib, n_reps in zip(sizes, reps):
        obj = make_object(mib)  # every rank builds it: the root sends it, the others check against it
        times = {m: [] for m in methods}
        for m, fn in methods.items():  # warm-up and correctness, untimed
            _, got = timed(fn, obj)
            ok = COMM.allreduce(int(same(got, obj)), op=MPI.MIN)
            if not ok:
                raise SystemExit(f"{m}: the broadcast object differs from the original")
            del got
        for rep in range(n_reps):
            order = list(methods)
            order = order[rep % len(order):] + order[:rep % len(order)]  # rotate who goes first
            for m in order:
                dt, got = timed(methods[m], obj)
                times[m].append(dt)
                del got
                gc.collect()
        results[mib] = {m: statistics.median(t) for m, t in times.items()}
        say(f"  {mib} MiB: " + ", ".join(f"{m} {results[mib][m]:.4f} s" for m in methods))
        del obj
        gc.collect()

    cols = list(methods)
    say("")
    say(f"{'size':>8}  " + "  ".join(f"{m + ' (s)':>12}" for m in cols) + f"  {'torch/mpitp':>11}"
        + f"  {'mpitp GB/s':>10}")
    for mib in sizes:
        r = results[mib]
        say(f"{str(mib) + ' MiB':>8}  " + "  ".join(f"{r[m]:>12.4f}" for m in cols)
            + f"  {r['torch'] / r['mpitp']:>10.1f}x" + f"  {mib * MiB / r['mpitp'] / 1e9:>10.2f}")
    if 64 in results:
        say(f"RATIO bcast_64MB {results[64]['torch'] / results[64]['mpitp']:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
