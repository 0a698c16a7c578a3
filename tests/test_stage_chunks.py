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
