"""What the weights and tokenizer on disk are, cheaply: part of the resume identity.

A checkpoint directory rewritten at the same path (a training job saving ``step-latest`` again) must not have its new
results mixed with rows computed from the old weights. Hashing multi-GB shards would cost minutes, so a shard is
known by its size, the SHA-256 of its safetensors header (tensor names, dtypes, shapes and byte offsets) and the
SHA-256 of 16 blocks of 64 KiB spread evenly over the file: 1 MiB read per shard, and a training step changes
essentially every block. Small files (``config.json``, the shard index, tokenizer files) are hashed whole. The
transformers and lm-eval versions are part of it too: they define tokenisation and metrics.

Known limit: weights that change only outside the sampled blocks (a single edited tensor) are not seen: pass
``--overwrite`` to recompute such a file.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import TYPE_CHECKING

from mpitp.digest import MAX_SAFETENSORS_HEADER, safetensors_header, sampled_sha, sha256_file

if TYPE_CHECKING:
    from mpitp.evaluation.settings import EvalConfig

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
SMALL_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
                     "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
IDENTITY_KEYS = ("weights", "tokenizer_files", "transformers_version", "lm_eval_version", "adapter")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _file_sha(path: str) -> str:
    return sha256_file(path)[:16]


def safetensors_header_sha(path: str) -> str:
    with open(path, "rb") as f:
        raw, n = safetensors_header(f)
    return "truncated" if n < 0 else "bad-header" if n > MAX_SAFETENSORS_HEADER else _sha(raw)


def local_dir(name: str | None, revision: str | None = None) -> str | None:
    """The directory holding ``name``: itself when local, else its snapshot in the HF cache (never downloads)."""
    if not name:
        return None
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached / not a hub id: no fingerprint, said so in the identity
        return None


def model_files(directory: str) -> dict[str, str]:
    """``{relative file: "size:sha"}`` for the weights and small model files of ``directory``."""
    out = {}
    for pattern in WEIGHT_PATTERNS:
        for path in glob.glob(os.path.join(directory, pattern)):
            size = os.path.getsize(path)
            head = safetensors_header_sha(path) + "+" if path.endswith(".safetensors") else ""
            out[os.path.basename(path)] = f"{size}:{head}{sampled_sha(path, size)}"
    for name in SMALL_MODEL_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            out[name] = f"{os.path.getsize(path)}:{_file_sha(path)}"
    return dict(sorted(out.items()))


DCP_ASSETS = "hf-assets/"
"""Prefix of a torch DCP checkpoint's config files (from its --hf-assets folder) among its model files."""


def dcp_files(directory: str, assets: str | None) -> dict[str, str]:
    """A torch DCP checkpoint folder's files: ``.metadata`` (every tensor's name, shape, dtype and chunk offsets)
    hashed whole, each ``*.distcp`` shard by its size and sampled blocks as a safetensors shard, and the config the
    model is built from (its assets folder's), under :data:`DCP_ASSETS`."""
    out = {}
    for path in glob.glob(os.path.join(directory, "*.distcp")):
        size = os.path.getsize(path)
        out[os.path.basename(path)] = f"{size}:{sampled_sha(path, size)}"
    meta = os.path.join(directory, ".metadata")
    out[".metadata"] = f"{os.path.getsize(meta)}:{_file_sha(meta)}"
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(assets, name) if assets else ""
        if path and os.path.isfile(path):
            out[DCP_ASSETS + name] = f"{os.path.getsize(path)}:{_file_sha(path)}"
    return dict(sorted(out.items()))


def _dcp_assets(model: str | None, hf_assets: str | None) -> tuple[bool, str | None]:
    """(whether ``model`` is a torch DCP checkpoint folder, its assets folder or None)."""
    from mpitp.errors import UsageError
    from mpitp.replica.dcp import assets_dir, is_dcp

    if not model or not is_dcp(model):
        return False, None
    try:
        return True, assets_dir(model, hf_assets)
    except UsageError:
        return True, None


def tokenizer_files(directory: str) -> dict[str, str]:
    out = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            out[name] = f"{os.path.getsize(path)}:{_file_sha(path)}"
    return out


def _digest(files: dict[str, str]) -> str:
    return _sha(json.dumps(files, sort_keys=True).encode()) if files else "none"


def detail(model: str | None, tokenizer: str | None = None, revision: str | None = None,
           hf_assets: str | None = None) -> dict:
    """Per-file fingerprints, stored beside the identity so a refusal can name the file that changed. A torch DCP
    checkpoint (:func:`dcp_files`) has its tokenizer in its assets folder (``hf_assets``, or beside it)."""
    dcp, assets = _dcp_assets(model, hf_assets)
    if dcp:
        tdir = tokenizer or assets
        return {"model_files": dcp_files(model, assets), "tokenizer_files": tokenizer_files(tdir) if tdir else None}
    mdir = local_dir(model, revision)
    tdir = local_dir(tokenizer or model, revision if not tokenizer else None)
    return {"model_files": model_files(mdir) if mdir else None,
            "tokenizer_files": tokenizer_files(tdir) if tdir else None}


def identity(model: str | None, tokenizer: str | None = None, revision: str | None = None,
             d: dict | None = None, adapter: str | None = None, hf_assets: str | None = None) -> dict:
    """What resume compares besides the settings (keys :data:`IDENTITY_KEYS`); ``d``: :func:`detail` if known.
    ``adapter``: a LoRA adapter folder (``peft=``), known by the hash of its config and weights."""
    import lm_eval
    import transformers

    d = d if d is not None else detail(model, tokenizer, revision, hf_assets)
    extra = {}
    if adapter:
        from mpitp.replica.adapters import fingerprint

        extra["adapter"] = fingerprint(adapter)
    return {**extra, "weights": _digest(d["model_files"]) if d["model_files"] is not None else "not local",
            "tokenizer_files": _digest(d["tokenizer_files"]) if d["tokenizer_files"] is not None else "not local",
            "transformers_version": transformers.__version__,
            "lm_eval_version": getattr(lm_eval, "__version__", "unknown")}


def record(model: str | None, tokenizer: str | None = None, revision: str | None = None,
           adapter: str | None = None, hf_assets: str | None = None) -> dict:
    """The root attr ``fingerprint_json``: the identity entries and the per-file detail behind them."""
    d = detail(model, tokenizer, revision, hf_assets)
    return {"identity": identity(model, tokenizer, revision, d, adapter), **d}


def stored_fingerprint(on_disk: object) -> dict:
    """A file's ``fingerprint_json`` checked for the shape :func:`resume_differences` reads (a file is untrusted):
    a mapping whose ``identity`` is a mapping and whose file lists map names to ``size:hash`` text."""
    from mpitp.results.untrusted import BadInput, mapping

    mapping(on_disk, "fingerprint_json")
    mapping(on_disk.get("identity", {}), "fingerprint_json's identity")
    for group in ("model_files", "tokenizer_files"):
        files = mapping(on_disk.get(group) or {}, f"fingerprint_json's {group}")
        if not all(isinstance(v, str) and ":" in v for v in files.values()):
            raise BadInput(f"fingerprint_json's {group} are not 'size:hash' texts")
    return on_disk


def resume_differences(on_disk: dict | None, stored: dict, now: dict, cfg: EvalConfig) -> list[str]:
    """What changed on disk since the file was written, as ``weights 'a' in the file, 'b' now; changed on disk:
    model.safetensors content differs`` parts; none for a file written before fingerprints existed.

    Another model (or tokenizer) path is already named by the settings comparison; that its files differ too goes
    without saying, so only the same path's files are compared.
    """
    if not on_disk or "identity" not in on_disk:
        return []
    d = detail(cfg.model, cfg.tokenizer, cfg.revision, cfg.hf_assets)
    before, after = on_disk["identity"], identity(cfg.model, cfg.tokenizer, cfg.revision, d,
                                                  cfg.peft)
    skip = set()
    if stored.get("model") != now.get("model") or stored.get("revision") != now.get("revision"):
        skip.add("weights")
    if stored.get("peft") != now.get("peft"):
        skip.add("adapter")
    if (stored.get("tokenizer") or stored.get("model")) != (now.get("tokenizer") or now.get("model")):
        skip.add("tokenizer_files")
    out = [f"{k} {before.get(k)!r} in the file, {after.get(k)!r} now" for k in IDENTITY_KEYS
           if k not in skip and k in before and before.get(k) != after.get(k)]
    if any(k in ("weights", "tokenizer_files") and k not in skip and before.get(k) != after.get(k)
           for k in IDENTITY_KEYS if k in before):
        files = changed_files(on_disk, d)
        if files:
            out.append(f"changed on disk: {files}")
    return out


def changed_files(stored: dict | None, now: dict | None) -> str:
    """``model.safetensors (size 1024 -> 2048)`` for the files that differ between two :func:`detail` results."""
    parts = []
    for group in ("model_files", "tokenizer_files"):
        a, b = (stored or {}).get(group) or {}, (now or {}).get(group) or {}
        for name in sorted(set(a) | set(b)):
            if name not in a:
                parts.append(f"{name} added")
            elif name not in b:
                parts.append(f"{name} removed")
            elif a[name] != b[name]:
                sa, ha = a[name].split(":", 1)
                sb, hb = b[name].split(":", 1)
                if sa != sb:
                    what = f"size {sa} -> {sb}"
                elif "+" in ha and ha.split("+")[0] != hb.split("+")[0]:
                    what = "safetensors header (tensor names, shapes or dtypes) differs"
                else:
                    what = f"content differs (sha256 {ha.split('+')[-1][:8]} -> {hb.split('+')[-1][:8]})"
                parts.append(f"{name} {what}")
    return ", ".join(parts)
