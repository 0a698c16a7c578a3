"""Object bcast / scatter / gather round trips on COMM_WORLD and sub-communicators, every root.

Run: mpiexec -n N python tests/mpi/collectives.py      (any N; the layout checks use tp=2 when N is even)

Every rank can rebuild every payload from its (tag, seed), so each receiver compares what arrived with what was sent,
exactly: types, dict key order, dtypes, shapes, memory order and bits.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch
from mpi4py import MPI

import mpitp.parallel.comm as mc
from mpitp.errors import UsageError, install_excepthook
from mpitp.parallel.layout import make_layout
from mpitp.parallel.runtime import agree
from mpitp.parallel.world import world_from_comm

from _checks import Checks, same, say

install_excepthook()
check = Checks()
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
T = 120.0  # deadline for every collective here: generous, a failure would be a hang otherwise
BIG = 100 * 1024 * 1024  # the 100 MB array


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def small_objects(tag):
    return [None, 0, -7, 2**70, 3.5, -0.0, complex(1, -2), "", "héllo wörld", b"", b"\x00\xff" * 3,
            bytearray(b"abc"), (1, "a", None), [], {}, {"k": [1, 2, {"z": None}]}, {1, 2, 3}, frozenset(), True,
            tag]


def nested(*tag):
    rng = np.random.default_rng(seed_of(*tag))
    g = torch.Generator().manual_seed(seed_of("torch", *tag))
    base = torch.randn(6, 8, generator=g)
    return {
        "tag": tag,
        "arrays": {
            "f32": rng.standard_normal((7, 5)).astype(np.float32),
            "f64_special": np.array([np.nan, np.inf, -np.inf, -0.0, 1.5, 5e-324]),
            "i64": np.arange(-5, 5, dtype=np.int64),
            "u8": rng.integers(0, 256, 1000, dtype=np.uint8),
            "bool": rng.random(17) > 0.5,
            "f16": rng.standard_normal(9).astype(np.float16),
            "fortran": np.asfortranarray(rng.standard_normal((4, 6))),
            "strided": rng.standard_normal((6, 8))[:, ::3],  # not contiguous: pickled in band
            "empty": np.zeros((0, 3), dtype=np.float32),
            "zero_d": np.array(3.25),
            "structured": np.array([(1, 2.0), (-3, 0.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
            "objects": np.array(["x", None, 3], dtype=object),
        },
        "tensors": {
            "f32": base,
            "bf16": base.to(torch.bfloat16),
            "f16": base.to(torch.float16),
            "i64": torch.arange(-3, 10),
            "bool": base > 0,
            "view": base[:, 1::2],  # non-contiguous view: strides must survive
            "scalar": torch.tensor(7.5, dtype=torch.float64),
        },
        "many": [np.full(3, i, dtype=np.int16) for i in range(40)],  # > 15 out-of-band buffers
        "bytes": bytearray(rng.bytes(257)),
        "deep": {"a": {"b": {"c": [{"t": torch.ones(2, 2) * len(tag), "n": np.eye(3)}, ("tuple", 1.0)]}}},
    }


def big_array(*tag, nbytes=BIG):
    return np.random.default_rng(seed_of(*tag)).random(nbytes // 8)  # float64


def expect_same(got, want, what):
    diff = same(got, want)
    check(diff is None, f"{what}: {diff}")


def writable_arrays(obj) -> bool:
    """Received numpy arrays must be ordinary writable arrays, not views of a read-only buffer."""
    if isinstance(obj, dict):
        return all(writable_arrays(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(writable_arrays(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.flags.writeable
    return True


# --------------------------------------------------------------------------- one suite per communicator


def suite(name, comm, big=False):
    """Every collective from every root of ``comm``, with small, nested and (optionally) 100 MB payloads."""
    r, n = comm.Get_rank(), comm.Get_size()
    for root in range(n):
        where = f"{name} (size {n}) root {root}"
        # bcast: small objects one by one, then a nested dict of arrays and tensors.
        for i, want in enumerate(small_objects((name, root))):
            got = mc.bcast_obj(want if r == root else None, comm, root=root, timeout=T, phase=f"bcast {where}")
            expect_same(got, want, f"bcast small #{i} on {where}")
        want = nested("bcast", name, root)
        got = mc.bcast_obj(want if r == root else None, comm, root=root, timeout=T, phase=f"bcast {where}")
        expect_same(got, want, f"bcast nested on {where}")
        if r == root:
            check(got is want, f"bcast on {where}: root returns its own object")
        else:
            check(writable_arrays(got), f"bcast on {where}: received arrays writable")

        # scatter: one distinct nested object per destination rank.
        items = [nested("scatter", name, root, dest) for dest in range(n)] if r == root else None
        got = mc.scatter_obj(items, comm, root=root, timeout=T, phase=f"scatter {where}")
        expect_same(got, nested("scatter", name, root, r), f"scatter on {where}")

        # gather: each rank's own object, in rank order at the root, None elsewhere.
        got = mc.gather_obj(nested("gather", name, root, r), comm, root=root, timeout=T, phase=f"gather {where}")
        if r == root:
            check(isinstance(got, list) and len(got) == n, f"gather on {where}: list of {n}")
            for src in range(n):
                expect_same(got[src], nested("gather", name, root, src), f"gather from {src} on {where}")
        else:
            check(got is None, f"gather on {where}: non-root gets None")

    if big:
        # 100 MB arrays from a non-zero root (the last rank) and from rank 0 when the comm has one rank only.
        root = n - 1
        where = f"{name} (size {n}) root {root}"
        want = {"meta": {"root": root}, "big": big_array("bcast-big", name)}
        got = mc.bcast_obj(want if r == root else None, comm, root=root, timeout=T, phase="bcast big")
        expect_same(got, want, f"bcast 100 MB on {where}")
        del got, want
        items = [big_array("scatter-big", name, d) for d in range(n)] if r == root else None
        got = mc.scatter_obj(items, comm, root=root, timeout=T, phase="scatter big")
        del items
        expect_same(got, big_array("scatter-big", name, r), f"scatter 100 MB on {where}")
        del got
        got = mc.gather_obj({"from": r, "a": big_array("gather-big", name, r)}, comm, root=root, timeout=T,
                            phase="gather big")
        if r == root:
            for src in range(n):
                expect_same(got[src], {"from": src, "a": big_array("gather-big", name, src)},
                            f"gather 100 MB from {src} on {where}")
        del got
    mc.barrier(comm, timeout=T, phase=f"end of suite {name}")


def world_ranks(comm) -> list[int]:
    return comm.Get_group().Translate_ranks(list(range(comm.Get_size())), WORLD.Get_group())


def main():
    t0 = time.monotonic()
    world = world_from_comm()
    check(world.size == SIZE and world.rank == RANK, "World matches COMM_WORLD")

    comms = [("COMM_WORLD", WORLD, True)]

    if SIZE % 2 == 0:
        lay = make_layout(world, tp=2)
        # The layout's communicators hold exactly the ranks the layout says, in tp_rank / dp_rank order.
        check(world_ranks(lay.tp_comm) == list(lay.tp_ranks), f"tp_comm members {world_ranks(lay.tp_comm)}")
        check(lay.tp_comm.Get_rank() == lay.tp_rank, "tp_comm rank == tp_rank")
        if lay.is_leader:
            check(world_ranks(lay.dp_leader_comm) == list(lay.leader_ranks), "dp_leader_comm members")
            check(lay.dp_leader_comm.Get_rank() == lay.dp_rank, "dp_leader_comm rank == dp_rank")
        else:
            check(lay.dp_leader_comm == MPI.COMM_NULL, "non-leaders get COMM_NULL")
        # 100 MB payloads on tp_comm too when it is a real sub-communicator (with 2 ranks it is the whole world).
        comms.append(("tp_comm", lay.tp_comm, lay.tp_comm.Get_size() < SIZE))
        if lay.is_leader:
            comms.append(("dp_leader_comm", lay.dp_leader_comm, False))

    # A split of our own whose rank order is the reverse of the world's.
    mine = WORLD.Split(color=RANK % 2, key=-RANK)
    check(world_ranks(mine) == sorted((x for x in range(SIZE) if x % 2 == RANK % 2), reverse=True),
          "own split members, reversed")
    comms.append(("own_split", mine, False))
    comms.append(("COMM_SELF", MPI.COMM_SELF, False))

    for name, comm, big in comms:
        suite(name, comm, big=big)
        say(f"  {name}: ok ({time.monotonic() - t0:.1f} s)")

    # Chunked transfers: with a small, odd CHUNK every payload crosses many chunk boundaries.
    saved = mc.CHUNK
    mc.CHUNK = 1_000_003
    try:
        suite("COMM_WORLD small-chunk", WORLD, big=False)
        root = SIZE - 1
        want = {"a": big_array("chunked", nbytes=24 * 1024 * 1024), "n": nested("chunked")}
        got = mc.bcast_obj(want if RANK == root else None, WORLD, root=root, timeout=T, phase="chunked bcast")
        expect_same(got, want, "bcast 24 MB in 1 MB chunks")
        items = [want if d != root else None for d in range(SIZE)] if RANK == root else None
        got = mc.scatter_obj(items, WORLD, root=root, timeout=T, phase="chunked scatter")
        expect_same(got, want if RANK != root else None, "scatter 24 MB in 1 MB chunks")
        got = mc.gather_obj(want if RANK % 2 else RANK, WORLD, root=root, timeout=T, phase="chunked gather")
        if RANK == root:
            for src in range(SIZE):
                expect_same(got[src], want if src % 2 else src, f"gather 24 MB in 1 MB chunks from {src}")
    finally:
        mc.CHUNK = saved
    say(f"  chunked: ok ({time.monotonic() - t0:.1f} s)")

    # Usage errors of the collectives themselves are local and immediate.
    try:
        mc.scatter_obj([1, 2], MPI.COMM_SELF)
    except ValueError as exc:
        check("needs 1 items, got 2" in str(exc), f"scatter_obj count message: {exc}")
    else:
        check(False, "scatter_obj with the wrong item count must raise ValueError")

    # runtime.agree: rank 0's verdict (a value or a UsageError) reaches every rank, on any communicator.
    for name, comm, _ in comms:
        got = agree(lambda name=name: {"checked_by": WORLD.Get_rank(), "on": name}, comm, timeout=T,
                    phase=f"agree {name}")
        expect_same(got, {"checked_by": world_ranks(comm)[0], "on": name}, f"agree ok on {name}")

        def refuse(name=name):
            raise UsageError(f"refused on {name}")

        try:
            agree(refuse, comm, timeout=T, phase=f"agree {name}")
        except UsageError as exc:
            check(str(exc) == f"refused on {name}" and exc.collective, f"agree usage error on {name}: {exc!r}")
        else:
            check(False, f"agree on {name}: the UsageError must reach every rank")

    total = WORLD.allreduce(check.count)
    say(f"OK collectives: {SIZE} ranks, {total} checks, {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
