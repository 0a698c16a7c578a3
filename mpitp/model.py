"""Checking and loading a causal LM, TP-sharded with transformers' own plans.

Checks run on rank 0 *before* any weights load (through :func:`mpitp.runtime.agree`), so bad input costs seconds,
not a model load on every rank. Loading with tp > 1 uses ``DistributedConfig(tp_size=tp)``: transformers shards each
weight as it reads it, so no rank ever holds the whole model.
"""

from __future__ import annotations

import os

from .errors import UsageError

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _looks_local(name: str) -> bool:
    """A path rather than a hub id: it exists, or it starts like a path, or has more parts than ``org/name``."""
    return os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1


def load_config(model: str, revision: str | None = None, trust_remote_code: bool = False):
    """The model's config, or a one-line :class:`UsageError` saying why it cannot be had."""
    from transformers import AutoConfig

    if _looks_local(model):
        path = os.path.expanduser(model)
        if not os.path.exists(path):
            raise UsageError(f"model path {model} does not exist")
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(f"model path {model} is not a Hugging Face model directory (no config.json)")
    try:
        return AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - every failure here is the user's model argument
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot load model config for {model!r}: {first}") from None


def check_tp(config, tp: int) -> None:
    """Refuse layouts transformers' TP cannot shard, with the arithmetic spelled out."""
    if tp == 1:
        return
    text = config.get_text_config()
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise UsageError(f"model type '{config.model_type}' has no tensor-parallel plan in transformers; "
                         f"run it with --tp 1")
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads is not None and heads % tp:
        raise UsageError(f"tp={tp} does not divide the model's {heads} attention heads")
    if kv is not None and kv % tp:
        raise UsageError(f"tp={tp} does not divide the model's {kv} key/value heads")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")


def load_model(model: str, tp: int, device: str, dtype: str = "auto", revision: str | None = None,
               trust_remote_code: bool = False):
    """Load ``model`` for this rank: whole for tp=1, sharded by transformers' TP plan for tp > 1."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    kwargs = dict(dtype=torch_dtype, revision=revision, trust_remote_code=trust_remote_code)
    if tp > 1:
        from transformers.distributed import DistributedConfig

        m = AutoModelForCausalLM.from_pretrained(model, distributed_config=DistributedConfig(tp_size=tp), **kwargs)
    else:
        m = AutoModelForCausalLM.from_pretrained(model, **kwargs).to(device)
    m.eval()
    return m
