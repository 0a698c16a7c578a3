"""GPU drill: mpitp on one (or more) GPUs against single-process ``lm_eval --model hf`` on the same device.

    python bench/gpu_drill.py                       # on a GPU machine (see bench/README.md for a bare image)
    python bench/gpu_drill.py --device cpu --dry    # the same logic on CPU with a tiny model (what CI runs)

Cases, all in one run, one table at the end:

* ``lm_eval --model hf`` (one process, ``device=cuda``) in float32 and bfloat16: the references;
* mpitp tp=1 in float32 (parity: every request ``|d| <= 1e-5 * max(1, |ll|)``, same greedy flags, same
  generations) and in bfloat16 (its error against the float32 reference, beside lm-eval's own bfloat16 error);
* dp=2 and dp=4: 2 and 4 ranks sharing the one GPU (``--device cuda``: every rank picks ``cuda:0`` when one GPU
  is visible), float32 parity;
* the KV-cached generation path: the generation task runs greedy ``generate`` with the cache (mpitp's default);
* tp=2 over NCCL only when at least 2 GPUs are visible (NCCL cannot put two ranks of one communicator on one GPU).

Per case: parity (max relative |d ll|, mismatching flags/generations), evaluation wall time measured inside the
processes (start-up excluded), tokens/s (scored + generated tokens of the run over that time) and the ratio to
lm-eval's, and peak GPU memory per rank (``torch.cuda.max_memory_allocated``; RSS on CPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import common  # noqa: E402
from common import DRIVER, PYTHON, _run, bench_env, fmt_table, include_path, say  # noqa: E402

TASKS = "arc_easy_local,wikitext_local,gsm8k_local"


def lm_eval_case(model: str, device: str, dtype: str, tasks: str, limit: int, batch_size: int, gen_kwargs: str,
                 out_dir: Path) -> dict:
    samples = out_dir / f"lmeval-{dtype}.json"
    spec = dict(model_args=f"pretrained={model},dtype={dtype},device={device}", tasks=tasks.split(","),
                include_path=include_path(), batch_size=batch_size, limit=limit, gen_kwargs=gen_kwargs,
                log_samples=True, samples_out=str(samples))
    r = _run([PYTHON, DRIVER, "lmeval", json.dumps(spec)], bench_env(), 3600, f"lm_eval hf {dtype}")
    from support.parity import reference_requests

    r["requests"] = reference_requests(json.loads(samples.read_text()))
    return r


def mpitp_case(n: int, tp: int, model: str, device: str, dtype: str, tasks: str, limit: int, batch_size: int,
               gen_kwargs: str) -> dict:
    r = common.run_mpitp(n, model, tasks, tp=tp, batch_size=batch_size, limit=limit, gen_kwargs=gen_kwargs,
                         extra=["--device", device, "--dtype", dtype, "--bootstrap-iters", "0"], timeout=3600,
                         label=f"mpitp n={n} tp={tp} {dtype}")
    from support.parity import mpitp_requests

    r["requests"] = mpitp_requests(r["output"], tasks.split(","))
    return r


def parity(ref: dict, got: dict) -> tuple[float, int, int]:
    """(max relative |d ll|, flag or generation mismatches, requests compared)."""
    from support.parity import compare_requests

    if not ref or not got:
        raise RuntimeError(f"nothing to compare: {len(ref)} reference and {len(got)} mpitp requests")
    worst, problems = compare_requests(ref, got)
    mism = sum(1 for p in problems if "is_greedy" in p or "generation" in p or "keys differ" in p)
    return worst, mism, len(set(ref) & set(got))


def tokens_of(path: str, tasks: str) -> int:
    from mpitp.results.rows import read_requests

    return int(sum(read_requests(path, t)["n_tokens"].sum() for t in tasks.split(",")))


def memory(r: dict) -> str:
    ranks = r["ranks"]
    if all("gpu_peak_mb" in x for x in ranks):
        return "GPU " + " ".join(f"{x['gpu_peak_mb']:.0f}" for x in ranks) + " MB"
    return "RSS " + " ".join(f"{x['maxrss_kb'] / 1024:.0f}" for x in ranks) + " MB"


def main(argv=None) -> int:
    ap = common.parser(__doc__, limit=100, batch_size=8, reps=1)
    ap.add_argument("--device", default="cuda", help="cuda (the drill) or cpu (--dry: the logic only)")
    ap.add_argument("--dry", action="store_true", help="tiny model (stories260K), tiny limit: checks the script")
    ap.add_argument("--model", default=None, help="default: bench's 77M random Llama (GPT-2 vocab); --dry: stories")
    ap.add_argument("--tasks", default=None, help=f"default {TASKS} (--dry: arc_easy_local,gsm8k_local)")
    ap.add_argument("--dp", default="2,4", help="DP sizes to run as ranks sharing the one GPU")
    ap.add_argument("--gen-kwargs", default="max_gen_toks=64")
    args = ap.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if args.device.startswith("cuda") and gpus == 0:
        say("gpu_drill: --device cuda but torch sees no GPU (use --device cpu --dry to check the script)")
        return 2
    model = args.model or (str(common.STORIES) if args.dry else common.small_model())
    limit = 2 if args.dry and args.limit == 100 else args.limit
    args.tasks = args.tasks or ("arc_easy_local,gsm8k_local" if args.dry else TASKS)
    out_dir = common.CACHE / "gpu_drill"
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"gpu_drill: {common.machine()}; device {args.device}, {gpus} GPU(s) "
        f"{[torch.cuda.get_device_name(i) for i in range(gpus)]}; model {model}; tasks {args.tasks}, "
        f"limit {limit}, batch {args.batch_size}, {args.gen_kwargs}")
    run = dict(model=model, device=args.device, tasks=args.tasks, limit=limit, batch_size=args.batch_size,
               gen_kwargs=args.gen_kwargs)
    ref = {d: lm_eval_case(dtype=d, out_dir=out_dir, **run) for d in ("float32", "bfloat16")}
    cases = [("mpitp tp=1", 1, 1, "float32"), ("mpitp tp=1", 1, 1, "bfloat16")]
    cases += [(f"mpitp dp={n} (one GPU)" if gpus == 1 else f"mpitp dp={n}", n, 1, "float32")
              for n in map(int, args.dp.split(",")) if n > 1]
    if gpus >= 2:
        cases.append(("mpitp tp=2 (NCCL)", 2, 2, "float32"))
    else:
        say(f"gpu_drill: {gpus} GPU(s) visible: TP cases skipped (NCCL needs one GPU per rank of a communicator)")
    rows, failed = [], False
    for label, dtype in (("lm_eval hf", "float32"), ("lm_eval hf", "bfloat16")):
        r = ref[dtype]
        err = parity(ref["float32"]["requests"], r["requests"])[0] if dtype == "bfloat16" else 0.0
        r["tokens"] = None
        rows.append([f"{label} {dtype}", 1, "reference" if dtype == "float32" else f"bf16 err {err:.2e}",
                     r["time_s"], "", "", memory(r)])
    for label, n, tp, dtype in cases:
        r = mpitp_case(n, tp, dtype=dtype, **run)
        tokens = tokens_of(r["output"], args.tasks)
        base = ref[dtype]
        worst, mism, compared = parity(ref["float32"]["requests"], r["requests"])
        if dtype == "float32":
            ok = worst <= 1e-5 and mism == 0
            failed |= not ok
            verdict = f"{'OK' if ok else 'FAIL'} max rel |d| {worst:.1e}, {mism} mismatches / {compared}"
        else:
            verdict = f"bf16 err {worst:.2e} (lm-eval's above), {mism} greedy/gen differ / {compared}"
        tps, tps_ref = tokens / r["time_s"], tokens / base["time_s"]
        rows.append([f"{label} {dtype}", n, verdict, r["time_s"], f"{tps:.0f}", f"{tps / tps_ref:.2f}x", memory(r)])
        say(f"gpu_drill: {' | '.join(map(str, rows[-1]))}")  # as it comes: a run cut short still shows its cases
    say("")
    say(fmt_table(rows, ["case", "ranks", "parity vs lm_eval hf float32", "eval s", "tokens/s",
                         "vs lm_eval (same dtype)", "peak memory per rank"]))
    say(f"RATIO gpu_drill_parity {'1' if not failed else '0'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
