"""Pipeline-stage arithmetic and checks (pure; the stages themselves run in test_parity and test_faults)."""

from __future__ import annotations

import pytest
import torch

from mpitp.errors import UsageError
from mpitp.parallel.layout import split_layers
from mpitp.replica.pipeline import check_pp, describe_split, micro_batches


@pytest.mark.parametrize("n,pp", [(n, pp) for n in (1, 2, 5, 8, 31, 32, 80) for pp in (1, 2, 3, 4, 7) if pp <= n])
def test_split_matches_what_transformers_loads(n, pp):
    """Our split (printed by `mpitp info`, used to compact a stage) must be the one transformers loads."""
    from transformers.distributed.pipeline_parallel import PipelineStage

    stage = object.__new__(PipelineStage)  # its rule needs only pp_size; no device mesh here
    stage.pp_size = pp
    assert split_layers(n, pp) == [stage.layer_range_for_rank(r, n) for r in range(pp)]


@pytest.mark.parametrize("b,pp", [(b, pp) for b in (1, 2, 3, 7, 8, 64) for pp in (2, 3, 4)])
def test_micro_batches_cover_the_batch_in_order(b, pp):
    parts = micro_batches(b, pp)
    assert parts[0][0] == 0 and parts[-1][1] == b
    assert all(x[1] == y[0] and x[0] < x[1] for x, y in zip(parts, parts[1:]))
    assert len(parts) == min(b, 2 * pp)  # at least pp pieces whenever the batch has that many rows


@pytest.mark.parametrize("b,t,pp", [(1, 1024, 2), (3, 512, 2), (4, 512, 2), (1, 100, 2), (1, 127, 2), (2, 700, 3),
                                     (8, 64, 4)])
@pytest.mark.parametrize("chunked", [True, False])
def test_stage_pieces_cover_the_batch(b, t, pp, chunked):
    """A batch with rows to spare goes in micro-batches of rows; fewer rows than two per stage go in chunks of
    positions (at least MIN_CHUNK each, up to two per stage) where the model takes them; every piece in order, the
    whole batch covered once."""
    from mpitp.replica.stage_chunks import MIN_CHUNK, pieces

    parts, by_positions = pieces(b, t, pp, chunked)
    expect = chunked and b < 2 * pp and t >= 2 * MIN_CHUNK
    assert by_positions == expect
    covered = torch.zeros(b, t, dtype=torch.int)
    for p in parts:
        covered[p.rows, p.cols] += 1
    assert bool((covered == 1).all())
    if by_positions:
        assert all(p.rows == slice(0, b) for p in parts)
        assert [p.cols.start for p in parts] == sorted(p.cols.start for p in parts)
        assert 2 <= len(parts) <= 2 * pp and all(p.cols.stop - p.cols.start >= MIN_CHUNK for p in parts)
    else:
        assert [(p.rows.start, p.rows.stop) for p in parts] == micro_batches(b, pp)


def test_describe_split():
    assert describe_split(5, 2) == "stage 0: layers 0-2 (3), stage 1: layers 3-4 (2)"


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                       vocab_size=32)


def test_check_pp_spells_out_the_layers():
    check_pp(_config(2), 2)
    check_pp(_config(1), 1)
    with pytest.raises(UsageError,
                       match=r"^pp=3 exceeds the model's 2 decoder layers \(each stage needs at least one\)$"):
        check_pp(_config(2), 3)


def test_check_pp_refuses_models_without_a_pipeline_plan():
    from transformers import GPT2Config

    with pytest.raises(UsageError, match="model type 'gpt2' has no pipeline-parallel plan in transformers; run it "
                                         "with --pp 1"):
        check_pp(GPT2Config(n_layer=4), 2)
