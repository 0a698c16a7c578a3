"""What a stage holds (``--stage-dir``, :mod:`mpitp.replica.staging`): the files transformers reads, and a key of them.

Rank 0 plans once for every node (:func:`plan_stage`); a stage's folder is ``<name>-<key>``, where the key changes
when a file is rewritten in place (sizes, mtimes, headers, the sampled blocks the results file's fingerprint reads),
so a rewritten checkpoint is staged again instead of reused. Only a local directory or a model already in the local
Hugging Face cache is planned: nothing is downloaded to be staged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

from mpitp.digest import safetensors_header, sampled_sha

EXTRA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".py", ".tiktoken", ".vocab")
"""Besides weights: config, shard index, generation config, tokenizer files, remote code."""
DCP_METADATA = ".metadata"
SMALL = 1 << 20


@dataclass(frozen=True)
class StagePlan:
    """What to copy from where (paths relative to ``source``), and the folder name ``<name>-<key>``."""

    source: str
    files: tuple[tuple[str, int], ...]  # (relative path, size)
    folder: str
    key: str
    samples: tuple[str, ...] = ()  # per file: the sampled digest the results file's fingerprint records (sampled_sha)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


def _weight_files(directory: str) -> list[str]:
    """The weight files transformers would read: safetensors when there are any, else ``*.bin`` (a snapshot that has
    both, or TF/Flax/ONNX exports beside them, copies only what is loaded)."""
    names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    safetensors = [n for n in names if n.endswith(".safetensors")]
    return safetensors or [n for n in names if n.endswith(".bin")]


def model_files(directory: str, subfolder: str | None = None) -> list[str]:
    """Relative paths of the files to stage: weights, config, tokenizer and generation files, at the top level and in
    ``subfolder`` (``--model_args subfolder=``). Hidden files are left out, but for a torch DCP checkpoint's
    ``.metadata`` (its index, staged with the ``*.distcp`` shards)."""
    out = []
    for sub in dict.fromkeys(["", subfolder or ""]):
        where = os.path.join(directory, sub) if sub else directory
        if not os.path.isdir(where):
            continue
        names = sorted(n for n in os.listdir(where) if not n.startswith(".") and os.path.isfile(os.path.join(where, n)))
        chosen = set(_weight_files(where)) | {n for n in names if n.endswith(EXTRA_SUFFIXES)}
        if os.path.isfile(os.path.join(where, DCP_METADATA)):  # a torch DCP checkpoint: its index and its shards
            names.append(DCP_METADATA)
            chosen |= {DCP_METADATA} | {n for n in names if n.endswith(".distcp")}
        out += [os.path.join(sub, n) if sub else n for n in names if n in chosen]
    return sorted(out)


def _file_digest(path: str, size: int) -> str:
    """Small files whole; a safetensors file by its header (names, dtypes, shapes, offsets); size and mtime besides."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SMALL:
            h.update(f.read())
        elif path.endswith(".safetensors"):
            h.update(safetensors_header(f)[0])
    return h.hexdigest()[:16]


def content_key(source: str, files: list[str]) -> tuple[tuple[tuple[str, int], ...], str, tuple[str, ...]]:
    """((file, size) ..., a 12-hex key, each file's sampled digest): the same files with the same sizes, modification
    times, headers (small files: contents) and sampled blocks give the same key, so a checkpoint rewritten in place is
    staged again rather than reused. Reading whole multi-GB shards for a hash would cost what the stage saves; the
    sampled blocks are those the results file's fingerprint reads (1 MiB a file), so the two agree."""
    entries, sized, samples = [], [], []
    for rel in files:
        path = os.path.join(source, rel)
        st = os.stat(path)
        sample = sampled_sha(path, st.st_size)
        entries.append((rel, st.st_size, st.st_mtime_ns, _file_digest(path, st.st_size), sample))
        sized.append((rel, st.st_size))
        samples.append(sample)
    text = json.dumps([os.path.realpath(source), entries])
    return tuple(sized), hashlib.sha256(text.encode()).hexdigest()[:12], tuple(samples)


def local_source(model: str, revision: str | None = None) -> str | None:
    """The local directory of ``model``: itself, or its snapshot in the local Hugging Face cache (never downloads)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return os.path.abspath(path)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or not a hub id: nothing local to stage
        return None


def plan_stage(model: str, revision: str | None = None, subfolder: str | None = None) -> StagePlan | None:
    """Rank 0's plan for every node, or None when the model is not on local storage (it is then loaded as before)."""
    source = local_source(model, revision)
    if source is None:
        return None
    if subfolder and (os.path.isabs(subfolder) or ".." in subfolder.split("/")):
        return None  # loaded as given: a stage holds the model's own folder only
    files = model_files(source, subfolder)
    if not files:
        return None
    sized, key, samples = content_key(source, files)
    base = model.rstrip("/").replace("/", "--") if source != os.path.abspath(os.path.expanduser(model)) \
        else os.path.basename(source.rstrip("/"))
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("._") or "model"
    return StagePlan(source=source, files=sized, folder=f"{name[:80]}-{key}", key=key, samples=samples)


def expand_dir(stage_dir: str, node_name: str) -> str:
    """``~``, ``$VARS`` and ``{node}`` expanded on this rank: node-local scratch often has a per-node name."""
    return os.path.abspath(os.path.expandvars(os.path.expanduser(stage_dir.replace("{node}", node_name))))
