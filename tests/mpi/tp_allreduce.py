"""TP torch worlds from mpitp.parallel.runtime.start(tp=...): one independent gloo world per TP group.

Run: mpiexec -n N python tests/mpi/tp_allreduce.py [TP]      (TP default 2; N a multiple of TP)

Every rank contributes values derived from its global rank; each group's all_reduce must equal the sum over its own
ranks only (never the world's), and the groups must really be separate worlds (own store port, own rank numbering).
"""

from __future__ import annotations

import os
import sys
import time

import psutil  # accelerate's dependency: always installed beside mpitp
import torch
import torch.distributed as dist

import mpitp.parallel.comm as mc
from mpitp.errors import install_excepthook
from mpitp.parallel.replica_group import destroy_replica_group
from mpitp.parallel.runtime import start

from _checks import Checks, say

install_excepthook()
check = Checks()


def value(rank: int) -> int:
    return 10 ** rank  # distinct digits: any sum says exactly which ranks were in it


def main():
    t0 = time.monotonic()
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rt = start(tp=tp, device="cpu", timeout=60.0)
    lay, world = rt.layout, rt.world
    rank, size = world.rank, world.size
    members = list(lay.tp_ranks)
    check(members == list(range(lay.dp_rank * tp, (lay.dp_rank + 1) * tp)), f"tp_ranks {members}")
    check(rt.replica_group is not None and rt.replica_group.active == (tp > 1), "TP group active iff tp > 1")
    check(rt.replica_group.backend == "gloo", f"backend {rt.replica_group.backend}")

    # Each TP group is its own default torch world: rank = tp_rank, size = tp.
    check(dist.is_initialized(), "torch.distributed initialised")
    check(dist.get_world_size() == tp, f"torch world size {dist.get_world_size()} != tp {tp}")
    check(dist.get_rank() == lay.tp_rank, f"torch rank {dist.get_rank()} != tp_rank {lay.tp_rank}")
    check(os.environ["RANK"] == str(lay.tp_rank) and os.environ["WORLD_SIZE"] == str(tp), "RANK/WORLD_SIZE env")

    want = sum(value(r) for r in members)
    world_sum = sum(value(r) for r in range(size))

    # all_reduce, integer and float, several times (a stray cross-group message would show up as a wrong sum).
    for i in range(5):
        t = torch.tensor([value(rank), -value(rank) * i], dtype=torch.int64)
        dist.all_reduce(t)
        check(t.tolist() == [want, -want * i], f"int all_reduce #{i}: {t.tolist()} != {[want, -want * i]}")
        check(size == tp or int(t[0]) != world_sum, "group sum must not be the world sum")
    f = torch.full((3, 4), float(value(rank)), dtype=torch.float64)
    dist.all_reduce(f)
    check(torch.equal(f, torch.full((3, 4), float(want), dtype=torch.float64)), "float all_reduce")

    # all_gather names the members in tp_rank order; broadcast from the last tp_rank reaches only the group.
    got = [torch.zeros(1, dtype=torch.int64) for _ in range(tp)]
    dist.all_gather(got, torch.tensor([rank]))
    check([int(x) for x in got] == members, f"all_gather {[int(x) for x in got]} != {members}")
    b = torch.tensor([rank])
    dist.broadcast(b, src=tp - 1)
    check(int(b) == members[-1], f"broadcast from tp_rank {tp - 1}: {int(b)}")

    # The rendezvous store (held by tp_rank 0) listens on MASTER_ADDR only, never on every interface (issue 27).
    if lay.tp_rank == 0:
        port = int(os.environ["MASTER_PORT"])
        bound = sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN and c.laddr.port == port})
        check(bound == [os.environ["MASTER_ADDR"]], f"store port {port} listens on {bound}, not only on "
                                                     f"MASTER_ADDR {os.environ['MASTER_ADDR']}")
        say(f"  store listens on {bound} port {port}")

    # Across the world (over MPI): each group saw its own sum and used its own rendezvous port.
    rows = mc.gather_obj((lay.dp_rank, lay.tp_rank, int(t[0]), os.environ["MASTER_PORT"]), world.comm,
                         timeout=60.0, phase="gather sums")
    if rank == 0:
        for r, (dp_rank, tp_rank, s, _port) in enumerate(rows):
            group = range(dp_rank * tp, (dp_rank + 1) * tp)
            check((dp_rank, tp_rank) == divmod(r, tp), f"rank {r} layout")
            check(s == sum(value(x) for x in group), f"rank {r}: group sum {s}")
        ports = {dp_rank: port for dp_rank, _, _, port in rows}
        check(all(rows[r][3] == ports[rows[r][0]] for r in range(size)), "one port per group")
        check(len(set(ports.values())) == lay.dp, f"distinct ports per group: {ports}")
        say(f"  group sums: {[(d, s) for d, tr, s, _ in rows if tr == 0]}, world sum {world_sum}, ports {ports}")

    destroy_replica_group(rt.replica_group)
    mc.barrier(world.comm, timeout=60.0, phase="end")
    total = world.comm.allreduce(check.count)
    say(f"OK tp_allreduce: {size} ranks, tp={tp}, dp={lay.dp}, {total} checks, {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
