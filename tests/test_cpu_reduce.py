"""The TP group's reductions over MPI (mpitp.parallel.cpu_reduce), in one process: which tensors go to MPI and which
stay with torch, and that the stand-in for ``torch.distributed`` in transformers' TP layers answers every other name
with torch's own. The sums across ranks are exercised by the TP parity tests under mpiexec."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mpi4py import MPI

from mpitp.parallel.cpu_reduce import MPIReductions, TorchDistributedOverMPI


def test_cpu_tensors_of_mpi_dtypes_go_to_mpi_the_rest_to_torch(gloo_world, monkeypatch):
    red = MPIReductions(None, MPI.COMM_SELF, timeout=5.0)
    seen = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: seen.append(t.dtype) or real(t, **kw))
    stand_in = TorchDistributedOverMPI(red)
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        t = torch.arange(6, dtype=dtype).view(2, 3)
        assert red.takes(t, None) and red.takes(t, dist.group.WORLD)  # the mesh's own object for the same ranks
        stand_in.all_reduce(t, group=dist.group.WORLD)
        assert torch.equal(t, torch.arange(6, dtype=dtype).view(2, 3))  # one rank: the sum is itself
    assert seen == []
    half = torch.ones(4, dtype=torch.bfloat16)  # MPI has no bfloat16: torch's collective
    assert not red.takes(half, None)
    stand_in.all_reduce(half)
    strided = torch.ones(4, 4)[:, ::2]  # not contiguous: torch's
    assert not red.takes(strided, None)
    stand_in.all_reduce(strided)
    assert seen == [torch.bfloat16, torch.float32]
    assert stand_in.get_world_size() == 1 and stand_in.ReduceOp is dist.ReduceOp  # every other name is torch's


def test_max_min_and_gather(gloo_world):
    red = MPIReductions(None, MPI.COMM_SELF, timeout=5.0)
    t = torch.tensor([1.5, -2.0])
    red.all_reduce(t, dist.ReduceOp.MAX)
    red.all_reduce(t, dist.ReduceOp.MIN)
    assert t.tolist() == [1.5, -2.0]
    got = red.all_gather(torch.tensor([[3.0, 4.0]], dtype=torch.float64))
    assert got.shape == (1, 1, 2) and got.dtype == torch.float64 and got.tolist() == [[[3.0, 4.0]]]

