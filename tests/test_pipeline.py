"""Pipeline stages: their arithmetic and checks (pure), and the LM head spread over them (one launch; the stages
themselves run in test_parity and test_faults)."""

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


@pytest.mark.mpi
def test_spread_head_samples_as_one_rank(test_tasks, tmp_path):
    """The LM head spread over the stages (mpitp.replica.stage_head): with TP inside the stages the ranks' vocabulary
    slices are not in rank order, and sampling gathers the whole distribution, so a wrong order would draw other
    tokens. Seeded sampling at tp=2 x pp=2 must draw what one rank draws (greedy parity is test_parity's)."""
    import h5py

    from support import STORIES
    from support.mpi import explain, run_mpi

    gens = {}
    for n, extra in ((1, []), (4, ["--tp", "2", "--pp", "2"])):
        out = tmp_path / f"{n}.h5"
        proc = run_mpi(n, ["eval", "--model", str(STORIES), "--tasks", "gsm8k_local", "--include-path", test_tasks,
                           "--limit", "4", "--batch-size", "2", "--seed", "7", "--dtype", "float32", "--output",
                           str(out), "--gen-kwargs", "max_gen_toks=12,do_sample=True,temperature=1.0", *extra])
        assert proc.returncode == 0, explain(proc)
        assert ("pipeline head: spread over the stages" in proc.stdout) == (n == 4), explain(proc)
        with h5py.File(out, "r") as f:
            gens[n] = [g.decode() for g in f["tasks/gsm8k_local/requests/generation"][...]]
    assert len(gens[1]) == 4 and all(gens[1]), gens
    assert gens[4] == gens[1]
