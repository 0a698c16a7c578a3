"""``--model_args`` as mpitp reads it (for ``mpitp eval`` and a job file's ``model_args``): which keys say what is
loaded, which go on to lm-eval's ``HFLM``, which are refused and why, the values each must hold, and the model they
name."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.evaluation.setting_values import BadValue, yaml_bool, yaml_int_at_least

HF_BACKENDS = ("hf", "hf-auto", "huggingface")
"""lm-eval's names for ``HFLM`` (``lm_eval.models.MODEL_MAPPING``): the one backend mpitp runs."""

HFLM_LOADING = ("pretrained", "revision", "dtype", "trust_remote_code", "tokenizer", "attn_implementation",
                "subfolder", "peft")
"""``--model_args`` keys that say which model and tokenizer are loaded, and how (mpitp's loader honours them)."""

HFLM_RUNTIME = ("max_length", "add_bos_token", "prefix_token_id", "truncation", "logits_cache", "use_fast_tokenizer",
                "think_end_token", "enable_thinking", "chat_template_args", "max_batch_size", "batch_size",
                "device", "backend", "softmax_dtype")
"""``--model_args`` keys passed on to lm-eval's ``HFLM`` as they are (tokenisation, prompts, post-processing)."""

HFLM_REFUSED = {
    "parallelize": "mpitp places the model itself: use --tp/--pp (and more ranks) instead of parallelize",
    "device_map": "mpitp places the model itself: use --tp/--pp instead of device_map",
    "max_memory_per_gpu": "mpitp places the model itself: use --tp/--pp instead of max_memory_per_gpu",
    "max_cpu_memory": "mpitp places the model itself: use --tp/--pp instead of max_cpu_memory",
    "offload_folder": "mpitp places the model itself and never offloads to disk",
    "tp_plan": "mpitp applies transformers' TP plan itself: use --tp N",
    "delta": "delta weights are not applied under TP yet: add them to the base weights first and pass that "
             "directory as pretrained",
    "autogptq": "GPTQ-quantised loading is not supported under TP",
    "gptqmodel": "GPTQ-quantised loading is not supported under TP",
    "gguf_file": "GGUF checkpoints are not supported under TP: convert to safetensors first",
    "mixed_precision_dtype": "mixed-precision autocast is not supported: pick the weights' dtype with dtype=",
    "load_in_8bit": "bitsandbytes quantisation is not supported under TP",
    "load_in_4bit": "bitsandbytes quantisation is not supported under TP",
}
"""``--model_args`` keys that mean another way of placing or building the model: refused, each with its reason."""

def resolve_model(model: str | None, model_args: dict) -> tuple[str, str | None]:
    """``(model_source, pretrained)`` from lm-eval's ``--model`` and ``--model_args``.

    ``--model hf`` takes the model from ``pretrained=``; ``--model PATH`` (mpitp's older form) is the model itself.
    Another lm-eval backend is refused by name.
    """
    pretrained = model_args.get("pretrained")
    if model is None or model in HF_BACKENDS:
        return (model or "hf"), (str(pretrained) if pretrained is not None else None)
    if os.path.exists(os.path.expanduser(model)) or "/" in model:
        if pretrained is not None and str(pretrained) != model:
            raise UsageError(f"--model {model} and --model_args pretrained={pretrained} name different models")
        return "hf", model
    from lm_eval.models import MODEL_MAPPING

    if model in MODEL_MAPPING:
        raise UsageError(f"--model {model}: mpitp runs Hugging Face transformers models only (--model hf "
                         f"--model_args pretrained=...); '{model}' is lm-eval's {MODEL_MAPPING[model].split(':')[-1]} "
                         "backend")
    return "hf", model  # a hub id without an organisation (gpt2)


#: ``--model_args`` values lm-eval's HFLM takes as they come (``key_val_to_dict`` types "True" and "12"): a flag
#: left a string ('maybe') failed inside the tokenizer on a DP leader (TypeError traceback, MPI_Abort), a negative
#: max_length only once a request met it
_MODEL_ARG_RULES = {
    **dict.fromkeys(("add_bos_token", "truncation", "logits_cache", "use_fast_tokenizer", "enable_thinking"),
                    yaml_bool),
    "max_length": yaml_int_at_least(2, "an integer >= 2 (tokens), as --max-length"),
    "prefix_token_id": yaml_int_at_least(0, "a token id (an integer >= 0)"),
}


def split_model_args(model_args: dict) -> tuple[dict, dict]:
    """``(loading, hflm)``: the keys mpitp's loader reads and those passed to ``HFLM``; refuses the others."""
    for key in model_args:
        if key in HFLM_REFUSED:
            raise UsageError(f"--model_args {key}: {HFLM_REFUSED[key]}")
    unknown = [k for k in model_args if k not in HFLM_LOADING and k not in HFLM_RUNTIME]
    if unknown:
        import difflib

        known = HFLM_LOADING + HFLM_RUNTIME
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"--model_args {unknown[0]}: not an HFLM argument mpitp passes on{hint}; accepted: "
                         + ", ".join(known))
    for key, rule in _MODEL_ARG_RULES.items():
        try:
            if key in model_args:
                rule(model_args[key])
        except BadValue as exc:
            raise UsageError(f"--model_args {key}: {exc}") from None
    backend = model_args.get("backend", "default")
    if backend not in ("default", "causal"):
        raise UsageError(f"--model_args backend={backend}: mpitp runs causal (decoder-only) models only")
    sd = model_args.get("softmax_dtype")
    if sd not in (None, "float32", "torch.float32"):
        raise UsageError(f"--model_args softmax_dtype={sd}: mpitp's vocab-parallel log-softmax is always float32; "
                         "pass softmax_dtype=float32 or leave it out")
    loading = {k: v for k, v in model_args.items() if k in HFLM_LOADING}
    hflm = {k: v for k, v in model_args.items() if k in HFLM_RUNTIME and k not in ("batch_size", "device",
                                                                                   "backend", "softmax_dtype")}
    return loading, hflm


def model_args_dict(args: str | Mapping | None, option: str = "--model_args") -> dict:
    """``--model_args`` (or another of lm-eval's mapping flags, ``option``) as lm-eval's command line reads it
    (``MergeDictAction``): a mapping, a JSON object, or ``key=value,key2=value2`` (values typed as lm-eval types them).
    A job file's string was read as ``key=value`` pairs alone: its JSON object was refused as model_args, and taken
    as metadata (or gen_kwargs) by lm-eval's ``simple_parse_args_string``, whose ``{"a": 1}`` is the key '{"a": 1}'
    and whose ``until=["x"]`` the one stop string '["x"]' (a list on the command line)."""
    if isinstance(args, str):
        if args.strip().startswith("{"):
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{option} {args!r}: not a JSON object: {exc}") from None
            if not isinstance(parsed, dict):
                raise UsageError(f"{option} {args!r}: not a JSON object")
            return parsed
        try:
            return compat.attribute("lm_eval._cli.utils.key_val_to_dict")(args)
        except ValueError as exc:
            raise UsageError(f"{option} {args!r}: {exc}") from None
    return dict(args or {})
