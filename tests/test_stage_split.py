"""What the registry-wide matrix found about transformers' parallel plans, held without MPI (the meta device): the
types whose plan cannot compute at a layout are refused before loading with the reason, and a final norm of another
name than ``norm`` is taken off the stages before the last (GPT-NeoX and Phi scored wrong at pp=2 before)."""

from __future__ import annotations

import pytest
import torch

from mpitp.errors import UsageError
from mpitp.replica.loading import check_tp
from mpitp.replica.pipeline import check_plans_apply, plan_sides
from support import arch as A


def _config(model_type: str):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg, _ = A.tiny_config(A.Arch(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], True, True), 128, 0)
    return cfg


@pytest.mark.parametrize("model_type,line", [
    ("codegen", "pipeline split reads the decoder's 'layers', which CodeGenModel calls 'h'"),
    ("deepseek_v4", "does not place on a stage (hc_head)"),
    ("olmo_hybrid", "--pp 2 gives stage 0 layers 0-0 (linear_attention) and no attention layer"),
])
def test_pipeline_split_refused_before_loading(model_type, line):
    with pytest.raises(UsageError, match=line.replace("(", r"\(").replace(")", r"\)")):
        check_plans_apply(_config(model_type), 1, 2)


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", "phi", "qwen3_next"])
def test_pipeline_split_accepted(model_type):
    """Accepted: the layer list is ``layers`` and every module with weights is in the PP plan (a hybrid built with
    each kind twice holds an attention layer on each of two stages)."""
    check_plans_apply(_config(model_type), 1, 2)


@pytest.mark.parametrize("model_type,after", [("gpt_neox", ["final_layer_norm"]), ("phi", ["final_layernorm"]),
                                              ("llama", ["norm"])])
def test_final_norm_found_by_the_plan_name(model_type, after):
    """:func:`mpitp.replica.pipeline.compact` takes these off every stage before the last: transformers' split only
    replaces a module called ``norm``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(model_type))
    assert plan_sides(model.base_model)[1] == after


@pytest.mark.parametrize("model_type", ["doge", "inkling_text", "sarvam_moe", "param2moe"])
def test_broken_upstream_tp_plans_refused_by_type(model_type):
    """By hand (doge, inkling_text) or by rule (sarvam_moe, param2moe: a checkpoint conversion that ``Split``s a fused
    tensor into sharded projections; lara_mini's ``Split`` feeds projections its plan does not shard, and it passes
    the tp2 matrix, so it must not be refused)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not registered in this transformers (param2moe: from 5.25)")
    with pytest.raises(UsageError, match=f"model type '{model_type}': transformers' tensor-parallel plan fails at "
                                         f"--tp 2: .*; run it with --tp 1"):
        check_tp(_config(model_type), 2)
    check_tp(_config(model_type), 1)


def test_a_split_of_unsharded_projections_is_not_refused():
    check_tp(_config("lara_mini"), 2)
