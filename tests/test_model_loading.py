"""mpitp.replica.loading's TP checkpoint reads: strided shards through safetensors' pread, contiguous reads from the
mapping."""

import pytest
import torch
from safetensors.torch import save_file

from mpitp.replica.loading import _one_byte_range, strided_shards_with_pread


@pytest.fixture()
def checkpoint(tmp_path):
    tensors = {"w": torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10), "b": torch.arange(4.0)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(path), tensors


@pytest.mark.parametrize("index,expected", [
    (Ellipsis, True),
    (slice(1, 3), True),
    ((slice(1, 3), slice(0, 10)), True),
    ((slice(2, 4), slice(None)), True),
    ((slice(0, 6), slice(0, 5)), False),
    ((slice(0, 6), slice(5, 10)), False),
    ((slice(0, 6, 2), slice(0, 10)), False),
    ((1, slice(0, 10)), False),
    ((slice(0, 6), slice(0, 10), slice(0, 1)), False),
])
def test_one_byte_range(index, expected):
    assert _one_byte_range(index, [6, 10]) is expected


def test_reads_match_and_strided_ones_use_pread(checkpoint):
    import transformers.modeling_utils as mu

    path, tensors = checkpoint
    original = mu.safe_open
    with strided_shards_with_pread():
        assert mu.safe_open is not original
        with mu.safe_open(path, framework="pt", device="cpu", backend="mmap") as f:
            assert sorted(f.keys()) == ["b", "w"]
            assert f.metadata() == {"format": "pt"}
            w = f.get_slice("w")
            assert w.get_shape() == [6, 10] and w.get_dtype() == "F32"
            assert torch.equal(w[...], tensors["w"])
            assert torch.equal(w[2:4, 0:10], tensors["w"][2:4])
            assert torch.equal(f.get_slice("b")[...], tensors["b"])
            right = w[0:6, 5:10]
            assert torch.equal(right, tensors["w"][:, 5:10])
            assert right.is_contiguous()  # read with pread; a view of the mapping would be strided
            assert torch.equal(f.get_tensor("w"), tensors["w"])
    assert mu.safe_open is original


def test_restored_after_an_error():
    import transformers.modeling_utils as mu

    original = mu.safe_open
    with pytest.raises(RuntimeError, match="boom"):
        with strided_shards_with_pread():
            raise RuntimeError("boom")
    assert mu.safe_open is original


def test_a_class_whose_plans_match_nothing_is_refused_before_loading_and_its_decoder_found():
    """Issue 40: ``Llama4ForCausalLM`` names ``language_model`` as its ``base_model_prefix`` but keeps its decoder
    under ``model``: transformers' TP/PP plans (applied under the prefix) split none of its layers, and its
    ``base_model`` is the whole model (the head check got a ``MoeCausalLMOutputWithPast``: a traceback after loading).
    Refused before loading at pp > 1 in one line, and at tp > 1 where transformers' TP rules reach none of its layers
    (5.24; 5.25 also writes them under ``model``, so they split it); its decoder is found for tp=1. Llama passes
    both."""
    from transformers import AutoModelForCausalLM, Llama4TextConfig, LlamaConfig

    from mpitp.errors import UsageError
    from mpitp.replica.pipeline import base_model, check_plans_apply

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    llama4 = Llama4TextConfig(**small, intermediate_size_mlp=64, num_local_experts=2)
    with torch.device("meta"):
        rules = AutoModelForCausalLM.from_config(llama4).tp_plan
    tp_splits = any(rule.startswith("model.layers.") for rule in rules)  # what the installed release writes
    for tp, pp, layout in ((2, 1, "--tp 2"), (1, 2, "--pp 2"), (2, 2, "--tp 2 --pp 2")):
        if tp_splits and pp == 1:
            check_plans_apply(llama4, tp, pp)
            continue
        with pytest.raises(UsageError) as exc:
            check_plans_apply(llama4, tp, pp)
        if pp == 1 or not tp_splits:
            assert str(exc.value).startswith(
                "model type 'llama4_text': transformers' tensor-parallel plan for Llama4ForCausalLM reaches none of "
                "its layers (its rules: "), str(exc.value)
            assert str(exc.value).endswith(f"so --tp {tp} would hold every layer whole on each rank; run it with "
                                           f"--tp 1 (data parallel: more ranks)")
        else:
            assert str(exc.value) == (
                f"model type 'llama4_text': transformers' parallel plans for Llama4ForCausalLM apply under "
                f"'language_model', which it does not have, so {layout} would not split its layers; run it with "
                f"--tp 1 --pp 1 (data parallel: more ranks)")
    check_plans_apply(llama4, 1, 1)
    check_plans_apply(LlamaConfig(**small), 2, 2)
    with torch.device("meta"):
        m4, m = AutoModelForCausalLM.from_config(llama4), AutoModelForCausalLM.from_config(LlamaConfig(**small))
    assert m4.base_model is m4 and base_model(m4) is m4.model
    assert base_model(m) is m.model is m.base_model


def test_a_waiting_rank_warms_a_local_models_class_silently_and_nothing_else(tmp_path):
    """Issue 41: a rank that waits for rank 0's checks on a spare core imports the model's class and builds it once
    (``warm_model_code``), so its load no longer holds rank 0 at the barrier. Not for a path without a config, a
    config with remote code (``auto_map``) or one transformers cannot read; none of these raises or prints. In a new
    interpreter: this one has imported Llama's module already."""
    import json
    import subprocess
    import sys

    from support import STORIES

    config = json.loads((STORIES / "config.json").read_text())
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    module = "transformers.models.llama.modeling_llama"
    script = (f"import sys; from mpitp.replica.loading import warm_model_code\n"
              f"for path in {[str(tmp_path / n) for n in ('absent', 'remote', 'broken')]!r}:\n"
              f"    warm_model_code(path)\n"
              f"    assert {module!r} not in sys.modules, path\n"
              f"warm_model_code({str(STORIES)!r})\n"
              f"assert {module!r} in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == done.stderr == ""
