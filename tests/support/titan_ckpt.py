"""A torchtitan-style training run on disk, from the real stories260K, and its Hugging Face twins as references.

``python tests/support/titan_ckpt.py OUT`` (or :func:`write_run`) writes::

    OUT/assets/            config.json (untied head: torchtitan's Llama 3 keeps output.weight) + tokenizer files
    OUT/checkpoint/step-1  model only, torchtitan names at the top level (torchtitan's last "model_only" save), as
                           FSDP over 2 ranks saves it: each tensor in 2 dim-0 chunks, in 2 files
    OUT/checkpoint/step-2  a full training state: model names at the top level beside optimizer, lr_scheduler,
                           dataloader and train_state entries (torchtitan flattens the model's state dict so)
    OUT/checkpoint/step-10 the model under a ``model.`` prefix, plus train_state
    OUT/hf/step-N          the same weights as Hugging Face folders (save_pretrained), the references

Each step's weights are stories260K's perturbed with its own seed; q/k rows are written in torchtitan's (Meta's
interleaved) rotary order, HF names mapped with torchtitan's own table. Steps 2 and 10 are saved with
``torch.distributed.checkpoint.save(..., no_dist=True)`` (one process, one chunk per tensor), step 1 by
:func:`save_chunked`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

STEPS = {"step-1": ("model_only", 1), "step-2": ("full", 2), "step-10": ("prefixed", 10)}


def _stories() -> Path:
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent))
    from support import STORIES

    return Path(STORIES)


def write_assets(dst: Path) -> Path:
    src = _stories()
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "SOURCE.txt", "config.json"):
            shutil.copyfile(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def step_weights(seed: int) -> dict:
    """stories260K's weights perturbed by ``seed`` (an untied head: a perturbed copy of the embedding)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(_stories() / "model.safetensors")
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    g = torch.Generator().manual_seed(seed)
    return {k: (t + torch.randn(t.shape, generator=g) * 0.05 * t.float().std()).contiguous()
            for k, t in tensors.items()}


def write_run(out: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoConfig

    from mpitp.replica.dcp import hf_to_titan_names

    out = Path(out)
    assets = write_assets(out / "assets")
    config = AutoConfig.from_pretrained(assets)
    paths = {"assets": assets}
    for step, (kind, seed) in STEPS.items():
        hf = step_weights(seed)
        ref = write_hf_twin(hf, assets, out / "hf" / step)
        titan = hf_to_titan_names(hf, config)
        if kind == "model_only":  # as saved by FSDP over 2 ranks: 2 chunks per tensor, 2 files
            save_chunked(titan, out / "checkpoint" / step)
            paths[step] = out / "checkpoint" / step
            paths[f"hf/{step}"] = ref
            continue
        elif kind == "full":
            optim = {"state": {k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.ones_like(v),
                                   "step": torch.tensor(float(seed))} for k, v in titan.items()},
                     "param_groups": {k: {"lr": 3e-4, "betas": [0.9, 0.95]} for k in titan}}
            state = {**titan, "optimizer": optim, "lr_scheduler": {"lr_scheduler_0": {"last_epoch": seed}},
                     "dataloader": {"dp_rank_0": b"\x00state"}, "train_state": {"step": seed, "ntokens_seen": 1000}}
        else:
            state = {"model": titan, "train_state": {"step": seed}}
        d = out / "checkpoint" / step
        save(state, d)
        paths[step] = d
        paths[f"hf/{step}"] = ref
    return paths


def write_hf_twin(hf: dict, assets: Path, ref: Path) -> Path:
    """``hf`` (HF names) saved as a Hugging Face folder with the assets' tokenizer: a step's reference."""
    from transformers import AutoConfig, LlamaForCausalLM

    model = LlamaForCausalLM(AutoConfig.from_pretrained(assets))
    model.load_state_dict(hf, strict=True)
    model.save_pretrained(ref)
    for f in assets.iterdir():
        if f.name != "config.json":
            shutil.copyfile(f, ref / f.name)
    return ref


def write_late_step(assets: Path, step_dir: Path, seed: int, hf_twin: Path, pause_s: float = 0.0) -> None:
    """A model-only step as torchtitan writes it while a watcher looks on: the ``*.distcp`` shards first, then (after
    ``pause_s``, a slow file system) ``.metadata`` last; and its HF twin at ``hf_twin``, written before the step."""
    from transformers import AutoConfig

    from mpitp.replica.dcp import hf_to_titan_names

    hf = step_weights(seed)
    write_hf_twin(hf, assets, hf_twin)
    save_chunked(hf_to_titan_names(hf, AutoConfig.from_pretrained(assets)), step_dir, pause_s=pause_s)


def save(state: dict, path: Path) -> None:
    """``dcp.save`` in this one process (torch warns that it assumes so: it is meant)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def save_chunked(state: dict, path: Path, ranks: int = 2, pause_s: float = 0.0) -> None:
    """``state`` (tensors only) as torchtitan's FSDP save over ``ranks`` ranks lays it out: each tensor in ``ranks``
    dim-0 chunks (torch's ``chunk`` split, so a dimension of 5 gives 3 + 2), chunk ``r`` in rank ``r``'s file
    ``__r_0.distcp``, each chunk a ``torch.save`` record, and one ``.metadata`` (pickled, as ``FileSystemWriter``
    writes it) last, ``pause_s`` after the shards. DCP's own ``load`` reads it (the tests check that it does)."""
    import io
    import pickle
    import time

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    path.mkdir(parents=True, exist_ok=True)
    files = [open(path / f"__{r}_0.distcp", "wb") for r in range(ranks)]
    md, storage = {}, {}
    try:
        for key, t in state.items():
            chunks, start = [], 0
            for r, part in enumerate(t.chunk(ranks, dim=0)):
                offsets = torch.Size([start] + [0] * (t.dim() - 1))
                buf = io.BytesIO()
                torch.save(part.clone(), buf)
                f = files[r]
                storage[MetadataIndex(key, offsets)] = _StorageInfo(f.name.rsplit("/", 1)[-1], f.tell(),
                                                                    len(buf.getvalue()))
                f.write(buf.getvalue())
                chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=part.shape))
                start += part.shape[0]
            md[key] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape, chunks)
    finally:
        for f in files:
            f.close()
    time.sleep(pause_s)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=md, storage_data=storage), f)


if __name__ == "__main__":
    print(json.dumps({k: str(v) for k, v in write_run(Path(sys.argv[1])).items()}, indent=2))
