"""mpitp's own tensor-parallel plans (mpitp.replica.tp_plans), checked without MPI: every rule of every plan and
fix-up names something in the class built on the meta device, head counts divide, and what cannot be split is refused
before loading with the arithmetic spelled out. Parity at tp=2 is tests/test_architectures.py's (and
bench/arch_matrix.py's)."""

from __future__ import annotations

import pytest
import torch

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.replica import conv1d_tp, tp_fixups, tp_plans
from mpitp.replica.loading import check_tp
from support import arch as A

VARIANTS = [(mt, i) for mt, variants in tp_plans.PLANS.items() for i in range(len(variants))]
# Options that build the modules a fix-up names only when they are on (StableLM 2's per-head q/k norms)
EVERY_MODULE = {"stablelm": {"qk_layernorm": True}}


def _config(model_type: str, when: dict):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = A.Arch(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], False, False)
    cfg, _ = A.tiny_config(arch, 128, 0)
    for k, v in when.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("model_type,i", VARIANTS, ids=[f"{mt}-{i}" for mt, i in VARIANTS])
def test_every_rule_names_a_module_of_the_class(model_type, i):
    """A rule that matched nothing would leave a layer whole on every rank (transformers only warns) or, for a
    fix-up, leave a head count undivided: each one must name a module (or parameter) of the meta-built class."""
    from transformers import AutoModelForCausalLM

    own = tp_plans.PLANS[model_type][i]
    cfg = _config(model_type, {**EVERY_MODULE.get(model_type, {}), **own.when})
    assert tp_plans.for_config(cfg) is own, "the variant's `when` must select it"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert type(model) is tp_plans.causal_lm_class(cfg)
    modules = {tp_plans._rule(n): m for n, m in model.named_modules()}
    names = set(modules) | {tp_plans._rule(n) for n, _ in model.named_parameters()}
    plan = tp_plans.full_plan(type(model), own)
    assert set(plan) <= names, sorted(set(plan) - names)
    prefix = type(model).base_model_prefix
    for rule, attrs in own.heads.items():
        module = modules[f"{prefix}.{rule}"]
        for attr in tp_fixups.head_attrs(module, attrs):  # a `?` name: where the installed release has it
            n = getattr(module, attr)
            assert isinstance(n, int) and n % 2 == 0, (rule, attr, n)
    for rule, parts in own.fused_heads.items():  # loaded whole, cut by hand: no plan rule may shard it too
        for linear, heads in parts.items():
            assert f"{prefix}.{rule}.{linear}" in modules and f"{prefix}.{rule}.{linear}" not in plan
            assert all(isinstance(getattr(modules[f"{prefix}.{rule}"], h), int) for h in heads)
    for rules in (own.head_lists, own.alibi, own.mqa_rows, own.own_rows, own.fused_heads):
        assert {f"{prefix}.{r}" for r in rules} <= set(modules), sorted(rules)
    for rule, attrs in own.own_rows.items():  # loaded whole, cut by hand: each a parameter no rule shards too
        for attr in attrs:
            assert isinstance(getattr(modules[f"{prefix}.{rule}"], attr), torch.nn.Parameter), (rule, attr)
            assert f"{prefix}.{rule}.{attr}" not in plan
    for rule, attr in own.head_lists.items():
        assert isinstance(getattr(modules[f"{prefix}.{rule}"], attr), torch.nn.ModuleList)
    for rule in own.mqa_rows:  # loaded whole, cut by hand: no plan rule may shard it too
        assert f"{prefix}.{rule}" not in plan
    assert all(style in _styles() for style in plan.values())


def _styles():
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    tp_plans._register_styles()
    return ALL_PARALLEL_STYLES


def test_a_head_count_tp_does_not_divide_is_refused_with_the_arithmetic():
    cfg = _config("stablelm", {})
    cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads = 80, 5, 5
    with pytest.raises(UsageError, match=r"^stablelm: 5 attention heads are not divisible by --tp 2$"):
        check_tp(cfg, 2)
    cfg = _config("stablelm", {})
    cfg.num_key_value_heads = 1
    with pytest.raises(UsageError, match=r"^stablelm: 1 key/value heads are not divisible by --tp 2$"):
        check_tp(cfg, 2)
    check_tp(_config("stablelm", {}), 2)  # 4 heads, 2 key/value heads


def test_what_the_split_cannot_reproduce_is_refused():
    cfg = _config("bloom", {})
    cfg.slow_but_exact, cfg.pretraining_tp = True, 2
    with pytest.raises(UsageError, match="bloom: slow_but_exact .* run it with --tp 1"):
        check_tp(cfg, 2)


def test_quantized_bitnet_is_refused_at_tp_above_1():
    """BitNet's released checkpoints carry a quantization_config (packed ternary weights): the split is checked on
    its unquantized form only."""
    cfg = _config("bitnet", {})
    check_tp(cfg, 2)
    cfg.quantization_config = {"quant_method": "bitnet", "linear_class": "autobitlinear"}
    with pytest.raises(UsageError, match="bitnet: its quantized weights are packed .* run it with --tp 1"):
        check_tp(cfg, 2)
    check_tp(cfg, 1)


@pytest.mark.parametrize("model_type", ["trocr", "bert-generation"])
def test_types_with_neither_plan_are_refused_as_before(model_type):
    from transformers import AutoConfig

    with pytest.raises(UsageError, match=f"model type '{model_type}' has no tensor-parallel plan in transformers; "
                                         f"run it with --tp 1"):
        check_tp(AutoConfig.for_model(model_type), 2)


def test_transformers_plan_and_remote_code_take_no_own_plan():
    from transformers import AutoConfig

    assert tp_plans.for_config(AutoConfig.for_model("llama")) is None
    for model_type in tp_plans.PLANS:  # a transformers that ships a plan for one of them: its own is used
        assert not AutoConfig.for_model(model_type).base_model_tp_plan, model_type
    cfg = AutoConfig.for_model("mpt")
    cfg.auto_map = {"AutoModelForCausalLM": "modeling_mpt.MPTForCausalLM"}  # MosaicML's own code: other names
    assert tp_plans.for_config(cfg) is None
    with pytest.raises(UsageError, match="no tensor-parallel plan"):
        check_tp(cfg, 2)


def test_alibi_slice_is_the_ranks_heads_of_every_sequence():
    heads, b, k = 4, 3, 5
    bias = torch.arange(b * heads * k, dtype=torch.float32).reshape(b * heads, 1, k)  # BLOOM/Falcon: [b * H, 1, k]
    _, kw = tp_fixups._AlibiSlice(("alibi",), heads, 2, 1)(None, (), {"alibi": bias})
    assert torch.equal(kw["alibi"], bias.reshape(b, heads, 1, k)[:, 2:4].reshape(b * 2, 1, k))
    mpt = torch.arange(heads * k, dtype=torch.float32).reshape(heads, 1, k)  # MPT: [H, 1, max_seq_len]
    _, kw = tp_fixups._AlibiSlice(("position_bias",), heads, 2, 0)(None, (), {"position_bias": mpt})
    assert torch.equal(kw["position_bias"], mpt[:2])
    falcon = bias.reshape(b, heads, 1, k)  # Falcon: [b, H, 1, k], and the mask it bakes the bias into [b, H, q, k]
    mask, plain = torch.randn(b, heads, 3, k), torch.randn(b, 1, 3, k)
    hook = tp_fixups._AlibiSlice(("alibi", "attention_mask"), heads, 2, 1)
    _, kw = hook(None, (), {"alibi": falcon, "attention_mask": mask})
    assert torch.equal(kw["alibi"], falcon[:, 2:]) and torch.equal(kw["attention_mask"], mask[:, 2:])
    _, kw = hook(None, (), {"alibi": falcon, "attention_mask": plain})
    assert kw["attention_mask"] is plain  # one head: broadcast over every head, left as it is
    assert hook(None, (), {"alibi": None, "attention_mask": None}) is None


def test_mqa_rows_keep_the_ranks_queries_and_the_shared_key_value():
    q, d = 8, 2
    lin = torch.nn.Linear(4, q + 2 * d)
    w, bias = lin.weight.detach().clone(), lin.bias.detach().clone()
    tp_fixups._keep_mqa_rows(lin, q, 2, 1)
    rows = list(range(4, 8)) + list(range(8, 12))
    assert torch.equal(lin.weight, w[rows]) and torch.equal(lin.bias, bias[rows]) and lin.out_features == 8


@pytest.mark.parametrize("model_type", ["bert-generation", "bert", "roberta", "reformer"])
def test_a_decoder_only_with_is_decoder_is_refused_without_it(model_type):
    """BERT-generation, BERT, RoBERTa ... as causal LMs attend both ways unless their config says is_decoder (their
    class's __init__ tests it and only warns): refused before the load, and accepted once the config says it."""
    from transformers import AutoConfig

    from mpitp.replica.loading import check_decoder_mode

    cfg = AutoConfig.for_model(model_type)
    with pytest.raises(UsageError, match=f"model type '{model_type}': .* \"is_decoder\": true"):
        check_decoder_mode(cfg)
    cfg.is_decoder = True
    check_decoder_mode(cfg)
    for fine in ("llama", "gpt2", "bart"):  # decoders by construction (BART's causal LM sets the flag itself)
        check_decoder_mode(AutoConfig.for_model(fine))


@pytest.mark.parametrize("style_name", [conv1d_tp.COLWISE, conv1d_tp.PACKED_QKV, conv1d_tp.ROWWISE])
def test_conv1d_styles_take_the_calls_of_the_installed_transformers(style_name, gloo_world):
    """Each ``Conv1D`` style, called the way the installed transformers' ``apply_tensor_parallelism`` calls its own
    (the keyword context its base class declares: ``config=``/``mesh_manager=`` since 5.25), shards a real ``Conv1D``
    over a one-rank mesh and computes what the unsharded layer computes. The keywords are read from the installed
    base class, so a release that adds one fails here in seconds rather than in the tp2 matrix."""
    import inspect

    from torch.distributed.device_mesh import init_device_mesh
    from transformers.pytorch_utils import Conv1D

    base = compat.attribute("transformers.distributed.tensor_parallel.TensorParallelLayer")

    def context(method) -> dict:
        params = inspect.signature(getattr(base, method)).parameters.values()
        return {p.name: None for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}

    torch.manual_seed(0)
    ref = Conv1D(12, 8)
    layer = Conv1D(12, 8)
    layer.load_state_dict(ref.state_dict())
    style = conv1d_tp.styles()[style_name]
    mesh = init_device_mesh("cpu", (1,))
    for param in ("weight", "bias"):
        style.shard_param(layer, param, mesh, **context("shard_param"))
    style.install_forward(layer, mesh, **context("install_forward"))
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=1e-6)


# Per type: parameters of layer 0 and the placement mpitp.replica.channel_tp's styles must give them
_CHANNEL_PLACED = {
    "mamba": {"backbone.layers.0.mixer.A_log": ("Shard", 0), "backbone.layers.0.mixer.conv1d.weight": ("Shard", 0),
              "backbone.layers.0.mixer.in_proj.bias": ("_StridedShard", 0)},
    "falcon_mamba": {"backbone.layers.0.mixer.D": ("Shard", 0), "backbone.layers.0.mixer.dt_proj.weight": ("Shard", 0)},
    "dbrx": {"transformer.blocks.0.ffn.experts.mlp.w1": ("_StridedShard", 0),
             "transformer.blocks.0.ffn.experts.mlp.w2": ("_StridedShard", 0)},
    "ctrl": {"transformer.h.0.ffn.0.weight": ("Shard", 0), "transformer.h.0.ffn.0.bias": ("Shard", 0),
             "transformer.h.0.ffn.2.weight": ("Shard", 1)},
    "bitnet": {"model.layers.0.self_attn.attn_sub_norm.weight": ("Shard", 0),
               "model.layers.0.mlp.ffn_sub_norm.weight": ("Shard", 0)},
    "jetmoe": {"model.layers.0.self_attention.experts.input_linear.weight": ("Shard", 1),
               "model.layers.0.self_attention.experts.output_linear.weight": ("Shard", 2),
               "model.layers.0.mlp.input_linear.weight": ("_StridedShard", 1)},
}


@pytest.mark.parametrize("model_type", sorted(_CHANNEL_PLACED))
def test_channel_split_runs_a_real_model_with_the_installed_transformers(model_type, gloo_world):
    """The plans that use :mod:`mpitp.replica.channel_tp`'s styles (a state-space mixer: ``in_proj`` packed with its
    bias strided, ``conv1d``/``dt_proj`` by rows, the mixer's forward on local shards; DBRX: every expert's rows
    strided, the experts' forward on local shards and summed; JetMoE: experts' weights split along their second or
    third dimension; CTRL: its ``Sequential`` MLP split as a whole; BitNet: RMS norms over a split width), applied to a
    real model the way the installed transformers applies a plan (``apply_tensor_parallelism`` over a one-rank mesh):
    the parameters become DTensors with the declared placement, and the model computes what the unsharded one does.
    Parity at tp=2 is the matrix's (a contiguous bias split was 0.03 off there)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    cfg = _config(model_type, {})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ref.load_state_dict(model.state_dict())
    own = tp_plans.for_config(cfg)
    tp_plans._register_styles()
    mesh = init_device_mesh("cpu", (1,))
    model._mesh_manager = None
    apply_tensor_parallelism(model, mesh, model._expand_parallel_plan(tp_plans.full_plan(type(model), own)))
    params = dict(model.named_parameters())
    for name, (placement, dim) in _CHANNEL_PLACED[model_type].items():
        assert isinstance(params[name], DTensor), name
        assert type(params[name].placements[0]).__name__ == placement and params[name].placements[0].dim == dim, name
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits,
                                   rtol=0, atol=1e-5)
