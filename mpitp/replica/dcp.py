"""torch Distributed Checkpoint (DCP) folders, as torchtitan writes them, evaluated at any layout with no conversion.

A training run saves ``checkpoint/step-N/`` folders: a ``.metadata`` file (every tensor's name, global shape, dtype
and where its saved chunks lie) and ``__R_0.distcp`` shards, in the framework's own parameter names. Converting each
step to a Hugging Face folder costs a full read and write of the model per step; here the folder is read in place:

* the architecture (``config.json``) and tokenizer come from ``--hf-assets DIR`` (torchtitan's own name for that
  folder), else from a ``config.json`` in the checkpoint folder or its parent;
* names: torchtitan's Llama 3 / Qwen 3 names (verified against torchtitan's ``state_dict_adapter.py``), bare or
  under a ``model.`` prefix, or plain HF names (a DCP saved from an HF model's own ``state_dict()``, e.g.
  accelerate's FSDP ``SHARDED_STATE_DICT`` under ``model.``); a full training checkpoint's ``optimizer``,
  ``lr_scheduler``, ``dataloader`` and ``train_state`` entries are ignored. An unknown name, a missing parameter
  or a shape that differs from the config's model is refused naming the parameter, before any rank loads: a
  checkpoint is never loaded wrong;
* torchtitan keeps Llama's q/k rows in Meta's interleaved rotary order; HF's ``convert_llama_weights_to_hf.py``
  permutes them per head (``w.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2)``). That permutation moves rows
  only inside a head, and TP shards q/k by whole heads, so each rank permutes its own rows after loading;
* loading: transformers builds the model from the config with the same TP/PP plan as a safetensors load (every
  parameter this rank's shard, a DTensor under tp; other stages' layers never created), then :class:`SliceReader`
  fills the local parameters from the chunk index of ``.metadata``, ``pread``-ing only the bytes of each rank's
  region of each tensor it holds (chunks it cannot parse go to DCP's own ``load``, one chunk at a time): never the
  whole model in one process.

Formats we do not read (Megatron ``torch_dist``, FSDP1 flat-parameter shards) are refused with the conversion to
use. This module imports torch only inside functions (as do the three below): :func:`is_dcp`, :func:`assets_dir` and
the fingerprint's helpers serve checks on a login node.

This module is the surface other modules import (the folder, :func:`check`, :func:`from_pretrained`, and the names
below re-exported); each job lives in a module of its own: the names and the load plan in
:mod:`mpitp.replica.dcp_names`, the restricted ``.metadata`` unpickler and the exact-chunk :class:`SliceReader` in
:mod:`mpitp.replica.dcp_read`, filling the model transformers builds in :mod:`mpitp.replica.dcp_load`.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.replica.dcp_load import config_params, fill, quiet_transformers, without_weight_init
from mpitp.replica.dcp_names import Entry, Plan, hf_to_titan_names, hf_to_titan_rows, plan_loading, titan_to_hf_rows
from mpitp.replica.dcp_read import IGNORED_SECTIONS, METADATA, SliceReader, check_shards, model_tensors, read_metadata

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata
    from transformers import PreTrainedConfig, PreTrainedModel
    from transformers.distributed import DistributedConfig

__all__ = [  # the public surface: defined here, or re-exported from the module of its job for callers and tests
    "is_dcp", "refuse_foreign", "assets_dir", "tokenizer_source", "check", "from_pretrained",  # defined here
    "METADATA", "IGNORED_SECTIONS", "read_metadata", "model_tensors", "SliceReader",  # dcp_read
    "Entry", "Plan", "hf_to_titan_names", "hf_to_titan_rows", "titan_to_hf_rows",  # dcp_names
]


# ------------------------------------------------------------------------------------------------ the folder


def is_dcp(path: str | None) -> bool:
    """A local folder holding a DCP ``.metadata`` file (and no HF weights, which win: transformers' own loader)."""
    if not path or not os.path.isdir(path) or not os.path.isfile(os.path.join(path, METADATA)):
        return False
    return not any(n.endswith((".safetensors", ".bin")) for n in os.listdir(path))


def refuse_foreign(path: str) -> None:
    """One line naming the conversion for checkpoint formats that look like DCP but are not read here."""
    meta = os.path.join(path, "metadata.json")
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                text = f.read(1 << 20)
        except OSError:
            text = ""
        if "sharded_backend" in text:
            raise UsageError(f"model path {path} is a Megatron-LM distributed checkpoint (metadata.json names a "
                             f"sharded_backend), which mpitp does not read: convert it to a Hugging Face folder "
                             f"first (Megatron-LM tools/checkpoint/convert.py --saver hf, or Megatron-Bridge's "
                             f"export)")
    try:
        names = os.listdir(path)
    except OSError:
        return
    if any(re.fullmatch(r"(pytorch_model|model)_fsdp_(rank)?\d+\.(bin|pt)", n) or re.fullmatch(r".*_rank\d+\.pt", n)
           for n in names):
        raise UsageError(f"model path {path} holds FSDP1 per-rank state files, which mpitp does not read: merge "
                         f"them into a Hugging Face folder first (accelerate merge-weights {path} OUT_DIR)")


def assets_dir(model: str, hf_assets: str | None = None) -> str:
    """The folder with the ``config.json`` (and tokenizer) of DCP checkpoint ``model``: ``--hf-assets``, else the
    checkpoint folder itself, else its parent (torchtitan's ``checkpoint/step-N`` beside a run's ``config.json``)."""
    if hf_assets:
        if not os.path.isfile(os.path.join(os.path.expanduser(hf_assets), "config.json")):
            raise UsageError(f"--hf-assets {hf_assets}: no config.json there (torchtitan's hf_assets folder: the "
                             f"model's config.json and tokenizer files)")
        return os.path.expanduser(hf_assets)
    for d in (model, os.path.dirname(os.path.normpath(model))):
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
    raise UsageError(f"model path {model} is a torch DCP checkpoint without a config.json beside it: give "
                     f"--hf-assets DIR (the folder with the model's config.json and tokenizer files)")


def tokenizer_source(model: str | None, tokenizer: str | None, hf_assets: str | None) -> str | None:
    """Where lm-eval reads the tokenizer: ``--tokenizer``, else a DCP checkpoint's assets, else the model."""
    if tokenizer:
        return tokenizer
    if model and is_dcp(model):
        try:
            return assets_dir(model, hf_assets)
        except UsageError:
            return model  # refused by the checks with its reason; here only a name is needed
    return model


# ------------------------------------------------------------------------------------------------ the plan and the load


def check(model: str, config: PreTrainedConfig, trust_remote_code: bool = False) -> Plan:
    """Rank 0, before loading: the checkpoint's names and shapes against the config's model, from ``.metadata``,
    and its shard files' presence and sizes."""
    return _planned(model, config, trust_remote_code)[1]


def _planned(path: str, config: PreTrainedConfig, trust_remote_code: bool) -> tuple[Metadata, Plan]:
    """``path``'s ``.metadata`` and the plan mapping its tensors onto the config's model, its shard files checked:
    what rank 0's check and every rank's load read alike."""
    metadata = read_metadata(path)
    plan = plan_loading(model_tensors(metadata), config, config_params(config, trust_remote_code),
                        f"model path {path}")
    check_shards(path, metadata)
    return metadata, plan


def from_pretrained(path: str, hf_assets: str | None, distributed_config: DistributedConfig | None = None,
                    dtype: str | torch.dtype = "auto", trust_remote_code: bool = False,
                    **load_kwargs) -> PreTrainedModel:
    """This rank's part of DCP checkpoint ``path``: what ``AutoModelForCausalLM.from_pretrained`` gives for an HF
    folder with the same ``distributed_config`` (TP shards as DTensors, only this pipeline stage's layers).

    The model is built by transformers from the config with an empty state dict (its TP/PP plan applied, each rank's
    shards materialised), then :func:`fill` reads each local parameter's slice from the checkpoint.
    """
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    if load_kwargs.pop("subfolder", None):
        raise UsageError(f"model path {path}: subfolder= does not apply to a torch DCP checkpoint folder")
    assets = assets_dir(path, hf_assets)
    config = AutoConfig.from_pretrained(assets, trust_remote_code=trust_remote_code)
    metadata, plan = _planned(path, config, trust_remote_code)
    torch_dtype = plan.dtype if dtype == "auto" else (getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    # the class AutoModelForCausalLM would build: transformers' private lookup over its public mapping
    model_class = compat.attribute("transformers.models.auto.auto_factory._get_model_class")
    cls = model_class(config, MODEL_FOR_CAUSAL_LM_MAPPING)
    kwargs = dict(config=config, state_dict={}, dtype=torch_dtype, **load_kwargs)
    if distributed_config is not None:
        kwargs["distributed_config"] = distributed_config
    with quiet_transformers():
        model = without_weight_init(cls).from_pretrained(None, **kwargs)
    model.__class__ = cls  # the subclass only changed how it was built
    model.config.name_or_path = path
    fill(model, path, plan, config, metadata)
    return model

