"""A left-padded prefill computed row by row (mpitp.replica.ragged_prefill): HF ``generate`` gives the same tokens and
logits as with its padded prefill, the probe refuses a forward that treats the rows otherwise, and only a prefill
this module can split is split. One process, a tiny random Llama; under TP the parity is held by
``tests/test_parity.py``'s padded generation task (the leader and its workers split alike)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from mpitp.replica.generation import GenerationState, GrowingCache
from mpitp.replica.scoring import CommCounter
from mpitp.testing import RAGGED_ROWS as ROWS_ATTR
from support import tiny_llama

LENGTHS = [9, 5, 9, 2]  # real tokens per row: rows 0 and 2 go together, the others alone


def _model(seed: int = 0):
    return tiny_llama(seed)


def _batch():
    torch.manual_seed(3)
    t = max(LENGTHS)
    ids = torch.randint(1, 97, (len(LENGTHS), t))
    mask = torch.stack([torch.arange(t) >= t - n for n in LENGTHS]).long()
    return ids.masked_fill(mask == 0, 0), mask  # left padding with the pad id, as lm-eval's tok_batch_encode pads


def _generate(model, wrap=None):
    """Greedy ``generate`` of :func:`_batch` with a GrowingCache, its forward taken through GenerationState.forward
    (as the leader's mirrored forward does) unless ``wrap`` is False; returns (output, state, prefill outputs)."""
    ids, mask = _batch()
    shard = SimpleNamespace(model=model, ops=SimpleNamespace(reduce_counter=CommCounter()), pipeline=False,
                            device=torch.device("cpu"), layout=SimpleNamespace(replica_comm=None))
    gen = GenerationState(shard)
    gen.begin(greedy=False, reserve=12)
    original, outs = model.forward, []
    call = wrap(original) if wrap else original

    @functools.wraps(original)  # generate checks its arguments against the forward's signature
    def forward(**kwargs):
        out = gen.forward(call, kwargs)
        outs.append(out)
        return out

    model.forward = forward
    try:
        with torch.no_grad():
            res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                                 cache=GrowingCache(model.config, reserve=12))
    finally:
        del model.forward
        gen.end()
    return res, gen, outs


def _reference(model):
    ids, mask = _batch()
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)


def test_rows_give_the_padded_prefills_tokens_and_logits():
    model = _model()
    ref = _reference(model)
    got, gen, outs = _generate(model)
    assert gen.ragged.verdict is True, gen.ragged.why
    assert torch.equal(got.sequences, ref.sequences)
    worst = max(float((a - b).abs().max()) for a, b in zip(got.scores, ref.scores))
    assert worst <= 1e-5, worst
    # the prefill went as three forwards of the rows' own lengths (pads ascending), the decode steps as before
    assert getattr(outs[0], ROWS_ATTR) == [(2, 9, 0), (1, 5, 4), (1, 2, 7)]
    assert all(getattr(o, ROWS_ATTR, None) is None for o in outs[1:]) and len(outs) == 12


def test_probe_refuses_a_forward_that_treats_unpadded_rows_otherwise():
    """A forward whose unpadded rows see other positions (a model that numbers them its own way): the probe's caches
    differ, the verdict is no, and generate keeps its padded prefill, with the reference's tokens."""
    model = _model()
    ref = _reference(model)

    def shifted(call):
        def f(**kw):
            if "position_ids" in kw and bool((kw["attention_mask"] == 1).all()) and kw["input_ids"].shape[1] > 1:
                kw = {**kw, "position_ids": kw["position_ids"] + 1}
            return call(**kw)
        return f

    got, gen, outs = _generate(model, wrap=shifted)
    assert gen.ragged.verdict is False and "differ" in gen.ragged.why, gen.ragged.why
    assert torch.equal(got.sequences, ref.sequences)
    assert all(getattr(o, ROWS_ATTR, None) is None for o in outs)


@pytest.mark.parametrize("case", ["right", "none", "one_row", "other_kwarg", "plain_cache", "decode"])
def test_only_a_left_padded_prefill_into_an_empty_growing_cache_is_split(case):
    from transformers import DynamicCache

    from mpitp.replica.ragged_prefill import _left_pads

    model = _model()
    ids, mask = _batch()
    gen = SimpleNamespace(shard=SimpleNamespace(model=model))
    cache = GrowingCache(model.config, reserve=4)
    kw = dict(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    assert _left_pads(kw, gen).tolist() == [max(LENGTHS) - n for n in LENGTHS]
    if case == "right":
        kw["attention_mask"] = mask.flip(1)
    elif case == "none":
        kw["attention_mask"] = torch.ones_like(mask)
    elif case == "one_row":
        kw = {**kw, "input_ids": ids[:1], "attention_mask": mask[:1]}
    elif case == "other_kwarg":
        kw["token_type_ids"] = torch.zeros_like(ids)
    elif case == "plain_cache":
        kw["cache"] = DynamicCache(config=model.config)
    else:
        with torch.no_grad():
            model(**kw)  # the cache holds a prompt: the next forward is a decode step
    assert _left_pads(kw, gen) is None
