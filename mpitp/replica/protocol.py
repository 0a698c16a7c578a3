"""What a replica's leader sends the rest of its replica, and how: one kind of message for every operation.

A message is a small dict sent over the replica's MPI communicator (its ``op``, a few plain values, and the shape and
dtype of each tensor that follows), then its tensors, broadcast from the leader over the replica's torch world (as
vLLM's ``broadcast_tensor_dict``). The others wait for the dict with a polled, sleeping MPI receive rather than a
spinning torch collective, so an idle worker costs no CPU; the tensors then take the fast path.

Operations (``op``):

=================  ===================================================================================
``score``          one scoring batch: ``b`` rows of ``t`` tokens, ``n`` scored positions; tensor ``packed``
``score_stages``   with pipeline stages, all of a chunk's batches at once (their ``sizes`` in order, their
                   ``packed`` tensors one after the other), so the stages go on from batch to batch
``gen_begin``      a ``generate`` call starts (``greedy``: swap the LM head for a vocab-parallel argmax)
``gen_forward``    one of its forwards: ``plain`` keyword arguments, the tensor ones follow by name
``gen_end``        the call ended
``idle``           no forward until the next dispatch run: wait without a deadline
``stop``           leave the worker loop
=================  ===================================================================================

Each forward's message also carries ``rows``, the rows of its batch (at most, for ``score_stages``): a worker that
runs out of memory names them in its one line, as the leader would (:meth:`ControlChannel.out_of_memory`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mpitp.errors import ReplicaOutOfMemory
from mpitp.parallel import comm as mpicomm
from mpitp.parallel.deadline import later_deadline, torch_deadline

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from mpitp.parallel.layout import Layout
    from mpitp.replica.scoring import CommCounter

OP_SCORE = "score"
OP_SCORE_STAGES = "score_stages"
OP_GEN_BEGIN = "gen_begin"
OP_GEN_FORWARD = "gen_forward"
OP_GEN_END = "gen_end"
OP_STOP = "stop"
OP_IDLE = "idle"

#: What a forward raises when its device is out of memory.
OOM_ERRORS = (torch.OutOfMemoryError,)

@dataclass
class Message:
    """One message as a worker receives it: its op, its plain values, and the tensors that follow it."""

    op: str
    meta: dict = field(default_factory=dict)
    specs: list[tuple[str, tuple, str]] = field(default_factory=list)  # (name, shape, dtype) in sending order


class ControlChannel:
    """The replica's leader-to-workers channel (one per rank; the leader sends, the others receive).

    ``tp_group`` is the torch group of this rank's TP ranks (None = the default world). Without pipeline stages that
    is the replica; with stages the replica is the default world, so tensors go there. ``counter`` counts the bytes
    this rank broadcasts.
    """

    def __init__(self, layout: Layout, timeout: float, device: str | torch.device,
                 tp_group: ProcessGroup | None = None, counter: CommCounter | None = None):
        self.layout = layout
        self.timeout = timeout
        self.device = torch.device(device)
        self.size = layout.replica_size
        self.group = tp_group if layout.pp == 1 else None
        self.counter = counter

    @functools.cached_property
    def peers(self) -> str:
        """The replica's other ranks, named by a deadline's phase."""
        return mpicomm.others(self.layout.replica_comm)

    @property
    def has_workers(self) -> bool:
        return self.size > 1

    def send(self, op: str, tensors: dict[str, torch.Tensor] | None = None, phase: str = "TP control",
             **meta: object) -> None:
        """Leader: send ``op`` with ``meta`` over MPI, then ``tensors`` (in their order) over torch."""
        tensors = {k: t.contiguous() for k, t in (tensors or {}).items()}
        specs = [(k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in tensors.items()]
        mpicomm.bcast_obj({"op": op, "meta": meta, "specs": specs}, self.layout.replica_comm, root=0,
                          timeout=self.timeout, phase=f"{phase} with {self.peers}")
        for t in tensors.values():
            self._broadcast(t, phase)

    def recv(self, phase: str, idle: bool = False) -> Message:
        """Worker: the next message's dict (its tensors come with :meth:`recv_tensors`). An idle worker (its leader
        between dispatch runs) waits without a deadline."""
        timeout = None if idle else later_deadline(self.timeout, 2)  # its leader may wait for rank 0
        msg = mpicomm.bcast_obj(None, self.layout.replica_comm, root=0, timeout=timeout, phase=phase)
        return Message(msg["op"], msg["meta"], msg["specs"])

    def recv_tensors(self, msg: Message, out: dict[str, torch.Tensor] | None = None,
                     phase: str = "TP control") -> dict[str, torch.Tensor]:
        """Worker: the tensors that follow ``msg``, received into ``out``'s tensors where given, else new ones."""
        got = {}
        for name, shape, dtype in msg.specs:
            t = (out or {}).get(name)
            if t is None:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            got[name] = self._broadcast(t, phase)
        return got

    def _broadcast(self, t: torch.Tensor, phase: str) -> torch.Tensor:
        if self.has_workers:
            import torch.distributed as dist

            if self.counter is not None:
                self.counter.add(t)
            with torch_deadline(f"{phase} with {self.peers}", self.timeout):  # gloo's timeout: one line naming it
                dist.broadcast(t, src=0, group=self.group)
        return t

    def out_of_memory(self, exc: BaseException, batch: str) -> ReplicaOutOfMemory:
        """The error that ends the job when a forward of this replica ran out of memory on any of its ranks (the
        message names the ``batch`` and the remedy): the replica's other ranks may sit inside a collective of the very
        forward that failed, so a retry with fewer rows cannot be agreed with them."""
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        return ReplicaOutOfMemory(f"out of memory in a forward of {batch} in a replica of {self.size} ranks ({first}); "
                                  f"rerun with a smaller --batch-size and --resume")


def batch_words(rows: object, at_most: bool = False) -> str:
    """A forward's batch as the out-of-memory line names it (``rows``: None where a message did not say)."""
    if not isinstance(rows, int):
        return "a batch"
    return f"a batch of {'at most ' if at_most else ''}{rows} rows"


class BufferPool:
    """Views of one persistent int64 buffer, grown in powers of two.

    Every batch has another size; allocating a fresh tensor per message fragments a GPU caching allocator (one of
    Fast-LLM's reported problems). Leader and workers size their buffers the same way.
    """

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None

    def view(self, n: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(1 << max(10, (n - 1).bit_length()), dtype=torch.long, device=self.device)
        return self._buf[:n]
