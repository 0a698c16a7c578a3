"""The replica's leader: it batches and scores rows, runs HF ``generate``, and has its workers mirror each forward.

Only the leader of a replica (its rank 0) runs batching and ``generate``. Before each forward it sends its workers
one message (:mod:`mpitp.replica.protocol`; with pipeline stages one per set of rows to score, all its batches in
it); every rank then runs its part of the same forward
(:class:`mpitp.replica.shard.ReplicaShard`), so transformers' TP collectives and the stages' sends line up. The
workers' side is :mod:`mpitp.replica.worker`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mpitp import compat, testing
from mpitp.replica.generation import GenerationState, takes_growing_cache
from mpitp.replica.prefix import next_batch, pack, plan
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
    from collections.abc import Callable, Iterator

    from transformers import DynamicCache

    from mpitp.replica.shard import ReplicaShard

log = logging.getLogger("mpitp")


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
        self.gen = GenerationState(shard, timeout)

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
        if self.shard.pipeline:
            return self._score_stages(queue, batch_size, out, tick)
        while queue:
            batch, n_rows = next_batch(queue, batch_size)
            try:
                results = self._score_batch(batch, n_rows)
            except OOM_ERRORS as exc:
                if self.has_workers:
                    # The workers may sit inside a collective of the very forward that failed: a retry cannot be
                    # agreed with them, so the job fails fast (rows computed so far stay in the file).
                    raise self.channel.out_of_memory(exc, batch_words(n_rows)) from exc
                if n_rows == 1:
                    raise
                batch_size = max(1, n_rows // 2)
                log.warning("out of memory on a batch of %d rows (%s); retrying with batch size %d",
                            n_rows, str(exc).splitlines()[0][:120], batch_size)
                _free_cache(self.device)
                queue.extendleft(reversed(batch))
                continue
            _place(batch, results, out, tick)
        return out

    def _score_stages(self, queue: deque, batch_size: int, out: list, tick: Callable[[], object] | None) -> list:
        """:meth:`score_rows` through pipeline stages: every batch of the rows in one message, so that the stages go
        on from one batch to the next (:meth:`mpitp.replica.shard.ReplicaShard.score_batches`); an out-of-memory
        error ends the job, as for any replica with workers."""
        batches = []
        while queue:
            groups, n_rows = next_batch(queue, batch_size)
            testing.check_oom(n_rows)
            batches.append(_Packed(groups, n_rows, *pack(groups)))
        packed = self.buffers.view(sum(p.flat.numel() for p in batches))
        views = packed.split([p.flat.numel() for p in batches])
        for view, p in zip(views, batches):
            view.copy_(p.flat)
        sizes = [p.size for p in batches]
        rows = max(p.n_rows for p in batches)
        self.channel.send(OP_SCORE_STAGES, {"packed": packed}, sizes=sizes, rows=rows)
        scored = self.shard.score_batches(list(zip(views, sizes)))
        for p in batches:
            try:
                lp, greedy = next(scored)
            except OOM_ERRORS as exc:
                raise self.channel.out_of_memory(exc, batch_words(rows, at_most=True)) from exc
            _place(p.groups, self._results(p.groups, p.n_rows, p.size, p.owner, lp, greedy), out, tick)
        return out

    def _score_batch(self, groups, n_rows: int) -> list[tuple[float, bool, int]]:
        testing.check_oom(n_rows)
        flat, size, owner = pack(groups)
        packed = self.buffers.view(flat.numel())
        packed.copy_(flat)
        if self.has_workers:
            self.channel.send(OP_SCORE, {"packed": packed}, rows=n_rows, **size)
        lp, greedy = self.shard.score(packed, **size)
        return self._results(groups, n_rows, size, owner, lp, greedy)

    def _results(self, groups, n_rows: int, size: dict, owner: list[int], lp: torch.Tensor,
                 greedy: torch.Tensor) -> list[tuple[float, bool, int]]:
        """Each row's (sum log p, all greedy, n targets) from a batch's scored positions; counts its tokens."""
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
            if not self.has_workers:
                return forward(kwargs)
            rows = _batch_rows(kwargs)
            plain, tensors = gen.encode(kwargs)
            self.channel.send(OP_GEN_FORWARD, tensors, plain=plain, rows=rows)
            try:
                return forward(kwargs)
            except OOM_ERRORS as exc:  # the workers may sit in a collective of this forward: no retry, one line
                raise self.channel.out_of_memory(exc, batch_words(rows)) from exc

        def forward(kwargs):
            if shard.pipeline:
                if self.has_workers:
                    self.stats.forwards += 1
                return shard.generate_step(kwargs, gen.greedy, gen.note_nonfinite, gen.keep_cache)
            out = gen.forward(original, kwargs)  # a padded prefill row by row where it may (ragged_prefill)
            if self.has_workers:  # the forwards it ran: one per prompt length where a prefill went row by row
                ran = getattr(out, testing.RAGGED_ROWS, None)
                self.stats.forwards += len(ran) if ran else 1
            return out

        # on this model only, put back (to the class's forward) on leaving: mpitp.compat. Without workers only for
        # the row-by-row prefill, which needs the growing cache
        swap = compat.replaced("torch.nn.Module.forward", mirrored_forward, on=model) \
            if self.has_workers or growing else contextlib.nullcontext()
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
    def stop(self, refusal: str | None = None) -> None:
        """Release the workers from their serve loop; with ``refusal`` (rank 0's, relayed between runs: the workers
        wait idle) each raises it as a :class:`~mpitp.errors.RelayedRefusal`."""
        if self.has_workers:
            self.channel.send(OP_STOP, phase="TP stop", **({"refusal": refusal} if refusal is not None else {}))

    def idle(self) -> None:
        """Tell the workers that no forward comes until the next dispatch run: they wait without a deadline while
        rank 0 does work of its own (lm-eval's metrics, the results file), however long it takes."""
        if self.has_workers:
            self.channel.send(OP_IDLE, phase="TP idle")


@dataclass(frozen=True)
class _Packed:
    """One batch of :meth:`ReplicaLeader._score_stages`: its groups and rows, and :func:`pack`'s three results."""

    groups: list
    n_rows: int
    flat: torch.Tensor
    size: dict
    owner: list[int]


def _place(groups, results: list, out: list, tick: Callable[[], object] | None) -> None:
    """A batch's results into ``out`` at its rows' indices, then one ``tick`` of the progress bar."""
    for i, r in zip((i for g in groups for i in g.rows), results):
        out[i] = r
    if tick is not None:
        tick()


def _batch_rows(kwargs: dict) -> int | None:
    """The rows of a ``generate`` forward's batch (None: no input tensor to tell)."""
    for name in ("input_ids", "inputs_embeds"):
        if torch.is_tensor(kwargs.get(name)):
            return int(kwargs[name].shape[0])
    return None


def _free_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
