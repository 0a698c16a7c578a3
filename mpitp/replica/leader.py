"""The replica's leader: it batches and scores rows, runs HF ``generate``, and has its workers mirror each forward.

Only the leader of a replica (its rank 0) runs batching and ``generate``. Before each forward it sends its workers
one message (:mod:`mpitp.replica.protocol`); every rank then runs its part of the same forward
(:class:`mpitp.replica.shard.ReplicaShard`), so transformers' TP collectives and the stages' sends line up. The
workers' side is :mod:`mpitp.replica.worker`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from typing import TYPE_CHECKING

import torch

from mpitp import compat, testing
from mpitp.replica.generation import GenerationState, takes_growing_cache
from mpitp.replica.prefix import next_batch, pack, plan
from mpitp.replica.protocol import (
    OP_GEN_BEGIN,
    OP_GEN_END,
    OP_GEN_FORWARD,
    OP_IDLE,
    OP_SCORE,
    OP_STOP,
    BufferPool,
    ControlChannel,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from transformers import DynamicCache

    from mpitp.replica.shard import ReplicaShard

log = logging.getLogger("mpitp")
_OOM = (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (RuntimeError,)


class ReplicaLeader:
    """Rank 0 of a replica: :meth:`score_rows`, :meth:`generating`, then :meth:`idle` or :meth:`stop` its workers."""

    def __init__(self, shard: ReplicaShard, timeout: float):
        self.shard = shard
        self.model = shard.model
        self.layout = shard.layout
        self.device = shard.device
        self.stats = shard.stats
        self.channel = ControlChannel(shard.layout, timeout, shard.device, shard.ops.group, shard.stats.tp)
        self.buffers = BufferPool(shard.device)
        self.gen = GenerationState(shard)

    @property
    def has_workers(self) -> bool:
        return self.channel.has_workers

    @property
    def nonfinite_steps(self) -> int:
        """Greedy steps of the current ``generate`` call whose logits held NaN (the caller resets and reads it)."""
        return self.gen.nonfinite_steps

    @nonfinite_steps.setter
    def nonfinite_steps(self, value: int) -> None:
        self.gen.nonfinite_steps = value

    # ------------------------------------------------------------------ scoring
    def score_rows(self, rows: list[tuple[list[int], int]], batch_size: int,
                   tick: Callable[[], object] | None = None) -> list[tuple[float, bool, int]]:
        """Score token rows ``(input_tokens_plus_last_target, n_targets)`` -> ``(sum log p, all greedy, n)``.

        A row is lm-eval's ``(context + continuation)[-(max_length + 1):]``: the model reads all but the last token
        and the last ``n_targets`` tokens are scored, exactly as lm-eval's ``_loglikelihood_tokens`` slices them.
        Rows sharing their context are scored as one tree when the shard allows it and the tree costs less
        (:func:`mpitp.replica.prefix.plan`); ``batch_size`` counts rows either way.
        """
        queue = deque(plan(rows, batch_size, self.shard.share, self.shard.flop_weights))
        out: list = [None] * len(rows)
        while queue:
            batch, n_rows = next_batch(queue, batch_size)
            try:
                results = self._score_batch(batch, n_rows)
            except _OOM as exc:
                if self.has_workers:
                    # The workers may sit inside a collective of the very forward that failed: a retry cannot be
                    # agreed with them, so the job fails fast (rows computed so far stay in the file).
                    raise _OOM[0](f"out of memory on a batch of {n_rows} rows in a replica of "
                                  f"{self.channel.size} ranks ({str(exc).splitlines()[0][:160]}); rerun with a "
                                  f"smaller --batch-size and --resume") from exc
                if n_rows == 1:
                    raise
                batch_size = max(1, n_rows // 2)
                log.warning("out of memory on a batch of %d rows (%s); retrying with batch size %d",
                            n_rows, str(exc).splitlines()[0][:120], batch_size)
                _free_cache(self.device)
                queue.extendleft(reversed(batch))
                continue
            for i, r in zip((i for g in batch for i in g.rows), results):
                out[i] = r
            if tick is not None:
                tick()
        return out

    def _score_batch(self, groups, n_rows: int) -> list[tuple[float, bool, int]]:
        testing.check_oom(n_rows)
        flat, size, owner = pack(groups)
        packed = self.buffers.view(flat.numel())
        packed.copy_(flat)
        if self.has_workers:
            self.channel.send(OP_SCORE, {"packed": packed}, **size)
        lp, greedy = self.shard.score(packed, **size)
        lp, greedy = lp.double().cpu(), greedy.cpu()
        owner_t = torch.tensor(owner, dtype=torch.long)
        sums = torch.zeros(n_rows, dtype=torch.float64).index_add_(0, owner_t, lp)
        misses = torch.zeros(n_rows, dtype=torch.long).index_add_(0, owner_t, (~greedy).long())
        self.stats.tokens_scored += size["n"]
        self.stats.row_tokens += sum(len(g.ctx) + len(c) - 1 for g in groups for c in g.conts)
        self.stats.tokens_read += sum(g.packed_len for g in groups)
        conts = [c for g in groups for c in g.conts]
        return [(float(sums[k]), bool(misses[k] == 0), len(conts[k])) for k in range(n_rows)]

    # ------------------------------------------------------------------ generation
    @contextlib.contextmanager
    def generating(self, greedy: bool = False, reserve: int = 0) -> Iterator[DynamicCache | None]:
        """While active, every forward the leader's model runs (HF ``generate``'s) is mirrored by the workers.

        ``greedy`` swaps the LM head for a vocab-parallel argmax on every TP rank
        (:class:`mpitp.replica.generation.GenerationState`). Yields the KV cache to hand ``generate``
        (its ``cache`` argument; :class:`~mpitp.replica.generation.GrowingCache` with room for ``reserve`` new
        positions), or None with pipeline stages (their step code keeps ``generate``'s own) and where ``generate``
        would not build a ``DynamicCache`` (:func:`~mpitp.replica.generation.takes_growing_cache`).
        """
        model, shard, gen = self.model, self.shard, self.gen
        growing = not shard.pipeline and takes_growing_cache(model)
        if self.has_workers:
            self.channel.send(OP_GEN_BEGIN, greedy=greedy, reserve=reserve if growing else None)
        gen.begin(greedy, reserve if growing else None)
        original = model.forward

        @functools.wraps(original)  # generate validates its kwargs against the forward's signature (Falcon-H1)
        def mirrored_forward(*args, **kwargs):
            if args:
                raise TypeError("mpitp mirrors keyword-argument forwards only")
            plain, tensors = gen.encode(kwargs)
            self.channel.send(OP_GEN_FORWARD, tensors, plain=plain)
            self.stats.forwards += 1
            if shard.pipeline:
                return shard.generate_step(kwargs, gen.greedy, gen.note_nonfinite, gen.keep_cache)
            return original(**kwargs)

        # on this model only, put back (to the class's forward) on leaving: mpitp.compat
        swap = compat.replaced("torch.nn.Module.forward", mirrored_forward, on=model) if self.has_workers \
            else contextlib.nullcontext()
        ok = False
        try:
            with swap:
                yield gen.cache() if growing else None
            ok = True
        finally:
            if self.has_workers and ok:  # after a failure the workers may sit in a collective of the failed forward
                self.channel.send(OP_GEN_END)
            gen.end()

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Release the workers from their serve loop."""
        if self.has_workers:
            self.channel.send(OP_STOP, phase="TP stop")

    def idle(self) -> None:
        """Tell the workers that no forward comes until the next dispatch run: they wait without a deadline while
        rank 0 does work of its own (lm-eval's metrics, the results file), however long it takes."""
        if self.has_workers:
            self.channel.send(OP_IDLE, phase="TP idle")


def _free_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
