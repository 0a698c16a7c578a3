"""Bytes read per node while loading, 2 nodes x 4 ranks (dp=4 x tp=2), without and with ``--stage-dir``.

Needs the emulated nodes (``hpc/local-nodes.sh start``) and MPICH. Builds a random ~84 MB Llama (GPT-2 tokenizer) in
/tmp once, then per variant: drops the page cache of the model's (and the stage's) files with
``posix_fadvise(DONTNEED)`` (no root needed; ``/proc/sys/vm/drop_caches`` is not writable here), launches one
evaluation with ``MPITP_TEST_IO_REPORT=1`` and sums each rank's ``/proc/self/io`` deltas from just before the stage
(after torch started) to the end of loading, per node. See bench/README.md "Checkpoints read once per node".

    python bench/bench_stage.py [--variants before,stage-first,stage-reused]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

MODEL = Path("/tmp/bench-stage-llama84m")
STAGE = Path("/tmp/bench-stage-dir")
TASKS = Path("/tmp/bench-stage-tasks")
TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "gpt2"
HOSTS = "nodea:4,nodeb:4"
LINE = re.compile(r"io: (before loading|model loaded): rank=(\d+) node=([A-Za-z0-9_.-]+) local_rank=(\d+) "
                  r"rchar=(\d+) read_bytes=(\d+)")


def make_model() -> None:
    if (MODEL / "model.safetensors").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50257, hidden_size=320, intermediate_size=864, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=50256, eos_token_id=50256)
    LlamaForCausalLM(cfg).save_pretrained(MODEL)
    for f in ("merges.txt", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"):
        shutil.copy(TOKENIZER / f, MODEL)


def make_tasks() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.tasks import materialize_test_tasks

    TASKS.mkdir(exist_ok=True)
    materialize_test_tasks(TASKS)


def evict(*roots: Path) -> None:
    for root in roots:
        for d, _, files in os.walk(root):
            for f in files:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def run(label: str, extra: list[str]) -> str:
    evict(MODEL, STAGE)
    cmd = ["mpiexec", "-launcher", "ssh", "-launcher-exec", "/var/tmp/mpitp-nodes/ssh", "-iface", "mpitpbr0",
           "-hosts", HOSTS, "-genv", "UCX_TLS", "tcp,self", "-n", "8", sys.executable, "-m", "mpitp", "eval",
           "--model", str(MODEL), "--tasks", "arc_easy_local", "--include-path", str(TASKS), "--limit", "2",
           "--tp", "2", "--timeout", "300", "--output", f"/tmp/bench-stage-{label}.h5", "--overwrite", *extra]
    env = {**os.environ, "MPITP_TEST_IO_REPORT": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if p.returncode:
        raise SystemExit(f"{label}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return p.stderr


def per_node(stderr: str) -> dict:
    seen: dict = collections.defaultdict(dict)
    for m in LINE.finditer(stderr):
        seen[(m[3], int(m[2]))][m[1]] = (int(m[5]), int(m[6]), int(m[4]))
    out: dict = collections.defaultdict(lambda: dict(ranks=0, rchar=0, read_bytes=0, leader_rchar=0, leader_read=0))
    for (node, _), d in seen.items():
        (r0, b0, _), (r1, b1, local) = d["before loading"], d["model loaded"]
        n = out[node]
        n["ranks"] += 1
        n["rchar"] += r1 - r0
        n["read_bytes"] += b1 - b0
        if local == 0:
            n["leader_rchar"], n["leader_read"] = r1 - r0, b1 - b0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="before,stage-first,stage-reused")
    args = ap.parse_args()
    make_model()
    make_tasks()
    shutil.rmtree(STAGE, ignore_errors=True)
    stage = ["--stage-dir", f"{STAGE}/{{node}}"]
    print("| variant | node | ranks | rchar, all ranks (MB) | of which local rank 0 | read_bytes, all ranks (MB) | "
          "of which local rank 0 | stage copied (MB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label in args.variants.split(","):
        stderr = run(label, [] if label == "before" else stage)
        copied = re.search(r"([\d.]+) MB copied in all", stderr)
        for node, n in sorted(per_node(stderr).items()):
            print(f"| {label} | {node} | {n['ranks']} | {n['rchar'] / 1e6:.1f} | {n['leader_rchar'] / 1e6:.1f} | "
                  f"{n['read_bytes'] / 1e6:.1f} | {n['leader_read'] / 1e6:.1f} | "
                  f"{(float(copied[1]) / 2) if copied else 0:.1f} |", flush=True)


if __name__ == "__main__":
    main()
