"""A TP group's reductions of CPU tensors over MPI instead of torch's gloo: the same sums, tens of times sooner.

On CPU the replica's torch world is gloo, whose every collective goes through its TCP loopback pair and a hand-off
to its own I/O thread. A 2 KB all-reduce between two ranks of one node measured 1.45 ms there (2 cores, load
average ~3), against 17 us for MPICH's shared-memory ``Iallreduce`` polled below; a decode step of the bench's
8-layer Llama makes 16 of them (one per row-parallel projection), and the greedy head one more. So while a replica
runs its forwards, transformers' TP layers (their ``dist.all_reduce``, through :func:`mpitp.compat.replaced`) and
mpitp's own scoring reductions (:class:`mpitp.replica.scoring.TPOps`) reduce CPU tensors of the dtypes MPI knows
over the TP group's MPI communicator; anything else (GPU tensors, bfloat16, an asynchronous call, another group)
goes to torch as before.

The result is the same: with two ranks a sum is ``a + b`` on both, whichever library adds (IEEE addition commutes);
with more, MPI brackets the sum its own way (as gloo's ring does its own), the same bracketing on every rank.
A wait spins on ``Test`` briefly (a TP peer is a few microseconds behind), then sleeps with the backoff and the
deadline of every other wait in mpitp (:class:`mpitp.parallel.comm.Poller`): a lost peer ends in a
:class:`~mpitp.parallel.comm.DeadlineError` naming the phase, not a hang.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from mpi4py import MPI

from mpitp.parallel import comm as mpicomm
from mpitp.parallel.comm import Poller
from mpitp.parallel.deadline import torch_deadline

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: torch dtypes MPI reduces natively (no bfloat16 or float16 type in MPI-3: those stay with torch)
MPI_TYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T,
             torch.int64: MPI.INT64_T}
SPINS = 2000  # Test calls before sleeping (~20-50 us): a TP peer arrives within microseconds
NAP_S = 2e-5  # then naps this short (the kernel's timer slack adds ~50 us)...
NAPPING_S = 0.05  # ...for this long, before the Poller's longer naps and its deadline


class MPIReductions:
    """Reductions over one TP group: its torch ``group`` (None: the default world) and the same ranks' MPI ``comm``,
    in the same rank order. ``timeout``: the deadline of a wait (None: none)."""

    def __init__(self, group: ProcessGroup | None, comm: MPI.Comm, timeout: float | None):
        self.group = group
        self.comm = comm
        self.timeout = timeout
        self.ops = {dist.ReduceOp.SUM: MPI.SUM, dist.ReduceOp.MAX: MPI.MAX, dist.ReduceOp.MIN: MPI.MIN}
        self.ranks = _ranks(group)
        if len(self.ranks) != comm.Get_size():
            raise ValueError(f"TP group of {len(self.ranks)} ranks against an MPI communicator of {comm.Get_size()}")
        self._ours: dict[int, bool] = {}  # id(group) -> whether it is this TP group (transformers passes its mesh's)
        peers = mpicomm.others(comm)
        self.phases = (f"TP all-reduce with {peers}", f"TP all-gather with {peers}")

    def takes(self, tensor: torch.Tensor, group: ProcessGroup | None) -> bool:
        """Whether this tensor, reduced over ``group``, goes over MPI (every rank decides the same: same dtype,
        device and group). ``group`` is this one when it holds the same ranks (transformers' device mesh hands
        its own object for the default world)."""
        if not (tensor.device.type == "cpu" and tensor.dtype in MPI_TYPES and tensor.is_contiguous()):
            return False
        ours = self._ours.get(id(group))
        if ours is None:
            ours = self._ours[id(group)] = group is self.group or _ranks(group) == self.ranks
        return ours

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """``dist.all_reduce(tensor, op)`` in place, over MPI."""
        buf = tensor.detach().numpy()
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, [buf, MPI_TYPES[tensor.dtype]], op=self.ops[op]),
                   self.phases[0])

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension, in rank order."""
        out = torch.empty((self.comm.Get_size(), *tensor.shape), dtype=tensor.dtype)
        kind = MPI_TYPES[tensor.dtype]
        self._wait(self.comm.Iallgather([tensor.detach().contiguous().numpy(), kind], [out.numpy(), kind]),
                   self.phases[1])
        return out

    def _wait(self, req: MPI.Request, phase: str) -> None:
        """Spin, then sleep in short fixed naps for up to :data:`NAPPING_S`, then the Poller's backoff and deadline.

        The naps stay short because a TP peer is late by about one uneven chunk of compute (a millisecond at a long
        prefill): the Poller's doubling naps (up to 0.5 ms) woke a rank that long after its peer had arrived, that
        rank was then the late one at the next reduction, and the two took turns waiting (bs=16 prefill: ~5 ms
        per reduction on each rank, mostly asleep)."""
        for _ in range(SPINS):
            if req.Test():
                return
        start = time.monotonic()
        while time.monotonic() - start < NAPPING_S:
            time.sleep(NAP_S)
            if req.Test():
                return
        poller = Poller(self.timeout, phase)
        while not req.Test():
            poller.sleep()


def _ranks(group: ProcessGroup | None) -> list[int]:
    """The torch world ranks of ``group`` (None: the default world), in group order."""
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class TorchDistributedOverMPI:
    """Stands in for the ``torch.distributed`` module in transformers' TP layers (``tensor_parallel.dist``) while a
    replica runs: its ``all_reduce`` goes to :class:`MPIReductions` where that takes the tensor, to torch otherwise;
    every other name is torch's own."""

    def __init__(self, reductions: MPIReductions):
        self.reductions = reductions

    def __getattr__(self, name: str):
        return getattr(dist, name)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group: ProcessGroup | None = None,
                   async_op: bool = False):
        red = self.reductions
        if async_op or op not in red.ops or not red.takes(tensor, group):
            with torch_deadline("TP all-reduce", red.timeout):  # gloo's timeout: the line an MPI wait gives
                return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        red.all_reduce(tensor, op)
        return None
