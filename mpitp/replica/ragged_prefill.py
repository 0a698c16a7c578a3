"""The prompt of a left-padded ``generate`` batch computed row by row, without its padding.

lm-eval pads a batch of prompts on the left to the longest, and HF ``generate``'s first forward (the prefill) runs
the whole ``[batch, longest]`` block with an attention mask. On a gsm8k batch (16 five-shot prompts of 606-960 GPT-2
tokens) that computes 15,360 positions for 13,234 real ones, and the mask takes SDPA off its causal kernel: on this
project's bench model the padded prefill took 7.6-8.2 s where the same rows one by one took 4.9-5.0 s (one process,
two threads; bench/README). Here the rows of each prompt length go through the model together, unpadded, at the
positions the padded forward gives them (HF ``generate`` numbers each row's tokens from 0 at its first real one),
each into a cache of its own; their keys and values are then placed in the call's
:class:`~mpitp.replica.generation.GrowingCache` at the slots the padded forward would have filled (a pad's slot
zero: the attention mask hides it from every decode step), and HF ``generate`` goes on from there as before.

Whether a model computes a row alike with and without its padding (a model could read the mask or the pads in
ways of its own) is decided from numbers, not from a list: the first time a run's generation meets a padded
prefill, every rank of the replica computes a small padded probe both ways and compares the two caches (every
layer's keys and values at the real slots), the chosen tokens or logits, and those of one decode step after; the
replica agrees on one verdict (one objection turns it off everywhere, since the ranks' TP collectives must stay in
step) and keeps it for the run.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

#: The keyword arguments a prefill may carry for the rows to be split; anything else (positions, images, token
#: types) keeps the padded forward.
_TAKEN = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "use_cache", "return_dict",
                    "logits_to_keep"})
#: Probe rows: real lengths (the shorter one left-padded to the longer).
_PROBE_LENGTHS = (13, 6)


class RaggedPrefill:
    """One per rank and generation state: :meth:`forward` runs a padded prefill row by row where it may."""

    def __init__(self, shard, timeout: float | None = None):
        self.shard = shard
        self.timeout = timeout
        self.verdict: bool | None = None  # None: not probed yet
        self.why: str | None = None

    def forward(self, call: Callable[..., object], kwargs: dict, gen) -> tuple[object, torch.Tensor, list] | None:
        """The prefill computed row by row (:func:`_run_rows`' three results), or None where the padded forward runs
        (``call(**kwargs)``, the caller's). ``call``: the model's own forward (not the mirrored one); ``gen``: the
        call's :class:`~mpitp.replica.generation.GenerationState` (its greedy head's chosen ids are kept in batch
        order)."""
        pads = _left_pads(kwargs, gen)
        if pads is None or not _takes(self.shard.model, "position_ids"):
            return None
        if self.verdict is None:
            self._probe(call, gen, kwargs)
        if not self.verdict:
            return None
        return _run_rows(call, kwargs, pads, gen, kwargs["cache"])

    def summary(self) -> str | None:
        """The run summary's phrase (:func:`mpitp.evaluation.finish.report`): None where no padded prefill came,
        ``"row by row"``, or why the prefill stayed padded."""
        if self.verdict is None:
            return None
        return "row by row" if self.verdict else f"padded ({self.why})"

    def _probe(self, call, gen, like: dict) -> None:
        """Decide :attr:`verdict` (collective over the replica: every rank probes, one objection turns it off)."""
        from mpitp.parallel import comm as mpicomm

        try:
            why = _probe_once(call, gen, self.shard, like)
        except Exception as exc:  # noqa: BLE001 - a forward that refuses the split keeps the padded prefill
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        comm = self.shard.layout.replica_comm
        if comm is not None and comm.Get_size() > 1:
            why = mpicomm.first_objection(why, comm, self.timeout, phase="row-by-row prefill check")
        self.verdict, self.why = why is None, why


def _left_pads(kwargs: dict, gen) -> torch.Tensor | None:
    """Per row, how many pad slots lead it, where ``kwargs`` is a prefill this module may split: a batch of at least
    two rows into an empty :class:`GrowingCache`, a 0/1 mask of zeros then ones in every row, some row padded."""
    if not set(kwargs) <= _TAKEN or kwargs.get("use_cache") is False:
        return None
    ids, mask, cache = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("cache")
    if not (torch.is_tensor(ids) and torch.is_tensor(mask) and growing(cache)):
        return None
    if ids.dim() != 2 or ids.shape[0] < 2 or mask.shape != ids.shape or cache.get_seq_length() != 0:
        return None
    pos = kwargs.get("position_ids")
    if pos is not None and (not torch.is_tensor(pos) or pos.shape != ids.shape):
        return None
    if kwargs.get("logits_to_keep", 1) != 1:
        return None
    if any(layer.is_initialized for layer in cache.layers):
        return None
    real = mask.sum(dim=1)
    pads = ids.shape[1] - real
    if not bool((mask == 0).logical_or(mask == 1).all()) or bool((real < 1).any()) or not bool((pads > 0).any()):
        return None
    slots = torch.arange(ids.shape[1], device=mask.device)
    if not torch.equal(mask.bool(), slots.unsqueeze(0) >= pads.unsqueeze(1)):  # not left padding
        return None
    return pads


def growing(cache) -> bool:
    """A :class:`~mpitp.replica.generation.GrowingCache` whose every layer is a ``GrowingLayer`` (full attention:
    one that can :meth:`~mpitp.replica.generation.GrowingLayer.place` rows), known by what it does (this module is
    imported by that one)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and getattr(type(cache), "GROWING", False) and all(
        callable(getattr(layer, "place", None)) for layer in layers)


def _takes(model, name: str) -> bool:
    """Whether the model's class's forward takes ``name`` (the instance's may be the leader's mirrored one)."""
    return name in inspect.signature(type(model).forward).parameters


def _run_rows(call, kwargs: dict, pads: torch.Tensor, gen, cache) -> tuple[object, torch.Tensor, list]:
    """Each prompt length's rows through ``call`` unpadded; their keys and values into ``cache`` at the padded
    forward's slots. Returns the last group's output (its type for the whole batch's), the last position's logits of
    every row in batch order ``[batch, 1, vocab]`` and the forwards run, ``[(rows, length, pad)]``."""
    from transformers.cache_utils import DynamicCache

    ids = kwargs["input_ids"]
    b, t = ids.shape
    config = gen.shard.model.config
    extra = {"logits_to_keep": 1} if _takes(gen.shard.model, "logits_to_keep") else {}  # the last position's
    logits, chosen, out, groups = None, None, None, []
    for pad in sorted({int(p) for p in pads.tolist()}):
        rows = torch.nonzero(pads == pad).view(-1)
        part = DynamicCache(config=config)
        gen.last_ids = None
        pos = kwargs.get("position_ids")  # HF's: each row's tokens from 0, whatever its padding
        pos = pos[rows, pad:] if pos is not None else torch.arange(pad, t, device=ids.device).expand(len(rows), -1)
        out = call(input_ids=ids[rows, pad:], attention_mask=kwargs["attention_mask"][rows, pad:], position_ids=pos,
                   cache=part, use_cache=True, return_dict=True, **extra)
        last = out.logits[:, -1:, :]
        if logits is None:
            logits = last.new_empty((b, 1, last.shape[-1]))
        logits[rows] = last
        if gen.last_ids is not None:
            if chosen is None:
                chosen = gen.last_ids.new_zeros(b)
            chosen[rows] = gen.last_ids
        for layer, got in zip(cache.layers, part.layers):
            layer.place(rows, pad, t, b, got.keys, got.values)
        groups.append((len(rows), t - pad, pad))
    if chosen is not None:
        gen.note_ids(chosen)
    return out, logits, groups


def _probe_once(call, gen, shard, like: dict) -> str | None:
    """Run the probe padded and row by row, with the arguments ``like`` (the first real prefill) has; None when the
    two agree, else what differed."""
    from transformers.cache_utils import DynamicCache

    vocab = int(shard.model.config.get_text_config().vocab_size)
    t = max(_PROBE_LENGTHS)
    g = torch.Generator().manual_seed(2718)
    ids = torch.randint(0, vocab, (len(_PROBE_LENGTHS), t), generator=g).to(shard.device)
    mask = torch.stack([torch.arange(t) >= t - n for n in _PROBE_LENGTHS]).long().to(shard.device)
    probe = {"input_ids": ids, "attention_mask": mask, "use_cache": True, "return_dict": True}
    if "position_ids" in like:  # as HF generate numbers a left-padded row: from 0 at its first token
        probe["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    if "logits_to_keep" in like:
        probe["logits_to_keep"] = 1
    saved = gen.last_ids, gen.nonfinite_steps
    try:
        padded_cache = DynamicCache(config=shard.model.config)
        with torch.no_grad():
            padded = call(**probe, cache=padded_cache)
            rows_cache = type(like["cache"])(shard.model.config, 0)  # a GrowingCache, as the real call's
            _, split, _ = _run_rows(call, {**probe, "cache": rows_cache}, t - mask.sum(1), gen, rows_cache)
        step = {"input_ids": torch.tensor([[5], [7]], device=ids.device),
                "attention_mask": torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1),
                **{k: v for k, v in probe.items() if k in ("use_cache", "return_dict", "logits_to_keep")}}
        if "position_ids" in probe:
            step["position_ids"] = probe["position_ids"][:, -1:] + 1
        with torch.no_grad():  # one decode step on each cache: the pad slots hidden alike
            padded_step = call(**step, cache=padded_cache)
            split_step = call(**step, cache=rows_cache)
    finally:
        gen.last_ids, gen.nonfinite_steps = saved
    for i, (a, b) in enumerate(zip(padded_cache.layers, rows_cache.layers)):
        for what, x, y in (("keys", a.keys, b.keys), ("values", a.values, b.values)):
            if x is None or y is None or x.shape != y.shape:
                return f"layer {i}'s cached {what} differ in shape"
            for r, n in enumerate(_PROBE_LENGTHS):
                if not _close(x[r, ..., t - n:, :], y[r, ..., t - n:, :]):
                    return f"layer {i}'s cached {what} differ (the model numbers padded positions otherwise)"
    if not _close(padded.logits[:, -1, :], split[:, -1, :]):
        return "the last position's logits differ"
    if not _close(padded_step.logits[:, -1, :], split_step.logits[:, -1, :]):
        return "a decode step's logits differ after the row-by-row prefill"
    return None


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Within rounding: relative 1e-4 of the larger magnitude in fp32, 2e-2 in 16-bit types."""
    tol = 1e-4 if x.dtype == torch.float32 and y.dtype == torch.float32 else 2e-2
    x, y = x.float(), y.float()
    fin = torch.isfinite(x)
    if not torch.equal(fin, torch.isfinite(y)) or not torch.equal(x[~fin], y[~fin]):
        return False
    scale = max(1.0, float(x[fin].abs().max()) if bool(fin.any()) else 1.0)
    return bool(((x[fin] - y[fin]).abs() <= tol * scale).all())
