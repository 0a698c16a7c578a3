"""Greedy decode steps over the rows still generating: a row that met its stop sequence leaves the forwards.

HF ``generate`` keeps computing every row of a batch until the last one stops: a row that met one of lm-eval's stop
sequences (or EOS) is marked finished, its next input replaced by the pad token, and it still goes through every
forward to the end of the call. On a real model's gsm8k batch rows stop tens to hundreds of tokens apart. Here a
finished row is recognised by that replacement (its input is not the token the greedy head chose for it) and kept
aside for the rest of the call: the step runs the model on the other rows only, over a KV cache compacted to them
once each time a row leaves (:meth:`~mpitp.replica.generation.GrowingCache.keep_rows`), and hands ``generate`` back
logits for the whole batch (a finished row's pick is its pad again, which ``generate`` puts there anyway).

lm-eval's stop-sequence criteria say "done" for the batch only when every row has met its stop sequence (each keeps
a per-row ``done_tracker`` and returns whether all are done), so under lm-eval a row that met "Question:" goes on
to the batch's end. :func:`per_row_stops` hands ``generate`` the same criteria asked row by row instead: a row is
finished when its tracker says so, and the batch still ends when all are. The text lm-eval keeps is the same: it
cuts each generation at its first stop sequence, and what follows it (tokens before, the pad now) is dropped.

Greedy only (the head's choices are what tell a finished row; every rank knows them, so the leader and its workers
decide alike), into mpitp's growing cache only, and only where ``generate`` replaces a finished row's token (it does
where an EOS id is set; without one a finished row's input is a real token, and it stays in the forwards).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch
from transformers import StoppingCriteria

from mpitp import compat
from mpitp.replica.ragged_prefill import growing

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

#: A decode step's arguments this module may cut to the rows still generating (per-row tensors: the first three).
_ROWS = ("input_ids", "attention_mask", "position_ids")
_TAKEN = frozenset({*_ROWS, "cache", "use_cache", "return_dict", "logits_to_keep", "cache_position"})


class FinishedRows:
    """Per generation state: which rows of the current ``generate`` call have finished."""

    def __init__(self):
        self.finished: torch.Tensor | None = None

    def reset(self) -> None:
        self.finished = None

    def forward(self, call: Callable[..., object], kwargs: dict, gen) -> tuple[object, torch.Tensor, int] | None:
        """A greedy decode step over the rows still generating, where some row has finished: (the model's output
        for those rows, every row's pick in batch order, how many rows were computed); else None (the caller runs
        the whole step). ``gen``: the call's :class:`~mpitp.replica.generation.GenerationState`, whose
        ``last_ids`` (the greedy head's picks of the step before, whole batch) tell a finished row."""
        ids, cache, last = kwargs.get("input_ids"), kwargs.get("cache"), gen.last_ids
        if not gen.greedy or last is None or not set(kwargs) <= _TAKEN or not growing(cache):
            return None
        if not torch.is_tensor(ids) or ids.dim() != 2 or ids.shape[1] != 1 or last.shape != (ids.shape[0],):
            return None
        if cache.get_seq_length() == 0:
            return None
        b = ids.shape[0]
        if any(torch.is_tensor(kwargs.get(k)) and kwargs[k].shape[0] != b for k in _ROWS):
            return None
        newly = ids.view(-1) != last
        self.finished = newly if self.finished is None else self.finished | newly
        if not bool(self.finished.any()) or bool(self.finished.all()):
            return None
        rows = torch.nonzero(~self.finished).view(-1)
        cache.keep_rows(rows)
        out = call(**{k: v[rows] if k in _ROWS and torch.is_tensor(v) else v for k, v in kwargs.items()})
        chosen = ids.view(-1).clone()  # a finished row: its pad again
        chosen[rows] = gen.last_ids  # the greedy head's picks for the rows it computed
        gen.note_ids(chosen)
        return out, chosen, len(rows)


@contextlib.contextmanager
def per_row_stops(model, cut: Callable[[list[int]], bool] | None = None) -> Iterator[None]:
    """Inside this block ``model.generate`` (this model only) gets the stopping criteria it is passed asked row by row
    (:class:`PerRowStops`, ``cut`` its confirmation), so that a row that met its stop sequence is finished and padded
    by ``generate``, and leaves the decode steps (:class:`FinishedRows`); put back on leaving."""
    from transformers import StoppingCriteriaList

    original = model.generate  # the instance's bound method (the class's GenerationMixin.generate)

    @functools.wraps(original)
    def generate(*args, stopping_criteria=None, **kwargs):
        if stopping_criteria:
            start = kwargs["input_ids"].shape[1] if torch.is_tensor(kwargs.get("input_ids")) else None
            stopping_criteria = StoppingCriteriaList([PerRowStops(stopping_criteria, cut, start)])
        return original(*args, stopping_criteria=stopping_criteria, **kwargs)

    with compat.replaced("transformers.generation.utils.GenerationMixin.generate", generate, on=model):
        yield


class PerRowStops(StoppingCriteria):
    """Criteria that answer for the whole batch, asked per row: a criterion with a per-row ``done_tracker`` list
    (lm-eval's ``MultiTokenEOSCriteria``) counts by its tracker, any other by its own answer (per row or for all).

    A tracker finds its stop sequence in the last tokens decoded as they are (special tokens kept), but lm-eval
    decodes the generation without its special tokens before cutting it at the first stop sequence: with a stop
    sequence that is a special token's text (``<|im_end|>`` where the EOS is another token) the tracker says "done"
    while the text goes on, and under lm-eval the row keeps generating (the batch stops only when every row's
    tracker of one sequence is done, and then for every row, as here). So a row a tracker calls done finishes alone
    only once ``cut`` (its generated ids, from ``start``) says lm-eval's text of it is already cut; without ``cut``
    or ``start`` no row finishes alone."""

    def __init__(self, criteria, cut: Callable[[list[int]], bool] | None = None, start: int | None = None):
        self.criteria = list(criteria)
        self.cut = cut if start is not None else None
        self.start = start
        self.confirmed: set[int] = set()  # rows whose text lm-eval cuts: finished for good

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        tracked = torch.zeros_like(done)
        for criterion in self.criteria:
            said = criterion(input_ids, scores, **kwargs)
            tracker = getattr(criterion, "done_tracker", None)
            if isinstance(tracker, list) and len(tracker) == len(done):
                if bool(torch.as_tensor(said).all()):  # lm-eval's own verdict: every row met this one, all stop
                    return torch.ones_like(done)
                tracked |= torch.tensor(tracker, dtype=torch.bool, device=done.device)
            else:
                done |= torch.as_tensor(said, device=done.device).bool()
        if self.cut is not None:
            for i in torch.nonzero(tracked & ~done).view(-1).tolist():
                if i in self.confirmed or self.cut(input_ids[i, self.start:].tolist()):
                    self.confirmed.add(i)
                    done[i] = True
        return done
