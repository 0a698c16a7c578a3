"""mpitp's own tensor-parallel plans, for families people still evaluate that transformers ships none for.

transformers 5.25 gives no ``base_model_tp_plan`` to StableLM, GPT-Neo, OPT, Persimmon, BLOOM, MPT, StarCoder 1
(``gpt_bigcode``), Falcon, GPT-2, OpenAI GPT, GPT-NeoX-Japanese, BioGPT, Mamba, Falcon-Mamba, RWKV, DBRX, JetMoE, CTRL,
BitNet or ModernBERT-decoder, so ``--tp 2`` was refused for them. Each plan below is written in transformers' own
vocabulary (``colwise``, ``rowwise``, ``embedding_rowwise`` ...) with names under the base model, as a config's
``base_model_tp_plan`` is, and handed to transformers as the ``tp_plan`` of its ``DistributedConfig``
(:func:`distributed_config`): transformers shards every weight as it reads it, exactly as for a model with a plan of
its own. A plan is only picked where transformers has none, for transformers' own classes (remote code is refused as
before: its module names are its own), and only where the split is exact: every rank computes its own heads, and the
one sum across ranks (``rowwise``) is the sum a single process computes, in another order.

What a family needs beyond the plan is declared next to it, as data, and applied after loading
(:func:`mpitp.replica.tp_fixups.fix_up`):

- ``heads``: attributes that hold a head count (or a width derived from it) a module's forward reshapes with
  (StableLM's ``num_heads``, GPT-Neo's, BLOOM's ...): after a ``colwise`` split each rank holds ``1/tp`` of them;
  a name ending in ``?`` is divided where the module has it (one a transformers release added: 5.25's Falcon keeps
  ``num_key_value_groups`` for transformers' shared attention functions, 5.24's computed its attention itself);
- ``head_lists``: per-head module lists (StableLM's per-head ``q_layernorm``): each rank keeps its own heads' entries
  (``zip`` over a full list would silently pair rank 1's heads with rank 0's norms);
- ``alibi``: forward keywords carrying an ALiBi bias for *every* head (BLOOM's ``alibi``, MPT's ``position_bias``,
  Falcon's ``alibi``), built by the base model from the full head count: each rank's attention gets its heads' slice;
- ``mqa_rows``: a fused ``[q | k | v]`` projection with one shared key/value head (StarCoder 1's ``c_attn``,
  Falcon-7B's ``query_key_value``): no DTensor placement says "shard q, replicate k and v", so it loads whole and each
  rank keeps its query heads' rows and the shared rows;
- ``divides``: the config counts ``--tp`` must divide, checked before loading with the arithmetic spelled out;
- ``refuse``: config values the split cannot reproduce (BLOOM's ``slow_but_exact`` re-slices the whole weight);
- ``fused_heads``: a fused ``[q | k | v]`` projection of unequal parts (DBRX's ``Wqkv`` with fewer key/value heads
  than query heads), named by the module's head-count attributes of each part: no DTensor placement cuts unequal
  parts, so it loads whole and each rank keeps its ``1/tp`` of every part's heads (read before ``heads`` divides
  them);
- ``sum_after``: ``(method, bias)`` of a module whose method ends in partial products and then adds a bias (JetMoE's
  mixture of attention ``reduce`` and its MLP's ``forward``, both ``... .index_add(...) + self.bias``): the method
  runs with the bias at zero, its output is summed over the group, the bias added once after (a ``rowwise`` split
  of a method, not of a linear layer);
- ``own_rows``: per-channel parameters loaded whole, of which each rank then keeps its ``1/tp`` rows (RWKV's
  ``time_decay``/``time_first``: transformers' weight init computes with them and plain tensors during the load, so
  they cannot be sharded DTensors then);
- ``split_state``: which entries of a recurrent ``state`` list (RWKV's five ``[batch, width, layers]`` tensors) hold
  per-channel attention state: the base model allocates all five at the config's full width, so a pre-hook on it
  allocates them first, those entries at ``1/tp`` of it (the others, the previous token's hidden state, stay whole).

GPT-2 and OpenAI GPT store their projections as ``Conv1D`` (the weight transposed): they are split by mpitp's
``Conv1D`` styles (:mod:`mpitp.replica.conv1d_tp`), registered next to transformers' own. GPT-NeoX-Japanese and
BioGPT name their LM head ``embed_out`` and ``output_projection`` (``head``). Mamba and Falcon-Mamba have no heads:
their mixers are split by inner channel with the styles of :mod:`mpitp.replica.channel_tp` (the channels are
independent from ``in_proj`` to ``out_proj`` except in ``x_proj``, whose partial products are summed), their caches
sized lazily from the rank's own tensors. RWKV is split the same way (its WKV recurrence is per channel), its
recurrent state allocated at the rank's width (``split_state``). DBRX's experts live in three ``[experts * ffn,
hidden]`` parameters: each rank keeps every expert's ``1/tp`` of the ``ffn`` rows and the experts' output is summed
over the group (:mod:`mpitp.replica.channel_tp`), and its ``Wqkv`` has unequal parts (``fused_heads``).

JetMoE's mixture of attention routes each token to attention experts that project to the key/value heads' width:
split by those heads, every expert keeping its rows for them, and the experts' output (and its MLP experts' output)
summed before the bias (``sum_after``).

CTRL's MLP is an ``nn.Sequential`` whose children are named ``0`` and ``2`` (transformers reads every number in a
rule's name as a layer index, so no rule can tell them apart): one style splits the ``Sequential`` as a whole.

BitNet puts an RMS norm over the whole attention output and the whole MLP width between its column- and row-split
projections, where a rank holds a part of that width: the sum of squares is added over the group. Its released
checkpoints are quantized (packed ternary weights): refused at tp > 1 until that split is checked.

ModernBERT-decoder projects to the vocabulary with ``decoder`` after a prediction head (dense, activation, norm) that
stays whole on every rank.

Families left out, and why (they stay refused with "run it with --tp 1"): Ergo (new in 5.25: experts with their own
norms and a residual gate; not yet planned), TrOCR and BERT-generation (decoders of encoder-decoder pairs, evaluated
with their encoder, not as language models).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.replica import channel_tp, conv1d_tp

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel
    from transformers.distributed import DistributedConfig

#: transformers' fused-projection style with three parts (q, k, v) instead of its default two, the bias split alike.
PACKED_QKV = channel_tp.PACKED_3
_STYLES = "transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES"

_ATTN = ("num_attention_heads", "attention heads")


class _Set:
    """A ``refuse`` value that any value but None equals: the option is set at all."""

    def __eq__(self, other) -> bool:
        return other is not None

    __hash__ = None


SET = _Set()


@dataclass(frozen=True)
class OwnPlan:
    """One family's plan and fix-ups (see the module docstring). ``when``: config values this variant is for."""

    plan: dict[str, str]
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    head_lists: dict[str, str] = field(default_factory=dict)
    alibi: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mqa_rows: dict[str, str] = field(default_factory=dict)
    divides: tuple[tuple[str, str], ...] = (_ATTN,)
    refuse: tuple[tuple[str, object, str], ...] = ()
    when: dict[str, object] = field(default_factory=dict)
    head: str = "lm_head"
    split_state: tuple[int, ...] = ()
    own_rows: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fused_heads: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    sum_after: dict[str, tuple[str, str]] = field(default_factory=dict)


def _mlp(layers: str, up: tuple[str, ...], down: str) -> dict[str, str]:
    return {**{f"{layers}.{m}": "colwise" for m in up}, f"{layers}.{down}": "rowwise"}


def _attn(attn: str, qkv: tuple[str, ...], out: str, style: str = "colwise") -> dict[str, str]:
    return {**{f"{attn}.{m}": style for m in qkv}, f"{attn}.{out}": "rowwise"}


_BIGCODE = {"wte": "embedding_rowwise", **_mlp("h.*.mlp", ("c_fc",), "c_proj"), "h.*.attn.c_proj": "rowwise"}
_FALCON = {"word_embeddings": "embedding_rowwise",
           **_mlp("h.*.mlp", ("dense_h_to_4h",), "dense_4h_to_h"), "h.*.self_attention.dense": "rowwise"}
# Falcon bakes the bias into the mask too ([batch, heads, q, k] where ALiBi is on, [batch, 1, q, k] where not)
_FALCON_ALIBI = {"h.*.self_attention": ("alibi", "attention_mask")}

_CONV1D = {"h.*.attn.c_attn": conv1d_tp.PACKED_QKV, "h.*.attn.c_proj": conv1d_tp.ROWWISE,
           "h.*.mlp.c_fc": conv1d_tp.COLWISE, "h.*.mlp.c_proj": conv1d_tp.ROWWISE}

# Mamba's mixer split by inner channel (mpitp.replica.channel_tp): in_proj is [x | gate], each intermediate_size wide
_MAMBA = OwnPlan(
    {"embeddings": "embedding_rowwise", "layers.*.mixer": channel_tp.LOCAL, "layers.*.mixer.A_log": channel_tp.ROWS,
     "layers.*.mixer.D": channel_tp.ROWS,
     "layers.*.mixer.in_proj": channel_tp.PACKED_2, "layers.*.mixer.conv1d": channel_tp.ROWS,
     "layers.*.mixer.dt_proj": channel_tp.ROWS, "layers.*.mixer.x_proj": "rowwise",
     "layers.*.mixer.out_proj": "rowwise"},
    heads={"layers.*.mixer": ("intermediate_size",)},
    divides=(("intermediate_size", "inner channels (intermediate_size)"),))

#: model_type -> its variants, the first whose ``when`` the config matches is used.
PLANS: dict[str, tuple[OwnPlan, ...]] = {
    "stablelm": (OwnPlan(
        {"embed_tokens": "embedding_rowwise", **_attn("layers.*.self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
         **_mlp("layers.*.mlp", ("gate_proj", "up_proj"), "down_proj")},
        heads={"layers.*.self_attn": ("num_heads", "num_key_value_heads"),
               "layers.*.self_attn.q_layernorm": ("num_heads",), "layers.*.self_attn.k_layernorm": ("num_heads",)},
        head_lists={"layers.*.self_attn.q_layernorm": "norms", "layers.*.self_attn.k_layernorm": "norms"},
        divides=(_ATTN, ("num_key_value_heads", "key/value heads"))),),
    "gpt_neo": (OwnPlan(
        {"wte": "embedding_rowwise", **_attn("h.*.attn.attention", ("q_proj", "k_proj", "v_proj"), "out_proj"),
         **_mlp("h.*.mlp", ("c_fc",), "c_proj")},
        heads={"h.*.attn.attention": ("num_heads",)}),),
    "opt": (OwnPlan(
        {"decoder.embed_tokens": "embedding_rowwise",
         **_attn("decoder.layers.*.self_attn", ("q_proj", "k_proj", "v_proj"), "out_proj"),
         **_mlp("decoder.layers.*", ("fc1",), "fc2")},
        heads={"decoder.layers.*.self_attn": ("num_heads",)}),),
    # query_key_value is per head [heads, 3, head_dim]: a contiguous split gives each rank its heads' q, k and v
    "persimmon": (OwnPlan(
        {"embed_tokens": "embedding_rowwise", **_attn("layers.*.self_attn", ("query_key_value",), "dense"),
         **_mlp("layers.*.mlp", ("dense_h_to_4h",), "dense_4h_to_h")},
        heads={"layers.*.self_attn": ("num_heads",)}),),
    "bloom": (OwnPlan(
        {"word_embeddings": "embedding_rowwise", **_attn("h.*.self_attention", ("query_key_value",), "dense"),
         **_mlp("h.*.mlp", ("dense_h_to_4h",), "dense_4h_to_h")},
        heads={"h.*.self_attention": ("num_heads",)}, alibi={"h.*.self_attention": ("alibi",)},
        refuse=(("slow_but_exact", True, "slow_but_exact re-slices the whole dense weights by pretraining_tp"),)),),
    # Wqkv is [q | k | v], each hidden_size wide: transformers' packed style takes each rank's third of each
    "mpt": (OwnPlan(
        {"wte": "embedding_rowwise", **_attn("blocks.*.attn", ("Wqkv",), "out_proj", PACKED_QKV),
         **_mlp("blocks.*.ffn", ("up_proj",), "down_proj")},
        heads={"blocks.*.attn": ("n_heads",)}, alibi={"blocks.*.attn": ("position_bias",)}),),
    "gpt_bigcode": (
        OwnPlan(_BIGCODE, when={"multi_query": True}, mqa_rows={"h.*.attn.c_attn": "hidden_size"},
                heads={"h.*.attn": ("num_heads", "embed_dim", "num_key_value_groups")}),
        # without MQA c_attn is per head [heads, 3 * head_dim]
        OwnPlan({**_BIGCODE, "h.*.attn.c_attn": "colwise"}, when={"multi_query": False},
                heads={"h.*.attn": ("num_heads", "kv_heads", "kv_dim")}),
    ),
    # Conv1D weights are [in, out] (mpitp.replica.conv1d_tp); c_attn is [q | k | v], each hidden_size wide
    "gpt2": (OwnPlan(
        {"wte": "embedding_rowwise", **_CONV1D}, heads={"h.*.attn": ("num_heads", "split_size", "embed_dim")},
        refuse=(("add_cross_attention", True, "its cross-attention (an encoder-decoder use) is not split"),)),),
    "openai-gpt": (OwnPlan({"tokens_embed": "embedding_rowwise", **_CONV1D},
                           heads={"h.*.attn": ("n_head", "split_size")}),),
    # query_key_value is per head [heads, 3 * head_dim]; dense's bias is a separate parameter the layer adds after
    "gpt_neox_japanese": (OwnPlan(
        {"embed_in": "embedding_rowwise", **_attn("layers.*.attention", ("query_key_value",), "dense"),
         **_mlp("layers.*.mlp", ("dense_h_to_4h",), "dense_4h_to_h")},
        heads={"layers.*.attention": ("num_attention_heads",)}, head="embed_out"),),
    "biogpt": (OwnPlan(
        {"embed_tokens": "embedding_rowwise", **_attn("layers.*.self_attn", ("q_proj", "k_proj", "v_proj"), "out_proj"),
         **_mlp("layers.*", ("fc1",), "fc2")},
        heads={"layers.*.self_attn": ("num_heads",)}, head="output_projection"),),
    "falcon": (
        # Falcon-40B/180B/11B: [kv groups, q heads of the group + k + v, head_dim]: a contiguous split keeps groups
        OwnPlan({**_FALCON, "h.*.self_attention.query_key_value": "colwise"}, when={"new_decoder_architecture": True},
                heads={"h.*.self_attention": ("num_heads", "num_kv_heads")}, alibi=_FALCON_ALIBI,
                divides=(_ATTN, ("num_kv_heads", "key/value heads"))),
        # Falcon-7B: [q heads | k | v] with one key/value head
        OwnPlan(_FALCON, when={"multi_query": True}, mqa_rows={"h.*.self_attention.query_key_value": "hidden_size"},
                heads={"h.*.self_attention": ("num_heads", "num_key_value_groups?")}, alibi=_FALCON_ALIBI),
        # Falcon-RW: per head [heads, 3, head_dim]
        OwnPlan({**_FALCON, "h.*.self_attention.query_key_value": "colwise"}, when={"multi_query": False},
                heads={"h.*.self_attention": ("num_heads", "num_kv_heads")}, alibi=_FALCON_ALIBI),
    ),
    # RWKV-4: key/value/receptance per channel, the WKV recurrence per channel with time_decay/time_first; the
    # feed-forward's receptance gate acts on the summed output (whole); state entries 2-4 are the WKV numerator,
    # denominator and max, per channel
    "rwkv": (OwnPlan(
        {"embeddings": "embedding_rowwise",
         **_attn("blocks.*.attention", ("key", "value", "receptance"), "output"),
         **_mlp("blocks.*.feed_forward", ("key",), "value")},
        divides=(("attention_hidden_size", "attention channels (attention_hidden_size)"),
                 ("intermediate_size", "feed-forward channels (intermediate_size)")),
        own_rows={"blocks.*.attention": ("time_decay", "time_first")}, split_state=(2, 3, 4), head="head"),),
    # DBRX: Wqkv is [q | k | v] with fewer key/value heads (cut by hand: fused_heads); each expert's ffn rows split
    # (w1, v1, w2 are [experts * ffn, hidden]), the experts' output summed over the group
    "dbrx": (OwnPlan(
        {"wte": "embedding_rowwise", "blocks.*.norm_attn_norm.attn.out_proj": "rowwise",
         "blocks.*.ffn.experts": channel_tp.LOCAL_SUM,
         **{f"blocks.*.ffn.experts.mlp.{w}": channel_tp.EXPERT_ROWS for w in ("w1", "v1", "w2")}},
        fused_heads={"blocks.*.norm_attn_norm.attn": {"Wqkv": ("num_heads", "num_key_value_heads",
                                                               "num_key_value_heads")}},
        heads={"blocks.*.norm_attn_norm.attn": ("num_heads", "num_key_value_heads", "hidden_size"),
               "blocks.*.ffn.experts": ("ffn_hidden_size",)},
        divides=(_ATTN, ("num_key_value_heads", "key/value heads"),
                 ("ffn_config.ffn_hidden_size", "expert feed-forward channels (ffn_config.ffn_hidden_size)"))),),
    # JetMoE: the mixture of attention's experts project to the key/value heads' width ([experts, out, in]): each
    # rank keeps its kv heads' rows of every expert's query projection, kv_proj's [k | v] heads, and the matching
    # columns of every expert's output projection; the MLP's experts likewise by channel; both sum after
    "jetmoe": (OwnPlan(
        {"embed_tokens": "embedding_rowwise", "layers.*.self_attention": channel_tp.LOCAL,
         "layers.*.self_attention.kv_proj": channel_tp.PACKED_2,
         "layers.*.self_attention.experts.input_linear.weight": channel_tp.DIM1,
         "layers.*.self_attention.experts.output_linear.weight": channel_tp.DIM2,
         "layers.*.mlp": channel_tp.LOCAL, "layers.*.mlp.input_linear.weight": channel_tp.PACKED_DIM1_2,
         "layers.*.mlp.output_linear.weight": channel_tp.DIM2},
        heads={"layers.*.self_attention": ("num_key_value_heads", "kv_projection_size"),
               "layers.*.self_attention.experts": ("hidden_size",)},
        sum_after={"layers.*.self_attention.experts": ("reduce", "bias"), "layers.*.mlp": ("forward", "bias")},
        divides=(("num_key_value_heads", "key/value heads"), ("intermediate_size", "expert channels"))),),
    # CTRL: its ffn is nn.Sequential(Linear, ReLU, Linear), split as a whole (channel_tp.SEQUENTIAL_MLP)
    "ctrl": (OwnPlan(
        {"w": "embedding_rowwise", **_attn("h.*.multi_head_attention", ("Wq", "Wk", "Wv"), "dense"),
         "h.*.ffn": channel_tp.SEQUENTIAL_MLP},
        heads={"h.*.multi_head_attention": ("num_heads",)},
        divides=(_ATTN, ("dff", "feed-forward channels (dff)"))),),
    # BitNet (unquantized weights): Llama's split, its sub-norms over the split widths summed over the group
    "bitnet": (OwnPlan(
        {"embed_tokens": "embedding_rowwise", **_attn("layers.*.self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
         **_mlp("layers.*.mlp", ("gate_proj", "up_proj"), "down_proj"),
         "layers.*.self_attn.attn_sub_norm": channel_tp.RMS_NORM, "layers.*.mlp.ffn_sub_norm": channel_tp.RMS_NORM},
        divides=(_ATTN, ("num_key_value_heads", "key/value heads"), ("intermediate_size", "MLP channels")),
        refuse=(("quantization_config", SET, "its quantized weights are packed (BitNet's ternary BitLinear), which "
                 "this split has not been checked on"),)),),
    # ModernBERT-decoder: Wi is [input | gate]; its vocabulary projection is `decoder`, after a prediction head
    # (dense, activation, norm) that stays whole on every rank
    "modernbert-decoder": (OwnPlan(
        {"embeddings.tok_embeddings": "embedding_rowwise",
         **_attn("layers.*.attn", ("q_proj", "k_proj", "v_proj"), "Wo"),
         "layers.*.mlp.Wi": channel_tp.PACKED_2, "layers.*.mlp.Wo": "rowwise"},
        heads={"layers.*.attn": ("num_heads", "all_head_size")},
        divides=(_ATTN, ("intermediate_size", "MLP channels")), head="decoder"),),
    "mamba": (_MAMBA,),
    "falcon_mamba": (_MAMBA,),  # its extra norms act on x_proj's summed output, the same on every rank
}


#: Types whose transformers TP plan loads but cannot compute at tp > 1 (found by the registry-wide matrix,
#: ``bench/arch_matrix.py``, on transformers 5.24): refused by type before loading, with the reason, instead of a
#: traceback after the load. Kept until a transformers release changes the plan (the matrix then shows it). What a
#: rule can find is refused by the rule instead (:func:`_split_after_shard`: SarvamMoE, Param2MoE).
UPSTREAM_BROKEN: dict[str, str] = {
    "doge": "its attention takes a mask built for every head (its dynamic mask) while each rank computes 1/tp of "
            "the heads (a shape error in the attention)",
    "inkling_text": "its plan names MLP modules the model does not have, and its forward then fails in a DTensor "
                    "reduction",
    "hrm_text": "its log-likelihoods come out different at tp=2 (by 0.07 on a 2-layer model, the head check passing): "
                "its recurrent H/L modules are not split the way the plan assumes",
}


def check_upstream(config: PreTrainedConfig, tp: int, plan: dict[str, str]) -> None:
    """Refuse at ``tp`` > 1 a type in :data:`UPSTREAM_BROKEN`, or one whose checkpoint conversion splits a fused
    tensor into projections its TP plan (``plan``, the config's ``base_model_tp_plan``) shards
    (:func:`_split_after_shard`)."""
    if tp == 1:
        return
    why = UPSTREAM_BROKEN.get(config.model_type) or _split_after_shard(config.model_type, plan)
    if why:
        raise UsageError(f"model type '{config.model_type}': transformers' tensor-parallel plan fails at --tp {tp}: "
                         f"{why}; run it with --tp 1 (data parallel: more ranks)")


def _split_after_shard(model_type: str, plan: dict[str, str]) -> str | None:
    """Why the load fails at tp > 1, where the type's checkpoint conversion cuts a fused tensor (``query_key_value``)
    into parameters the TP plan shards (``q_proj``, ``k_proj``, ``v_proj``) with transformers' ``Split``: it sizes the
    pieces by the full parameters while each rank holds its shard of the fused tensor ("not TP-safe", its docstring
    says), so the sizes no longer add up and the load raises. None where no such conversion exists. Read from
    transformers' own conversion table, so a type that gains one is refused without an entry here."""
    sharded = {rule.rsplit(".", 1)[-1] for rule, style in plan.items() if not style.startswith("replicated")}
    split = compat.attribute("transformers.core_model_loading.Split")
    for conv in compat.attribute("transformers.conversion_mapping.get_checkpoint_conversion_mapping")(
            model_type) or ():
        if not any(isinstance(op, split) for op in getattr(conv, "operations", None) or ()):
            continue
        cut = [t for t in conv.target_patterns if t.rsplit(".", 1)[-1] in sharded]
        if cut:
            return (f"its checkpoint's fused {'/'.join(conv.source_patterns)} is split into {', '.join(cut)} after "
                    f"each rank's shard is cut, by the full sizes (transformers' Split is not tensor-parallel safe), "
                    f"so the load fails")
    return None


def for_config(config: PreTrainedConfig) -> OwnPlan | None:
    """mpitp's plan for ``config``'s model, or None: transformers has a plan of its own, the model runs remote code
    (its modules are not the ones named here), or no variant is declared for it."""
    text = config.get_text_config()
    if getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None):
        return None
    if getattr(config, "auto_map", None):
        return None
    for variant in PLANS.get(config.model_type, ()):
        if all(getattr(text, k, None) == v for k, v in variant.when.items()):
            return variant
    return None


def check(config: PreTrainedConfig, own: OwnPlan, tp: int) -> None:
    """Refuse, before loading, what the plan cannot split exactly, with the arithmetic spelled out."""
    text, name = config.get_text_config(), config.model_type
    for attr, value, why in own.refuse:
        if getattr(text, attr, None) == value:
            raise UsageError(f"{name}: {why}, which a tensor-parallel split cannot reproduce; run it with --tp 1")
    for attr, what in own.divides:
        n = _config_value(text, attr)
        if n is not None and n % tp:
            raise UsageError(f"{name}: {n} {what} are not divisible by --tp {tp}")


def _config_value(config, dotted: str):
    """``config.a.b`` for ``"a.b"`` (a sub-config's value, DBRX's ``ffn_config.ffn_hidden_size``), None where absent."""
    for part in dotted.split("."):
        config = getattr(config, part, None)
    return config


def full_plan(model_cls: type[PreTrainedModel], own: OwnPlan) -> dict[str, str]:
    """The plan under the causal LM's own names (``transformer.h.*.attn.q_proj``), as ``DistributedConfig`` wants
    them: the base model's rules under its ``base_model_prefix``, and the LM head split by vocabulary (scoring reads
    its rows where they lie: :mod:`mpitp.replica.scoring`)."""
    prefix = model_cls.base_model_prefix
    plan = {f"{prefix}.{k}": v for k, v in own.plan.items()}
    return {**plan, own.head: "colwise_gather_output"}


def causal_lm_class(config: PreTrainedConfig) -> type[PreTrainedModel]:
    """transformers' causal-LM class for ``config`` (the one ``AutoModelForCausalLM`` builds)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])


def distributed_config(config: PreTrainedConfig | None, tp: int, **sizes: int) -> DistributedConfig:
    """``DistributedConfig(tp_size=tp, ...)``, carrying mpitp's plan where transformers has none for ``config``."""
    from transformers.distributed import DistributedConfig

    own = for_config(config) if tp > 1 and config is not None else None
    if own is None:
        return DistributedConfig(tp_size=tp, **sizes)
    _register_styles()
    return DistributedConfig(tp_size=tp, tp_plan=full_plan(causal_lm_class(config), own), **sizes)


def _register_styles() -> None:
    """Add the styles of :mod:`mpitp.replica.channel_tp` (packed with bias, channel splits) and
    :mod:`mpitp.replica.conv1d_tp` to transformers' registry of parallel styles: new names, nothing replaced (the way
    transformers registers its own styles), so nothing is undone."""
    styles = compat.attribute(_STYLES)
    for module in (channel_tp, conv1d_tp):
        for name, style in module.styles().items():
            if name not in styles:
                styles.register(name, style)


def _rule(name: str) -> str:
    """``h.3.attn`` -> ``h.*.attn``: a module's name as plan rules write it (transformers' own wildcarding)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


