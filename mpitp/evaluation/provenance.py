"""What a results file records about its run (the root attributes of :mod:`mpitp.results.schema`), with secrets left
out: results files are shared (a group's project space, a bundle passed between teams), while a command line, lm-eval's
``--hf_hub_log_args token=...``, ``--wandb_args`` or ``--model_args`` can hold a token or a key.

:func:`redact` replaces the value of every setting whose name says it is a secret (:func:`secret_name`: ``token``,
``hf_token``, ``api_key``, ``WANDB_API_KEY``, ``password``, ``client_secret``...) by ``<redacted>``, in mappings and in
lm-eval's ``k=v,k2=v2`` strings, and any Hugging Face token (``hf_`` and 30+ letters) wherever it appears. The names
are matched by word (split at ``_``, ``-``, ``.``), not by substring, so ``max_new_tokens``, ``add_bos_token`` or
``tokenizer`` (settings that determine results and belong to the run's identity) stay.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.parallel.runtime import Runtime

REDACTED = "<redacted>"
_SECRET_LAST_WORDS = {"token", "key", "secret", "password", "passwd", "apikey", "credential", "credentials", "pat"}
_SECRET_ANY_WORDS = {"secret", "password", "passwd", "apikey", "credentials"}
_SPECIAL_TOKENS = {"bos", "eos", "pad", "unk", "sep", "cls", "mask"}  # ``add_bos_token``, ``pad_token``: settings
_KV = re.compile(r"([A-Za-z0-9_.\-]+)(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^,\s}]*)")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")


def secret_name(name: str) -> bool:
    """Whether a setting called ``name`` holds a secret (``token``, ``hf_token``, ``WANDB_API_KEY``, ``password``)."""
    words = [w for w in re.split(r"[_\-.\s]+", str(name).strip("\"'").lower()) if w]
    if not words:
        return False
    if words[-1] == "token" and len(words) > 1 and words[-2] in _SPECIAL_TOKENS:
        return False
    return words[-1] in _SECRET_LAST_WORDS or any(w in _SECRET_ANY_WORDS for w in words)


def redact_text(text: str) -> str:
    """``text`` with the values of secret ``name=value`` or ``"name": "value"`` pairs and Hugging Face tokens
    replaced."""
    def pair(m: re.Match) -> str:
        return m.group(1) + m.group(2) + REDACTED if secret_name(m.group(1)) else m.group(0)

    text = re.sub(r"(\"[^\"]*\")(\s*:\s*)(\"[^\"]*\"|[^,\s}]*)", pair, text)  # JSON objects given as text
    return _HF_TOKEN.sub(REDACTED, _KV.sub(pair, text))


def redact(value: object) -> object:
    """A copy of ``value`` (mappings, lists, strings) with every secret replaced by ``<redacted>``."""
    if isinstance(value, dict):
        return {k: REDACTED if secret_name(k) and v not in (None, False, "") else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def redacted_command(argv: list[str]) -> str:
    """The command line as recorded: each argument redacted, and the argument after a secret flag
    (``--api-key VALUE``, ``--token VALUE``) replaced."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("-") and "=" not in arg and secret_name(arg.lstrip("-")):
            hide_next = True
        out.append(redact_text(arg))
    return " ".join(out)


def run_metadata(cfg: EvalConfig, rt: Runtime, tokenizer: str) -> dict:
    """The root attributes of a new results file (:mod:`mpitp.results.schema`), secrets removed (:func:`redact`)."""
    import lm_eval
    import torch
    import transformers

    from mpitp import testing
    from mpitp.evaluation.fingerprint import record
    from mpitp.parallel.world import mpi_library_version
    from mpitp.version import __version__

    meta = dict(mpitp_version=__version__, model=cfg.model, tokenizer=tokenizer, dtype=cfg.dtype,
                world_size=rt.world.size, tp=rt.layout.tp, dp=rt.layout.dp, pp=rt.layout.pp,
                nodes=rt.world.nodes_text, command=redacted_command(sys.argv),
                lm_eval_version=getattr(lm_eval, "__version__", "unknown"), torch_version=torch.__version__,
                transformers_version=transformers.__version__, mpi_version=mpi_library_version(),
                config_json=json.dumps(redact(cfg.identity()), sort_keys=True),
                # what is on disk (weights, tokenizer, library versions: the rest of the resume identity, see
                # mpitp.evaluation.fingerprint) and the whole configuration (so mpitp rescore can rebuild the tasks)
                fingerprint_json=json.dumps(record(cfg.model, cfg.tokenizer, cfg.revision, cfg.peft,
                                                   cfg.hf_assets), sort_keys=True),
                eval_config_json=json.dumps(redact(json.loads(json.dumps(asdict(cfg), default=str))),
                                            sort_keys=True))
    hooks = testing.active()
    if hooks:  # a test run: its results were altered or steered on purpose (mpitp.testing)
        meta["test_hooks"] = " ".join(hooks)
    return meta
