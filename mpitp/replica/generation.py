"""The state of one ``generate`` call on a rank, the same object on the leader and on its workers.

Only the leader runs HF ``generate``; each of its forwards is mirrored by the workers (see
:mod:`mpitp.replica.leader` and :mod:`mpitp.replica.worker`). For that both sides keep, for the length of the call:

- the greedy head: with greedy search the LM head is swapped, on every TP rank, for a vocab-parallel argmax of the
  last position (two all-reduces of O(batch)), so no rank gathers full logits; HF's greedy search then picks that
  token. Sampling keeps transformers' gathered logits, and only the leader samples: workers are sent its tokens, so
  one seeded generator decides for the whole group;
- the tensors of the previous forward, so a grown attention mask travels as "append a column of ones", positions
  (``cache_position``, ``position_ids``) as "the last one plus one" and, with the greedy head, the new token ids as
  "the tokens the head just chose" (every rank knows them): a greedy decode step ships no tensor at all, only its
  small message;
- on workers, their own KV-cache shard, kept in step with the leader's; on every rank (without pipeline stages) a
  :class:`GrowingCache`: transformers' ``DynamicCache`` concatenates each layer's keys and values anew at every
  decode step (the whole cache copied per token: at 960 cached positions and batch 16, 0.2 GB per step and rank of
  the 74M bench model), this one writes the new positions into a buffer sized once for the call and hands out views
  of it, the same numbers in the same layout;
- the scoring counter set aside, since argmax reductions are not scoring traffic;
- a left-padded prompt computed row by row, without its padding (:mod:`mpitp.replica.ragged_prefill`), its keys and
  values placed in the :class:`GrowingCache` where the padded forward would have put them;
- greedy decode steps over the rows still generating (:mod:`mpitp.replica.finished_rows`): a row that met a stop
  sequence or EOS leaves the forwards.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from mpitp import compat
from mpitp.replica.scoring import CommCounter, VocabParallelHead

if TYPE_CHECKING:
    from collections.abc import Callable

CACHE = "__cache__"  # the forward's KV cache: each rank passes its own
EXTEND_ONES = "__extend_ones__"  # the previous tensor of that name with a column of ones appended (the attention mask)
NEXT_POSITION = "__next_position__"  # the last column of the previous tensor of that name, plus one (positions)
GREEDY_IDS = "__greedy_ids__"  # the ids the greedy head chose at the previous forward, as one column (decode input)
STATE = "__state__"  # a recurrent state list the model returned (RWKV's ``state``): each rank passes its own


class GenerationState:
    """Begun and ended around each ``generate`` call on every rank of the replica; see the module docstring."""

    def __init__(self, shard, timeout: float | None = None):
        from mpitp.replica.finished_rows import FinishedRows
        from mpitp.replica.ragged_prefill import RaggedPrefill

        self.shard = shard
        self.ragged = RaggedPrefill(shard, timeout)  # its verdict (probed at the first padded prefill) kept
        self.finished = FinishedRows()
        self.greedy = False
        self.nonfinite_steps = 0  # greedy steps whose logits held NaN (no token reached the maximum)
        self.last_ids: torch.Tensor | None = None  # the greedy head's last choice, the same on every rank
        self.reserve = 0
        self._sent: dict[str, torch.Tensor] = {}
        self._cache = None
        self._state = None
        self._restore_head = None
        self._scoring_counter: CommCounter | None = None

    def begin(self, greedy: bool, reserve: int | None = 0) -> None:
        """A ``generate`` call starts; ``reserve``: the most positions it adds to its prompt (the KV cache's spare
        room, :class:`GrowingCache`), None where the call keeps transformers' own kind of cache
        (:func:`takes_growing_cache`)."""
        shard = self.shard
        self._sent, self._cache, self._state, self.last_ids = {}, None, None, None
        self.finished.reset()
        self.greedy = greedy
        self.reserve = reserve
        self._scoring_counter, shard.ops.reduce_counter = shard.ops.reduce_counter, CommCounter()  # argmax != scoring
        self._restore_head = self._swap_head() if greedy and not shard.pipeline else None

    def end(self) -> None:
        self._sent, self._cache, self._state, self.last_ids = {}, None, None, None
        self.finished.reset()
        if self._restore_head is not None:
            self._restore_head()
            self._restore_head = None
        if self._scoring_counter is not None:
            self.shard.ops.reduce_counter = self._scoring_counter
            self._scoring_counter = None

    def note_nonfinite(self) -> None:
        self.nonfinite_steps += 1

    def note_ids(self, ids: torch.Tensor) -> None:
        self.last_ids = ids

    def forward(self, call: Callable[..., object], kwargs: dict) -> object:
        """One forward of the call on this rank, ``call`` being the model's own forward: a left-padded prefill row by
        row where the model allows it (:mod:`mpitp.replica.ragged_prefill`), a greedy decode step over the rows
        still generating (:mod:`mpitp.replica.finished_rows`), else ``call(**kwargs)``; the leader and its workers
        decide alike from the same arguments."""
        rows = self.ragged.forward(call, kwargs, self)
        if rows is not None:
            out, logits, ran = rows
        else:
            rows = self.finished.forward(call, kwargs, self)
            if rows is None:
                return call(**kwargs)
            out, chosen, n = rows
            logits, ran = chosen_token_logits(chosen, out.logits.shape[-1]), [(n, 1, 0)]
        # the whole batch's output, of the model's own type, with the forwards it ran instead of the one asked for
        result = type(out)(logits=logits, cache=kwargs["cache"])
        result.mpitp_ragged_rows = ran  # testing.RAGGED_ROWS (the forward log, the leader's count): not a field
        return result

    def cache(self) -> DynamicCache:
        """This rank's KV cache for the current call: a :class:`GrowingCache` (a plain ``DynamicCache`` with pipeline
        stages, whose step code builds its own per stage, or where the call keeps transformers' cache), made on first
        use. The leader hands it to ``generate`` (its ``cache`` argument), a worker to the forwards it mirrors."""
        if self._cache is None:
            config = self.shard.model.config
            plain = self.shard.pipeline or self.reserve is None
            self._cache = DynamicCache(config=config) if plain else GrowingCache(config, self.reserve)
        return self._cache

    def _swap_head(self):
        """Replace the model's output embedding by :class:`GreedyHead` (:func:`mpitp.compat.output_head_replaced`:
        on this model only); returns the undo."""
        stack = contextlib.ExitStack()
        stack.enter_context(compat.output_head_replaced(
            self.shard.model, GreedyHead(self.shard.head, self.note_nonfinite, self.note_ids)))
        return stack.close

    def encode(self, kwargs: dict) -> tuple[dict, dict[str, torch.Tensor]]:
        """Leader: a forward's keyword arguments as (plain values and markers, tensors to send)."""
        plain, tensors = {}, {}
        for k, v in kwargs.items():
            if torch.is_tensor(v):
                prev = self._sent.get(k)
                if prev is not None and _extends_with_ones(prev, v):
                    plain[k] = EXTEND_ONES  # the grown attention mask: workers append the column
                elif k == "input_ids" and _is_column_of(self.last_ids, v):
                    plain[k] = GREEDY_IDS  # a decode step's input: the tokens every rank's greedy head just chose
                elif prev is not None and _next_position(prev, v):
                    plain[k] = NEXT_POSITION  # cache_position, position_ids: one step on
                else:
                    tensors[k] = v
                self._sent[k] = v
            elif _is_cache(v):
                plain[k] = CACHE
            elif k == "state" and isinstance(v, (list, tuple)) and all(torch.is_tensor(t) for t in v):
                plain[k] = STATE  # a rank's own: with TP each holds its channels' part
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

    def keep_state(self, state: object) -> None:
        """Worker: the recurrent state the model's forward returned (RWKV's ``state`` list, which HF ``generate``
        passes back on the leader), for the next mirrored forward's :data:`STATE`."""
        if state is not None:
            self._state = state

    def decode(self, plain: dict, tensors: dict[str, torch.Tensor]) -> dict:
        """Worker: the leader's forward's keyword arguments back from :meth:`encode`'s parts."""
        kwargs = dict(tensors)
        for k, v in plain.items():
            if v == CACHE:
                v = self.cache()
            elif v == STATE:
                v = self._state
            elif v == EXTEND_ONES:
                prev = self._sent[k]
                v = torch.cat([prev, torch.ones_like(prev[..., :1])], dim=-1)
            elif v == GREEDY_IDS:
                v = self.last_ids.view(-1, 1)
            elif v == NEXT_POSITION:
                v = self._sent[k][..., -1:] + 1
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


def _is_column_of(ids: torch.Tensor | None, new: torch.Tensor) -> bool:
    """``new`` is ``ids`` as one column ``[batch, 1]``, same dtype (HF's next decode input after a greedy step; a
    finished row's pad token makes it differ, and then the tensor is sent)."""
    return (ids is not None and new.dim() == 2 and new.shape == (ids.shape[0], 1) and new.dtype == ids.dtype
            and new.device == ids.device and torch.equal(new.view(-1), ids))


def _next_position(prev: torch.Tensor, new: torch.Tensor) -> bool:
    """``new`` is the last column of ``prev`` plus one (how generate advances ``cache_position`` and
    ``position_ids`` by a decode step)."""
    return (new.dim() == prev.dim() >= 1 and new.shape[-1] == 1 and new.shape[:-1] == prev.shape[:-1]
            and new.dtype == prev.dtype and prev.shape[-1] >= 1 and torch.equal(new, prev[..., -1:] + 1))


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in one buffer per call, handed out as views of its filled part.

    ``DynamicLayer.update`` concatenates (``torch.cat``) the cached keys and values with the new ones at every step,
    copying the whole cache per generated token. Here the first update allocates room for its positions plus
    ``reserve`` more (the tokens the call may add), and each later update copies only its new positions in. The
    attention reads the same numbers with the same shape ``[batch, heads, positions, head_dim]`` (a view whose
    positions are strided by the capacity: the kernels index by stride, so the results are the same bits,
    ``tests/test_generation_state.py``). Whatever replaces :attr:`keys` from outside (``crop``, ``reorder_cache``,
    ``batch_select_indices``: new tensors) is adopted into a new buffer at the next update.
    """

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = max(0, int(reserve))
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rows: int | None = None  # the first rows of the buffers in use (:meth:`compact`), None: all
        self.handed: torch.Tensor | None = None  # the keys view last returned: anything else was set from outside

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions (dim -2) and return all cached keys and values, as ``DynamicLayer.update``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        have = self.keys if self.keys is not None and self.keys.numel() else None
        length = 0 if have is None else int(have.shape[-2])
        n = length + int(key_states.shape[-2])
        buf = self.buffers
        if buf is not None and self.rows is not None:  # the rows still generating: a prefix of the buffers
            buf = (buf[0][:self.rows], buf[1][:self.rows])
        if (buf is None or have is not self.handed or n > buf[0].shape[-2]
                or buf[0].shape[:-2] != key_states.shape[:-2] or buf[1].shape[:-2] != value_states.shape[:-2]):
            grown = 0 if buf is None else 2 * buf[0].shape[-2]  # past the reserve (a caller's longer call): double
            cap = max(n + self.reserve, grown)
            kb = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
            vb = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
            if have is not None:
                kb[..., :length, :].copy_(have)
                vb[..., :length, :].copy_(self.values)
            buf = self.buffers = (kb, vb)
            self.rows = None
        kb, vb = buf
        kb[..., length:n, :].copy_(key_states)
        vb[..., length:n, :].copy_(value_states)
        self.keys, self.values = kb[..., :n, :], vb[..., :n, :]
        self.handed = self.keys
        return self.keys, self.values

    def place(self, rows: torch.Tensor, offset: int, length: int, batch: int, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Put ``rows``' keys and values (``[len(rows), heads, length - offset, head_dim]``, computed without the
        rows' padding) at slots ``offset:length`` of a ``batch``-row buffer, the slots a left-padded forward of
        ``length`` positions would have filled; the pad slots are zeros (the attention mask hides them)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        if self.buffers is None:
            cap = length + self.reserve
            self.buffers = (keys.new_empty((batch, *keys.shape[1:-2], cap, keys.shape[-1])),
                            values.new_empty((batch, *values.shape[1:-2], cap, values.shape[-1])))
        kb, vb = self.buffers
        kb[rows, ..., offset:length, :] = keys
        vb[rows, ..., offset:length, :] = values
        if offset:  # zero, not whatever the memory held: a NaN there would survive an additive mask
            kb[rows, ..., :offset, :] = 0
            vb[rows, ..., :offset, :] = 0
        self.keys, self.values = kb[..., :length, :], vb[..., :length, :]
        self.handed = self.keys

    def compact(self, index: torch.Tensor) -> None:
        """Keep only the rows at ``index`` (of those in use, ascending), moved to the front of the buffers: the
        next updates and views cover those rows alone (:mod:`mpitp.replica.finished_rows`)."""
        kb, vb = self.buffers
        length, n = int(self.keys.shape[-2]), len(index)
        kb[:n, ..., :length, :] = kb[index, ..., :length, :]  # the index picks a copy first: no overlap
        vb[:n, ..., :length, :] = vb[index, ..., :length, :]
        self.rows = n
        self.keys, self.values = kb[:n, ..., :length, :], vb[:n, ..., :length, :]
        self.handed = self.keys

    def reset(self) -> None:
        self.buffers = self.handed = self.rows = None
        super().reset()


class GrowingCache(DynamicCache):
    """``DynamicCache(config=config)`` with its full-attention layers (plain ``DynamicLayer``) made
    :class:`GrowingLayer`; sliding-window and other layer kinds stay transformers' own."""

    GROWING = True  # how mpitp.replica.ragged_prefill, which this module imports, knows one

    def keep_rows(self, rows: torch.Tensor) -> None:
        """From now on the forwards compute only the batch rows ``rows`` (ascending, among those kept so far): each
        layer's buffers compacted to them once, when the set shrinks (:mod:`mpitp.replica.finished_rows`)."""
        kept = self.kept
        if kept is not None and torch.equal(kept, rows):
            return
        index = rows if kept is None else torch.searchsorted(kept, rows)
        for layer in self.layers:
            layer.compact(index)
        self.kept = rows

    def __init__(self, config, reserve: int = 0):
        super().__init__(config=config)
        self.layers = [GrowingLayer(reserve) if type(layer) is DynamicLayer else layer for layer in self.layers]
        self.kept: torch.Tensor | None = None  # the batch rows the buffers hold (:meth:`keep_rows`), None: all


def takes_growing_cache(model) -> bool:
    """Whether ``generate`` would build the model's cache as ``DynamicCache(config=...)`` itself, so that a
    :class:`GrowingCache` can stand in for it: not where the model makes its own (MiniMax's linear-attention cache,
    RWKV's states: transformers' ``_supports_default_dynamic_cache``), nor where its generation config asks for
    another kind (a static or quantised cache) or for none, nor where its forward takes no ``cache`` (OpenAI GPT:
    ``generate`` builds one it never reads, but refuses one handed in, as it checks its arguments)."""
    import inspect

    takes = set(inspect.signature(model.prepare_inputs_for_generation).parameters) | \
        set(inspect.signature(model.forward).parameters)
    if "cache" not in takes:
        return False
    gc = getattr(model, "generation_config", None)
    if getattr(gc, "use_cache", True) is False or getattr(gc, "cache_implementation", None) not in (None, "dynamic"):
        return False
    return bool(compat.attribute(compat.DEFAULT_CACHE).__func__(type(model)))


class GreedyHead(torch.nn.Module):
    """Stands in for the LM head during greedy generation: vocab-parallel argmax of the last position.

    Returns logits that are 0 at the chosen token and -inf elsewhere, so HF's greedy search (argmax) picks exactly
    the token the sharded argmax chose (torch.argmax's lowest-index rule), without gathering the vocabulary.
    """

    def __init__(self, head: VocabParallelHead, on_nonfinite: Callable[[], None] | None = None,
                 on_ids: Callable[[torch.Tensor], None] | None = None):
        """``on_ids``: told the ids HF's greedy search will pick (NaN rows as token 0), on every rank alike."""
        super().__init__()
        self.head = head
        self.on_nonfinite = on_nonfinite
        self.on_ids = on_ids

    @property
    def weight(self) -> torch.Tensor:
        """The head's (local) weight: a model's forward may read its head's dtype (Mamba casts its hidden state to
        ``lm_head.weight.dtype`` before calling it)."""
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = self.head.argmax(hidden[:, -1, :], head_input=True)
        if self.on_ids is not None:
            self.on_ids(torch.where(ids >= self.head.vocab_size, torch.zeros_like(ids), ids))
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
