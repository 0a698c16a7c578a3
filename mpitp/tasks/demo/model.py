"""A tiny, deterministic, random-weight Llama model for the offline demo.

``build_demo_model(out_dir)`` writes a complete Hugging Face checkpoint
(``config.json``, ``model.safetensors``, tokenizer files) that
``AutoModelForCausalLM`` / ``AutoTokenizer`` and lm-eval's ``hf`` model load
with no network access.  Everything is derived from the demo task texts and a
seed, so two builds with the same recipe are byte-for-byte identical in their
weights and tokenizer.

Shapes are chosen to exercise tensor parallelism:

* 8 attention heads and 4 KV heads, so tp = 1, 2, 4 divide both;
* intermediate size 128 and hidden size 64 (divisible by 1, 2, 4);
* vocabulary of 509 tokens (prime: not divisible by 2, 3 or 4) so vocab-parallel
  embeddings / LM heads get uneven shards;
* untied input embeddings and LM head.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpitp.digest import sha256_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TASKS_DIR = Path(__file__).resolve().parent / "tasks"

#: Name of the marker file written last into a finished model directory.
MARKER_FILE = "mpitp_demo.json"

#: Bump when the build recipe changes in a way not captured by the fields below.
RECIPE_VERSION = 1

DEMO_VOCAB_SIZE = 509
SPECIAL_TOKENS = {
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
}
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
}
# Standard deviations of the random weights.  Larger than a usual training
# init so the logits are far from uniform: greedy decoding then has clear
# winners and small numerical differences (e.g. between tensor-parallel
# degrees) do not flip argmaxes.
INIT = {
    "embed_std": 1.0,
    "linear_std_times_sqrt_fan_in": 1.0,
    "lm_head_std_times_sqrt_hidden": 2.5,
    "norm_mean": 1.0,
    "norm_std": 0.1,
}


# --------------------------------------------------------------------------- corpus
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def demo_corpus() -> list[str]:
    """The texts the demo tokenizer is trained on, in a fixed order."""
    texts: list[str] = []
    for row in _read_jsonl(TASKS_DIR / "mpitp_demo_ppl.jsonl"):
        texts.append(row["text"])
    for row in _read_jsonl(TASKS_DIR / "mpitp_demo_mc.jsonl"):
        texts.append(f"Question: {row['question']}\nAnswer: {row['choices'][row['answer']]}")
        texts.extend(row["choices"])
    for row in _read_jsonl(TASKS_DIR / "mpitp_demo_gen.jsonl"):
        texts.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
    return texts


def recipe(seed: int = 0) -> dict[str, Any]:
    corpus_sha = hashlib.sha256("\x00".join(demo_corpus()).encode("utf-8")).hexdigest()
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": int(seed),
        "vocab_size": DEMO_VOCAB_SIZE,
        "special_tokens": SPECIAL_TOKENS,
        "model_config": MODEL_CONFIG,
        "init": INIT,
        "corpus_sha256": corpus_sha,
    }


def recipe_hash(seed: int = 0) -> str:
    blob = json.dumps(recipe(seed), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- tokenizer
def build_demo_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the demo texts (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [
        SPECIAL_TOKENS["unk_token"],
        SPECIAL_TOKENS["bos_token"],
        SPECIAL_TOKENS["eos_token"],
        SPECIAL_TOKENS["pad_token"],
    ]
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(demo_corpus(), trainer=trainer)
    if tok.get_vocab_size() != DEMO_VOCAB_SIZE:
        raise RuntimeError(
            f"demo tokenizer has {tok.get_vocab_size()} tokens, expected {DEMO_VOCAB_SIZE}"
        )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        padding_side="left",
        **SPECIAL_TOKENS,
    )
    return hf_tok


# --------------------------------------------------------------------------- weights
def _param_generator(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little"))


def _init_weights(model, seed: int) -> None:
    """Overwrite every parameter from a per-name seeded generator."""
    import torch

    hidden = MODEL_CONFIG["hidden_size"]
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            g = _param_generator(seed, name)
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("embed_tokens.weight"):
                val = noise * INIT["embed_std"]
            elif name.startswith("lm_head"):
                val = noise * (INIT["lm_head_std_times_sqrt_hidden"] / hidden**0.5)
            elif p.dim() == 1:  # RMSNorm weights
                val = INIT["norm_mean"] + INIT["norm_std"] * noise
            elif p.dim() == 2:  # nn.Linear weight, shape (out, in)
                val = noise * (INIT["linear_std_times_sqrt_fan_in"] / p.shape[1] ** 0.5)
            else:  # pragma: no cover - Llama has no other parameter shapes
                raise RuntimeError(f"unexpected parameter {name} {tuple(p.shape)}")
            p.copy_(val.to(p.dtype))


def _build_model(tokenizer, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_CONFIG,
    )
    # Construction runs transformers' own random init; keep it from touching
    # the caller's global RNG state.  All parameters are overwritten anyway.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    model = model.to(torch.float32)
    _init_weights(model, seed)
    model.eval()
    model.generation_config.do_sample = False
    return model


def _save(model, tokenizer, path: Path) -> None:
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)  # safetensors
        tokenizer.save_pretrained(path)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    # Some writers create files 0600; make them readable like normal files.
    umask = os.umask(0)
    os.umask(umask)
    for p in path.iterdir():
        if p.is_file():
            p.chmod(0o666 & ~umask)


# --------------------------------------------------------------------------- cache
def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        with open(out_dir / MARKER_FILE, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_complete(out_dir: str | os.PathLike, seed: int = 0) -> bool:
    """True if ``out_dir`` holds an intact demo model built with this recipe."""
    out = Path(out_dir)
    marker = _read_marker(out)
    if not marker or marker.get("recipe_hash") != recipe_hash(seed):
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return False
    for name, digest in files.items():
        path = out / name
        if not path.is_file() or sha256_file(path) != digest:
            return False
    return True


def build_demo_model(out_dir: str | os.PathLike, seed: int = 0) -> str:
    """Build (or reuse) the demo model + tokenizer in ``out_dir``.

    Returns the absolute path of ``out_dir``.  If ``out_dir`` already holds a
    complete model built with the same recipe (checked through
    ``mpitp_demo.json``: recipe hash and per-file SHA-256) it is reused as is.
    Otherwise the model is built in a temporary sibling directory and its files
    are moved into ``out_dir`` with atomic renames, the marker last, so
    concurrent builders (e.g. several MPI ranks) never expose a partial model.
    """
    out = Path(out_dir).expanduser().resolve()
    if is_complete(out, seed):
        return str(out)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tokenizer = build_demo_tokenizer()
        model = _build_model(tokenizer, seed)
        _save(model, tokenizer, tmp)
        files = {
            p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()
        }
        marker = {
            "recipe_hash": recipe_hash(seed),
            "recipe": recipe(seed),
            "vocab_size": len(tokenizer),
            "files": files,
        }
        with open(tmp / MARKER_FILE, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2, sort_keys=True)
            f.write("\n")

        out.mkdir(parents=True, exist_ok=True)
        # Drop files of an older demo build that this build does not overwrite
        # (e.g. after a recipe change); never touch anything else in out_dir.
        old = _read_marker(out)
        if old and isinstance(old.get("files"), dict):
            for name in old["files"]:
                if name not in files and "/" not in name and name != MARKER_FILE:
                    try:
                        (out / name).unlink()
                    except FileNotFoundError:
                        pass
        for name in files:
            os.replace(tmp / name, out / name)
        os.replace(tmp / MARKER_FILE, out / MARKER_FILE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
