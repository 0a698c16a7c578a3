"""Position chunks through pipeline stages (mpitp.replica.stage_chunks) without MPI: the probe's verdict on one
stage's layers. The chunks themselves run in test_parity.py (stories260K, pp2 layouts) and test_architectures.py
(every type with a pipeline plan, its short rows cut into chunks by ``MPITP_TEST_STAGE_CHUNK``)."""

from __future__ import annotations

import pytest

from mpitp.replica import stage_chunks
from support import arch as A


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("stage", [0, 1])
def test_stages_that_take_chunks_say_so(model_type, stage):
    """Stage 0 (from ids) and a later stage (from activations) of models whose forward continues over a cache."""
    shard = A.tiny_shard(model_type, stage=stage)
    assert stage_chunks.check_chunking(shard, timeout=30) is None
    assert shard.chunked and shard.min_chunk == stage_chunks.MIN_CHUNK


def test_a_window_the_probe_cannot_see_keeps_whole_rows():
    shard = A.tiny_shard("mistral", stage=1)
    why = stage_chunks.check_chunking(shard, timeout=30)
    assert why is not None and "sliding-window" in why, why
    assert not shard.chunked


def test_a_forward_that_drops_the_cache_is_caught():
    """The verdict comes from numbers: a stage whose forward computes each chunk as if nothing came before it (what
    a model that ignores the cache it is handed does) differs from the whole rows on the probe."""
    shard = A.tiny_shard("llama", stage=1)
    forward = shard.base.forward

    def without_past(*args, cache=None, **kwargs):
        return forward(*args, cache=None, **kwargs)

    shard.base.forward = without_past
    why = stage_chunks.check_chunking(shard, timeout=30)
    assert why is not None and "differ" in why, why
    assert not shard.chunked


def _whole(parts: list[dict], kw: dict) -> bool:
    return len(parts) == 1 and parts[0] is kw


def test_a_prompt_goes_through_in_chunks_a_decode_step_whole():
    """A prefill's arguments cut into chunks of positions: each chunk its ids and position ids, and the mask of every
    position up to its end (a left-padded prompt's padding included); a decode step, a short prompt, or arguments
    this cannot cut stay one forward."""
    import torch

    ids = torch.arange(2 * 300).view(2, 300)
    mask = torch.ones(2, 300, dtype=torch.long)
    mask[1, :40] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=pos, cache=object(), use_cache=True)
    parts = stage_chunks.prefill_chunks(kw, pp=2)
    assert len(parts) == 4
    ends = [p["attention_mask"].shape[1] for p in parts]
    assert ends == [75, 150, 225, 300]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), ids)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), pos)
    assert all(torch.equal(p["attention_mask"], mask[:, : p["attention_mask"].shape[1]]) for p in parts)
    assert all(p["cache"] is kw["cache"] and p["use_cache"] for p in parts)
    step = dict(kw, input_ids=ids[:, -1:], attention_mask=torch.ones(2, 301), position_ids=pos[:, -1:] + 1)
    assert _whole(stage_chunks.prefill_chunks(step, pp=2), step)  # a decode step: one position, the mask longer
    short = dict(kw, input_ids=ids[:, :100], attention_mask=mask[:, :100], position_ids=pos[:, :100])
    assert _whole(stage_chunks.prefill_chunks(short, pp=2), short)  # under two chunks of MIN_CHUNK
    for odd in (dict(kw, position_ids=pos.unsqueeze(0).expand(3, 2, 300)), dict(kw, token_type_ids=ids * 0),
                dict(kw, use_cache=False), {k: v for k, v in kw.items() if k != "use_cache"}):
        assert _whole(stage_chunks.prefill_chunks(odd, pp=2), odd)
