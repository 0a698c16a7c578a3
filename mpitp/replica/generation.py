"""The state of one ``generate`` call on a rank, the same object on the leader and on its workers.

Only the leader runs HF ``generate``; each of its forwards is mirrored by the workers (see
:mod:`mpitp.replica.leader` and :mod:`mpitp.replica.worker`). For that both sides keep, for the length of the call:

- the greedy head: with greedy search the LM head is swapped, on every TP rank, for a vocab-parallel argmax of the
  last position (two all-reduces of O(batch)), so no rank gathers full logits; HF's greedy search then picks that
  token. Sampling keeps transformers' gathered logits, and only the leader samples: workers are sent its tokens, so
  one seeded generator decides for the whole group;
- the tensors of the previous forward, so a grown attention mask travels as "append a column of ones", and each
  decode step ships only the new token ids;
- on workers, their own KV-cache shard, kept in step with the leader's;
- the scoring counter set aside, since argmax reductions are not scoring traffic.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from mpitp import compat
from mpitp.replica.scoring import CommCounter, VocabParallelHead

if TYPE_CHECKING:
    from collections.abc import Callable

CACHE = "__cache__"  # the forward's KV cache: each rank passes its own
EXTEND_ONES = "__extend_ones__"  # the previous tensor of that name with a column of ones appended (the attention mask)


class GenerationState:
    """Begun and ended around each ``generate`` call on every rank of the replica; see the module docstring."""

    def __init__(self, shard):
        self.shard = shard
        self.greedy = False
        self.nonfinite_steps = 0  # greedy steps whose logits held NaN (no token reached the maximum)
        self._sent: dict[str, torch.Tensor] = {}
        self._cache = None
        self._restore_head = None
        self._scoring_counter: CommCounter | None = None

    def begin(self, greedy: bool) -> None:
        shard = self.shard
        self._sent, self._cache = {}, None
        self.greedy = greedy
        self._scoring_counter, shard.ops.reduce_counter = shard.ops.reduce_counter, CommCounter()  # argmax != scoring
        self._restore_head = self._swap_head() if greedy and not shard.pipeline else None

    def end(self) -> None:
        self._sent, self._cache = {}, None
        if self._restore_head is not None:
            self._restore_head()
            self._restore_head = None
        if self._scoring_counter is not None:
            self.shard.ops.reduce_counter = self._scoring_counter
            self._scoring_counter = None

    def note_nonfinite(self) -> None:
        self.nonfinite_steps += 1

    def _swap_head(self):
        """Replace the model's output embedding by :class:`GreedyHead` (:func:`mpitp.compat.output_head_replaced`:
        on this model only); returns the undo."""
        stack = contextlib.ExitStack()
        stack.enter_context(compat.output_head_replaced(self.shard.model,
                                                        GreedyHead(self.shard.head, self.note_nonfinite)))
        return stack.close

    def encode(self, kwargs: dict) -> tuple[dict, dict[str, torch.Tensor]]:
        """Leader: a forward's keyword arguments as (plain values and markers, tensors to send)."""
        plain, tensors = {}, {}
        for k, v in kwargs.items():
            if torch.is_tensor(v):
                prev = self._sent.get(k)
                if prev is not None and _extends_with_ones(prev, v):
                    plain[k] = EXTEND_ONES  # the grown attention mask: workers append the column
                else:
                    tensors[k] = v
                self._sent[k] = v
            elif _is_cache(v):
                plain[k] = CACHE
            elif v is None or isinstance(v, (bool, int, float, str)):
                plain[k] = v
            else:
                raise TypeError(f"cannot mirror forward argument {k}={type(v).__name__} to TP workers")
        return plain, tensors

    def keep_cache(self, cache: object) -> None:
        """Worker: the cache the model's forward returned is the one the next step extends, as HF ``generate`` keeps
        the output's ``cache`` on the leader. A model whose generate leaves the cache to the model (MiniMax
        builds a ``MiniMaxCache``, with its linear-attention states, on the first forward) gets its own class here,
        not the ``DynamicCache`` :meth:`decode` would make."""
        if _is_cache(cache):
            self._cache = cache

    def decode(self, plain: dict, tensors: dict[str, torch.Tensor]) -> dict:
        """Worker: the leader's forward's keyword arguments back from :meth:`encode`'s parts."""
        kwargs = dict(tensors)
        for k, v in plain.items():
            if v == CACHE:
                if self._cache is None:
                    from transformers import DynamicCache

                    self._cache = DynamicCache(config=self.shard.model.config)
                v = self._cache
            elif v == EXTEND_ONES:
                prev = self._sent[k]
                v = torch.cat([prev, torch.ones_like(prev[..., :1])], dim=-1)
            kwargs[k] = v
        self._sent.update({k: v for k, v in kwargs.items() if torch.is_tensor(v)})
        return kwargs


def _is_cache(v) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover
        return False
    return isinstance(v, Cache)


def _extends_with_ones(prev: torch.Tensor, new: torch.Tensor) -> bool:
    """``new`` is ``prev`` with one column of ones appended (how generate grows the attention mask)."""
    return (new.dim() == prev.dim() >= 1 and new.shape[:-1] == prev.shape[:-1] and new.shape[-1] == prev.shape[-1] + 1
            and bool((new[..., -1] == 1).all()) and torch.equal(new[..., :-1], prev))


class GreedyHead(torch.nn.Module):
    """Stands in for the LM head during greedy generation: vocab-parallel argmax of the last position.

    Returns logits that are 0 at the chosen token and -inf elsewhere, so HF's greedy search (argmax) picks exactly
    the token the sharded argmax chose (torch.argmax's lowest-index rule), without gathering the vocabulary.
    """

    def __init__(self, head: VocabParallelHead, on_nonfinite: Callable[[], None] | None = None):
        super().__init__()
        self.head = head
        self.on_nonfinite = on_nonfinite

    @property
    def weight(self) -> torch.Tensor:
        """The head's (local) weight: a model's forward may read its head's dtype (Mamba casts its hidden state to
        ``lm_head.weight.dtype`` before calling it)."""
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = self.head.argmax(hidden[:, -1, :], head_input=True)
        return chosen_token_logits(ids, self.head.vocab_size, self.on_nonfinite)


def chosen_token_logits(ids: torch.Tensor, vocab: int,
                        on_nonfinite: Callable[[], None] | None = None) -> torch.Tensor:
    """[batch, 1, vocab] logits that are 0 at ``ids`` and -inf elsewhere: HF's greedy search picks exactly ``ids``.

    An id past the vocabulary means no logit reached the row's maximum (NaN logits): token 0 stands in so the
    group's forwards stay in step, and ``on_nonfinite`` is told (the leader refuses the request afterwards)."""
    bad = ids >= vocab
    if bool(bad.any()):
        if on_nonfinite is not None:
            on_nonfinite()
        ids = torch.where(bad, torch.zeros_like(ids), ids)
    logits = torch.full((ids.shape[0], 1, vocab), float("-inf"), device=ids.device)
    logits[torch.arange(ids.shape[0], device=ids.device), 0, ids] = 0.0
    return logits
