"""Shared helpers for mpitp's comparison benchmarks (``bench/bench_*.py``).

* Random-weight Llama checkpoints with the real GPT-2 tokenizer (vocab 50257), built once and cached under
  ``bench/.cache/`` (:func:`small_model`: hidden 512, 8 layers, ~77M params; :func:`mid_model`: hidden 640,
  8 layers, ~104M params; :func:`big_model`: hidden 1024, 16 layers, ~309M params; :func:`large_model`: hidden
  2048, 16 layers, ~1.02B params, memory bench only).
* The offline lm-eval tasks of ``tests/tasks`` (real data from ``../shared/data``) plus one bench-only task,
  ``gen256_local`` (greedy generation of exactly 256 tokens after a ~150-token WikiText prompt: its stop string
  never occurs).
* Runners that launch ``mpiexec -n N ... mpitp eval``, ``python ... lm_eval.simple_evaluate`` and
  ``torchrun --nproc-per-node N ... simple_evaluate(model="hf", model_args="...,tp_plan=auto")`` through the one
  driver :mod:`bench._driver`, which times the evaluation *inside* each process (start-up and imports excluded)
  and reports every rank's peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``).

Every process runs one torch thread (``OMP_NUM_THREADS=1``, mpitp ``--threads 1``, ``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
CACHE = BENCH / ".cache"
SHARED = ROOT.parent / "shared"
GPT2_TOKENIZER = SHARED / "tokenizers" / "gpt2"
STORIES = SHARED / "models" / "stories260K"
BIN = ROOT / ".venv" / "bin"
PYTHON = str(BIN / "python") if (BIN / "python").exists() else sys.executable
MPIEXEC = next((str(p) for p in (BIN / "mpiexec", Path(sys.executable).parent / "mpiexec") if p.exists()),
               shutil.which("mpiexec") or "mpiexec")  # the last: on the PATH (bench/gpu_carry.sh)
TORCHRUN = str(BIN / "torchrun") if (BIN / "torchrun").exists() else str(Path(sys.executable).parent / "torchrun")
DRIVER = str(BENCH / "_driver.py")

SMALL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
             intermediate_size=1376, max_position_embeddings=1024)
MID = dict(hidden_size=640, num_hidden_layers=8, num_attention_heads=10, num_key_value_heads=10,
           intermediate_size=1728, max_position_embeddings=1024)
BIG = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
           intermediate_size=2816, max_position_embeddings=1024)
LARGE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
             intermediate_size=5504, max_position_embeddings=1024)
XL = {**LARGE, "num_hidden_layers": 20}


def parser(doc: str, limit: int, batch_size: int | None = None, reps: int = 2, limit_help: str | None = None):
    """The options every comparison script shares (``--limit``, ``--batch-size`` where it batches, ``--reps``);
    a script adds its own to the parser this returns."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--limit", type=int, default=limit, help=limit_help)
    if batch_size is not None:
        ap.add_argument("--batch-size", type=int, default=batch_size)
    ap.add_argument("--reps", type=int, default=reps)
    return ap


def say(*args) -> None:
    print(*args, flush=True)


def bench_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine() -> str:
    cpu = cpu_model()
    import torch  # noqa: PLC0415

    return (f"{platform.node()}: {os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, "
            f"python {platform.python_version()}, torch {torch.__version__}; {loadavg()}")


def loadavg() -> str:
    """The machine's load average: on a shared machine, how much CPU other work was taking."""
    try:
        one, five, fifteen = open("/proc/loadavg").read().split()[:3]
        return f"load average {one} {five} {fifteen} (1/5/15 min) on {os.cpu_count()} cores"
    except OSError:
        return "load average unknown"


# ----------------------------------------------------------------------------------------------------- models


def _build_llama(name: str, shape: dict, seed: int = 0) -> str:
    out = CACHE / "models" / name
    if (out / "DONE").exists():
        return str(out)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    say(f"[common] building random-weight Llama {name} ({shape}) under {out} ...")
    tok = AutoTokenizer.from_pretrained(str(GPT2_TOKENIZER))
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    n = sum(p.numel() for p in model.parameters())
    (out / "DONE").write_text(json.dumps({"params": n, **shape}))
    return str(out)


def small_model() -> str:
    """~77M-param Llama (hidden 512, 8 layers, 8 heads, 8 KV heads), GPT-2 vocab 50257."""
    return _build_llama("llama-h512-l8-gpt2", SMALL)


def mid_model() -> str:
    """~104M-param Llama (hidden 640, 8 layers, 10 heads, intermediate 1728), GPT-2 vocab 50257: the base of the
    adapter bench (fine-tuning campaigns adapt bases of about this size and up)."""
    return _build_llama("llama-h640-l8-gpt2", MID)


def big_model() -> str:
    """~309M-param Llama (hidden 1024, 16 layers, 16 heads), GPT-2 vocab 50257: weights dominate the memory."""
    return _build_llama("llama-h1024-l16-gpt2", BIG)


def large_model() -> str:
    """~1.02B-param Llama (hidden 2048, 16 layers, 16 heads, intermediate 5504), GPT-2 vocab 50257: 3.8 GiB of
    float32 weights against ~0.4 GB of libraries per process. Building it once takes ~25 s and 4.4 GB of RAM."""
    return _build_llama("llama-h2048-l16-gpt2", LARGE)


def xl_model() -> str:
    """~1.22B-param Llama: the large model with 20 layers instead of 16 (4.5 GiB float32). Weights dominate more:
    the memory ratio approaches 0.5 as the libraries' fixed ~0.4 GB share shrinks."""
    return _build_llama("llama-h2048-l20-gpt2", XL)


def n_params(model_dir: str) -> int:
    """Parameter count of a safetensors checkpoint, one file or several (from the tensor shapes; nothing loaded)."""
    import math

    from safetensors import safe_open

    n = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                n += math.prod(f.get_slice(k).get_shape())
    return n


# ----------------------------------------------------------------------------------------------------- tasks

GEN_TASK = """\
# Bench-only: greedy generation of exactly max_gen_toks tokens (the stop string never occurs), the prompt being the
# first 600 characters (~150 GPT-2 tokens) of a WikiText-2 test document.
task: gen256_local
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{page[:600]}}}}"
doc_to_target: "{{{{page[600:700]}}}}"
generation_kwargs:
  until: ["<<<never-generated-stop>>>"]
  max_gen_toks: 256
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def include_path() -> str:
    """The offline test tasks (``tests/tasks``) plus ``gen256_local``, materialised under ``bench/.cache/tasks``."""
    sys.path.insert(0, str(ROOT))
    from tests.support.tasks import materialize_test_tasks

    out = CACHE / "tasks"
    path = materialize_test_tasks(out)
    data = SHARED / "data" / "wikitext2" / "wikitext-2-raw-v1_test_documents.jsonl"
    (out / "gen256_local.yaml").write_text(GEN_TASK.format(data=data))
    return path


# ----------------------------------------------------------------------------------------------------- runners


def _parse(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("BENCHRESULT "):
            out.append(json.loads(line[len("BENCHRESULT "):]))
    return sorted(out, key=lambda r: r["rank"])


def _run(cmd: list[str], env: dict, timeout: float, label: str) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
    outer = time.perf_counter() - t0
    ranks = _parse(p.stdout)
    if p.returncode != 0 or not ranks:
        tail = "\n".join((p.stdout + "\n" + p.stderr).splitlines()[-40:])
        raise RuntimeError(f"{label} failed (rc {p.returncode}): {' '.join(cmd)}\n{tail}")
    return dict(label=label, cmd=" ".join(cmd), outer_s=outer, ranks=ranks, stdout=p.stdout, stderr=p.stderr,
                time_s=max(r["time_s"] for r in ranks), cpu_s=sum(r["cpu_s"] for r in ranks),
                peak_rss_mb=[r["maxrss_kb"] / 1024 for r in ranks])


def run_mpitp(n: int, model: str, tasks: str, *, tp: int = 1, batch_size: int = 1, limit=None,
              gen_kwargs: str | None = None, no_cache: bool = False, extra: list[str] | None = None,
              timeout: float = 900, label: str | None = None, tree: str | None = None,
              env: dict | None = None) -> dict:
    """``mpiexec -n N python bench/_driver.py mpitp -- eval ...`` ; returns times, peak RSS and mpitp's stats.
    ``tree``: import mpitp from that checkout (``PYTHONPATH``) instead, e.g. a copy of an earlier commit; ``env``:
    extra environment variables (e.g. ``MPITP_TESTING=1`` and an ``MPITP_TEST_*`` hook)."""
    out = CACHE / "out" / f"mpitp-{os.getpid()}-{time.monotonic_ns()}.h5"
    out.parent.mkdir(parents=True, exist_ok=True)
    args = ["eval", "--model", model, "--tasks", tasks, "--tp", str(tp), "--batch-size", str(batch_size),
            "--threads", "1", "--include-path", include_path(), "--output", str(out), "--overwrite"]
    if limit is not None:
        args += ["--limit", str(limit)]
    if gen_kwargs:
        args += ["--gen-kwargs", gen_kwargs]
    args += extra or []
    cmd = [MPIEXEC, "-n", str(n), PYTHON, DRIVER, "mpitp"] + (["--no-cache"] if no_cache else []) + ["--"] + args
    r = _run(cmd, bench_env(**({"PYTHONPATH": tree} if tree else {}), **(env or {})), timeout,
             label or f"mpitp n={n} tp={tp}")
    root = r["ranks"][0]
    r["stats"] = root.get("stats")  # every DP group's counters, exact (incl. tp_score_bytes)
    r["mpitp_wall_s"] = root.get("mpitp_wall_s")
    r["h5_stats"] = read_h5_stats(str(out))
    r["output"] = str(out)
    return r


def run_lm_eval(model: str, tasks: str, *, batch_size: int = 1, limit=None, nproc: int = 1, tp_plan: bool = False,
                gen_kwargs: str | None = None, no_cache: bool = False, log_samples: bool = False,
                timeout: float = 900, label: str | None = None) -> dict:
    """lm-eval's HF model: one process, or ``torchrun --nproc-per-node N`` with ``tp_plan=auto``."""
    model_args = f"pretrained={model},dtype=float32" + (",tp_plan=auto" if tp_plan else ",device=cpu")
    spec = dict(model_args=model_args, tasks=tasks.split(","), include_path=include_path(), batch_size=batch_size,
                limit=limit, gen_kwargs=gen_kwargs, no_cache=no_cache, log_samples=log_samples)
    if nproc > 1:
        cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(29500 + os.getpid() % 1000),
               DRIVER, "lmeval", json.dumps(spec)]
    else:
        cmd = [PYTHON, DRIVER, "lmeval", json.dumps(spec)]
    return _run(cmd, bench_env(), timeout, label or f"lm_eval nproc={nproc} tp_plan={tp_plan}")


def read_h5_stats(path: str) -> dict | None:
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as f:
            if "stats" not in f:
                return None
            return {k: f["stats"][k][()].tolist() for k in f["stats"].keys()}
    except OSError:
        return None


def fmt_table(rows: list[list], header: list[str]) -> str:
    rows = [list(r) + [""] * (len(header) - len(r)) for r in rows]
    cells = [header] + [[c if isinstance(c, str) else f"{c:.3f}" if isinstance(c, float) else str(c) for c in r]
                        for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


RUN_HEADER = ["rep", "run", "eval wall s", "eval CPU s (all ranks)", "launch-to-exit s", "peak RSS MB per rank"]


def run_row(rep: int, label: str, r: dict) -> list:
    """One table row for a run: in-process wall time (slowest rank), CPU time summed over ranks, outer time, RSS."""
    return [rep, label, r["time_s"], r["cpu_s"], r["outer_s"], " ".join(f"{x:.0f}" for x in r["peak_rss_mb"])]


def paired(a: list[float], b: list[float]) -> float:
    """Median over repetitions of a[i] / b[i]: each pair ran back to back, so slow phases of a shared machine cancel
    better than in a ratio of medians."""
    return median([x / y for x, y in zip(a, b)])


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
