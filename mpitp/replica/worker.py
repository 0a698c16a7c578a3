"""A replica's worker (every rank but its leader): mirror the leader's forwards until it says stop.

Each message (:mod:`mpitp.replica.protocol`) names one operation; the worker runs its part of the same forward
(:class:`mpitp.replica.shard.ReplicaShard`), keeping its own KV-cache shard in step during generation
(:class:`mpitp.replica.generation.GenerationState`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mpitp import testing
from mpitp.errors import RelayedRefusal
from mpitp.replica.generation import GenerationState
from mpitp.replica.prefix import packed_size
from mpitp.replica.protocol import (
    OOM_ERRORS,
    OP_GEN_BEGIN,
    OP_GEN_END,
    OP_GEN_FORWARD,
    OP_IDLE,
    OP_SCORE,
    OP_SCORE_STAGES,
    OP_STOP,
    BufferPool,
    ControlChannel,
    batch_words,
)

if TYPE_CHECKING:
    from mpitp.replica.shard import ReplicaShard


class ReplicaWorker:
    """A rank of a replica other than its leader; :meth:`serve` is all it does."""

    def __init__(self, shard: ReplicaShard, timeout: float):
        self.shard = shard
        self.layout = shard.layout
        self.stats = shard.stats
        self.channel = ControlChannel(shard.layout, timeout, shard.device, shard.ops.group, shard.stats.tp)
        self.buffers = BufferPool(shard.device)
        self.gen = GenerationState(shard, timeout)
        lay = shard.layout
        who = "TP worker" if not shard.pipeline or lay.first_stage else f"pipeline stage {lay.pp_rank}"
        self.wait_phase = f"{who} waiting for its leader rank {lay.replica_ranks[0]}"

    def serve(self) -> None:
        """Mirror the leader's forwards until it says stop.

        Idle until the first forward (rank 0 is building lm-eval's tasks) and after each ``idle``: then the wait has
        no deadline (see :func:`mpitp.evaluation.dispatch.serve_remote` for why that still ends a broken job).
        """
        idle = True
        while True:
            msg = self.channel.recv(self.wait_phase, idle=idle)
            op = msg.op
            idle = op == OP_IDLE
            testing.check_raise(self.layout.rank, self.stats.forwards)
            if op == OP_STOP:
                if "refusal" in msg.meta:
                    raise RelayedRefusal(msg.meta["refusal"])
                return
            try:
                self._run(msg)
            except OOM_ERRORS as exc:
                # One line naming the batch and the remedy, as on the leader: not a traceback of this worker's
                # forward. The leader may sit in a collective of the same forward: the abort that follows ends it.
                batch = batch_words(msg.meta.get("rows"), at_most=op == OP_SCORE_STAGES)
                raise self.channel.out_of_memory(exc, batch) from exc

    def _run(self, msg) -> None:
        """One message's part of the leader's work (every op but ``stop``)."""
        op = msg.op
        if op == OP_SCORE:
            size = {k: msg.meta[k] for k in ("b", "t", "n", "r")}
            packed = self.channel.recv_tensors(msg, {"packed": self.buffers.view(packed_size(**size))})["packed"]
            self.shard.score(packed, **size)
        elif op == OP_SCORE_STAGES:
            self._score_stages(msg)
        elif op == OP_GEN_BEGIN:
            reserve = msg.meta.get("reserve")
            self.gen.begin(bool(msg.meta.get("greedy")), None if reserve is None else int(reserve))
        elif op == OP_GEN_FORWARD:
            self._gen_forward(msg)
        elif op == OP_GEN_END:
            self.gen.end()
        elif op == OP_IDLE:
            pass
        else:  # pragma: no cover - protocol bug
            raise RuntimeError(f"unknown TP control op {op!r}")

    def _score_stages(self, msg) -> None:
        sizes = msg.meta["sizes"]
        lengths = [packed_size(**size) for size in sizes]
        packed = self.channel.recv_tensors(msg, {"packed": self.buffers.view(sum(lengths))})["packed"]
        for _ in self.shard.score_batches(list(zip(packed.split(lengths), sizes))):
            pass

    def _gen_forward(self, msg) -> None:
        kwargs = self.gen.decode(msg.meta["plain"], self.channel.recv_tensors(msg))
        if self.shard.pipeline:
            self.shard.generate_step(kwargs, self.gen.greedy, self.gen.note_nonfinite, self.gen.keep_cache)
        else:
            with torch.no_grad():
                out = self.gen.forward(self.shard.model, kwargs)
            self.gen.keep_cache(getattr(out, "cache", None))
            self.gen.keep_state(getattr(out, "state", None))
        self.stats.forwards += 1
