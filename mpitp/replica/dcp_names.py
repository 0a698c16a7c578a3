"""Which checkpoint tensor fills each parameter of the config's model: torchtitan's names, HF's, and their rotary rows.

Found from a DCP checkpoint's ``.metadata`` alone (:func:`plan_loading`), before any rank loads, so that an unknown
name, a missing parameter or a shape that differs from the config's model is refused naming the parameter: a
checkpoint is never loaded wrong. A tied parameter's second name (``lm_head.weight`` of a ``tie_word_embeddings``
model: HF's ``state_dict()`` holds it beside the embedding, so a DCP save stores the tensor twice) is no parameter of
the model: its tensor is not loaded but kept as the loaded one's ``twin``, which the load verifies equal (see
:class:`Entry`). torchtitan's Llama 3 / Qwen 3 names are verified against torchtitan's
``state_dict_adapter.py``; torchtitan keeps Llama's q/k rows in Meta's interleaved rotary order, and
:func:`titan_to_hf_rows` is HF's ``convert_llama_weights_to_hf.py`` permutation (rows move only inside a head).
Imports no torch: the plan is checked on rank 0 (and by ``mpitp check`` on a login node) from names and shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpitp.errors import UsageError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig

# torchtitan name -> (HF name, rotary permutation of rows: "q" / "k" / None), per HF model type. The layer number is
# ``{}``. From torchtitan's models/llama3/model/state_dict_adapter.py and models/qwen3/model/state_dict_adapter.py
# (Qwen 3 keeps HF's rotary layout: no permutation).
_LLAMA = {
    "tok_embeddings.weight": ("model.embed_tokens.weight", None),
    "layers.{}.attention.wq.weight": ("model.layers.{}.self_attn.q_proj.weight", "q"),
    "layers.{}.attention.wk.weight": ("model.layers.{}.self_attn.k_proj.weight", "k"),
    "layers.{}.attention.wv.weight": ("model.layers.{}.self_attn.v_proj.weight", None),
    "layers.{}.attention.wo.weight": ("model.layers.{}.self_attn.o_proj.weight", None),
    "layers.{}.feed_forward.w1.weight": ("model.layers.{}.mlp.gate_proj.weight", None),
    "layers.{}.feed_forward.w2.weight": ("model.layers.{}.mlp.down_proj.weight", None),
    "layers.{}.feed_forward.w3.weight": ("model.layers.{}.mlp.up_proj.weight", None),
    "layers.{}.attention_norm.weight": ("model.layers.{}.input_layernorm.weight", None),
    "layers.{}.ffn_norm.weight": ("model.layers.{}.post_attention_layernorm.weight", None),
    "norm.weight": ("model.norm.weight", None),
    "output.weight": ("lm_head.weight", None),
}
_QWEN3 = {**{k: (hf, None) for k, (hf, _) in _LLAMA.items()},
          "layers.{}.attention.q_norm.weight": ("model.layers.{}.self_attn.q_norm.weight", None),
          "layers.{}.attention.k_norm.weight": ("model.layers.{}.self_attn.k_norm.weight", None)}
TITAN_NAMES = {"llama": _LLAMA, "qwen3": _QWEN3}
TITAN_BUFFERS = ("freqs_cis",)
"""torchtitan's persistent rotary table (``register_buffer("freqs_cis", ..., persistent=True)``, for pp and compile),
saved in the full checkpoints of torchtitan releases before its ``ModelWrapper`` dropped it: derived from the config
(HF's model computes its own rotary frequencies), so not read."""


@dataclass(frozen=True)
class Entry:
    """The checkpoint tensor that fills a parameter.

    ``twin``: the same tensor saved a second time under a tied name (a tied model's ``state_dict()`` holds the
    embedding as ``lm_head.weight`` too, and ``dcp.save`` stores both). Only ``key`` is loaded (the tie gives the
    other name its values), but each rank then compares its region of ``twin`` with what it loaded and refuses a
    difference: a twin that differs means the checkpoint was saved from an untied model, whose head a tied config
    would silently replace by its embedding. That costs each rank one more read of its region of the tensor, in
    bounded blocks (:func:`mpitp.replica.dcp_load.check_twin`): the price of never loading a checkpoint wrong.
    """

    key: str  # the name in the checkpoint
    permute: str | None  # "q" / "k": torchtitan's rotary row order, permuted to HF's after loading
    twin: str | None = None  # the same tensor under its tied name in the checkpoint, verified equal after loading


class Params(dict):
    """``{HF name: global shape}`` of each parameter of the config's model, and ``tied``: ``{second name: the
    parameter it is}`` for the names ``named_parameters`` leaves out because they are tied (``lm_head.weight`` ->
    ``model.embed_tokens.weight``), found from the model itself so that any architecture's ties are known."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], tied: dict[str, str] | None = None):
        super().__init__(shapes)
        self.tied = dict(tied or {})


@dataclass
class Plan:
    """Which checkpoint tensor fills each HF parameter, found from the ``.metadata`` alone."""

    entries: dict[str, Entry]
    naming: str  # "torchtitan" or "hf"
    prefix: str  # "" or "model."
    dtype: object  # the checkpoint's dtype (of its embedding): what --dtype auto loads


def _titan_to_hf(name: str, table: dict) -> tuple[str, str | None] | None:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        hit = table.get("layers.{}." + m.group(2))
        return (hit[0].format(m.group(1)), hit[1]) if hit else None
    return table.get(name)


def _prefixes(tensors: dict, name: str) -> list[str]:
    """Where the model's weights may lie: the top level, ``model.``, then any other section holding ``name`` (torch's
    DCP recipe saves ``{"app": AppState}``, whose model is under ``app.model.``)."""
    found = sorted(k[:-len(name)] for k in tensors if name and k.endswith("." + name))
    return ["", "model."] + [p for p in found if p != "model."]


def plan_loading(tensors: dict, config: PreTrainedConfig, params: dict[str, tuple[int, ...]], where: str) -> Plan:
    """Map every checkpoint tensor onto the parameters ``params`` (``{HF name: global shape}``, of the model the
    config builds; a :class:`Params` also names its tied second names); a :class:`UsageError` naming the first
    unknown, missing or mis-shaped parameter.

    A tensor under a tied second name becomes its parameter's ``twin`` (verified equal when loaded): the second
    name is no parameter on any rank (under pp transformers keeps a tied embedding on the head's stage too, and the
    head is it there), so the parameter's own tensor is the one loaded."""
    tied = getattr(params, "tied", {})
    flat = [k for k in tensors if "_flat_param" in k or "_fsdp_wrapped_module" in k]
    if flat:
        raise UsageError(f"{where}: {flat[0]} is an FSDP1 flat parameter, which mpitp does not read: save the "
                         f"model with a SHARDED_STATE_DICT or FULL_STATE_DICT, or merge it into a Hugging Face "
                         f"folder (accelerate merge-weights)")
    if not tensors:
        raise UsageError(f"{where}: the DCP checkpoint holds no model tensors (only training state)")
    model_type = config.model_type
    table = TITAN_NAMES.get(model_type)
    # torchtitan's names first: its ``norm.weight`` under a ``model.`` prefix is also HF's ``model.norm.weight``.
    candidates = [("torchtitan", prefix) for prefix in _prefixes(tensors, "tok_embeddings.weight")
                  if table and prefix + "tok_embeddings.weight" in tensors]
    candidates += [("hf", prefix) for prefix in _prefixes(tensors, next(iter(params), ""))
                   if 2 * sum(prefix + n in tensors for n in params) > len(params)]
    if not candidates:
        if "tok_embeddings.weight" in tensors or "model.tok_embeddings.weight" in tensors:
            raise UsageError(f"{where}: torchtitan parameter names are read for model types "
                             f"{', '.join(sorted(TITAN_NAMES))}, and the config's model type is '{model_type}'")
        raise UsageError(f"{where}: {sorted(tensors)[0]} is neither a torchtitan nor a Hugging Face parameter name "
                         f"of a '{model_type}' model")
    naming, prefix = candidates[0]
    entries: dict[str, Entry] = {}
    twins: dict[str, str] = {}  # parameter -> the checkpoint key of its tensor under its tied second name
    for key in sorted(tensors):
        if not key.startswith(prefix):
            raise UsageError(f"{where}: unknown entry {key} (the model's weights are under '{prefix}')")
        name = key[len(prefix):]
        if naming == "torchtitan":
            if name in TITAN_BUFFERS:
                continue
            hit = _titan_to_hf(name, table)
            if hit is None:
                raise UsageError(f"{where}: unknown torchtitan parameter {key} for a '{model_type}' model")
            hf, permute = hit
        else:
            hf, permute = name, None
        if hf in tied and hf not in params:
            shape = tensors[key][0]
            if tuple(shape) != tuple(params[tied[hf]]):
                raise UsageError(f"{where}: {key} has shape {list(shape)} in the checkpoint, but the config's "
                                 f"model ties {hf} to {tied[hf]} of shape {list(params[tied[hf]])}")
            twins[tied[hf]] = key
            continue
        if hf not in params:
            raise UsageError(f"{where}: {key} names no parameter of the config's {model_type} model "
                             f"({hf} does not exist)")
        shape = tensors[key][0]
        if tuple(shape) != tuple(params[hf]):
            raise UsageError(f"{where}: {key} has shape {list(shape)} in the checkpoint, but the config's model "
                             f"has {hf} of shape {list(params[hf])}")
        entries[hf] = Entry(key, permute)
    missing = [n for n in params if n not in entries]
    if missing:
        raise UsageError(f"{where}: the checkpoint has no tensor for {missing[0]}"
                         + (f" (and {len(missing) - 1} more parameters)" if len(missing) > 1 else ""))
    for hf, key in twins.items():
        entries[hf] = Entry(entries[hf].key, entries[hf].permute, key)
    embed = next((e.key for n, e in entries.items() if "embed" in n), next(iter(entries.values())).key)
    return Plan(entries, naming, prefix, tensors[embed][1])


# ------------------------------------------------------------------------------------------------ permutations


def titan_to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's (Meta's interleaved) q/k rows in HF's rotate-half order: HF's conversion ``permute``."""
    rows, dim = w.shape
    return w.view(heads, rows // heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def hf_to_titan_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`titan_to_hf_rows` (torchtitan's ``from_hf``): what a torchtitan checkpoint holds."""
    rows, dim = w.shape
    return w.view(heads, 2, rows // heads // 2, dim).transpose(1, 2).reshape(rows, dim)


def hf_to_titan_names(state: dict, config: PreTrainedConfig) -> dict:
    """An HF Llama/Qwen3 state dict in torchtitan's names and row order (the tests' checkpoints; torchtitan's
    ``from_hf``)."""
    text = config.get_text_config()
    table = TITAN_NAMES[config.model_type]
    reverse = {hf: (titan, perm) for titan, (hf, perm) in table.items()}
    out = {}
    for name, t in state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        templ = "model.layers.{}." + m.group(2) if m else name
        if templ not in reverse:
            raise KeyError(name)
        titan, perm = reverse[templ]
        if perm == "q":
            t = hf_to_titan_rows(t, text.num_attention_heads)
        elif perm == "k":
            t = hf_to_titan_rows(t, text.num_key_value_heads or text.num_attention_heads)
        out[titan.format(m.group(1)) if m else titan] = t.contiguous()
    return out
