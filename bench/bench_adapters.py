"""Adapter sweep: one ``mpitp eval --peft a1,...,a5`` launch (one base load) vs one launch per adapter.

    python bench/bench_adapters.py [--limit 40] [--adapters 5] [--tasks hellaswag_local,arc_easy_local]
                                   [--layouts tp1,tp2] [--model mid|small|stories]

Base: the random-weight Llama h640/l8 with the GPT-2 vocabulary (~104M params, built once under ``bench/.cache``;
``--model stories`` takes stories260K, for a quick check that the script works). Adapters: LoRA r=8 on every
attention and MLP projection, written with peft's own API (``get_peft_model``, ``init_lora_weights=False``: random
non-zero ``lora_B``, one seed each, so every adapter has its own results) under ``/tmp/mpitp-bench-adapters``.
Layouts: ``mpiexec -n 2`` at dp=2 tp=1 and at tp=2 (dp=1); one torch thread per rank, batch size 8.

Timed from outside, launch to exit (what a user waits for): the sweep against the sum of the separate launches,
which pay MPI start-up, imports, lm-eval's task index, the tasks and the base model's load and sharding once per
adapter. Then every adapter's sweep file is compared with its separate file (each request's loglikelihood within
relative 1e-5, every metric), and in this process the base is put through 5 apply/restore cycles
(:func:`mpitp.replica.adapters.apply` with ``keep``): its weights must come back bit for bit.

Last lines: ``RATIO adapters_sweep_vs_separate <worst layout's t(sweep) / t(separate launches)>`` (target <= 0.5)
and ``RATIO adapters_restore_max_abs_error <max |W - W0| after 5 cycles>`` (must be exactly 0).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import common
from bench_sweep import compare, launch

WORK = Path("/tmp/mpitp-bench-adapters")
MODELS = {"mid": common.mid_model, "small": common.small_model, "stories": lambda: str(common.STORIES)}
LAYOUTS = {"tp1": 1, "tp2": 2}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: str, label: str, n: int) -> list[str]:
    """``n`` LoRA adapters of ``base`` written by peft (``save_pretrained``), each from its own seed."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(1, n + 1):
        d = WORK / label / f"step-{i}"
        if not (d / "adapter_model.safetensors").exists():
            common.say(f"[adapters] writing adapter {d} ...")
            shutil.rmtree(d, ignore_errors=True)
            torch.manual_seed(i)
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                   LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False))
            model.save_pretrained(str(d))
        out.append(str(d))
    return out


def restore_error(base: str, adapters: list[str], cycles: int = 5) -> tuple[float, int, int]:
    """(max |W - W0|, parameters not bit-identical, parameters) after ``cycles`` apply/restore cycles."""
    import torch
    from transformers import AutoModelForCausalLM

    from mpitp.replica import adapters as lora

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    read = [lora.read(a) for a in adapters]
    for c in range(cycles):
        done = lora.apply(model, read[c % len(read)], keep=True)
        if not any(not torch.equal(v, before[k]) for k, v in model.state_dict().items()):
            raise RuntimeError(f"cycle {c}: adapter {adapters[c % len(read)]} changed no weight")
        done.restore()
    after = model.state_dict()
    worst = max(float((after[k].float() - v.float()).abs().max()) for k, v in before.items())
    differ = sum(not torch.equal(after[k], v) for k, v in before.items())
    return worst, differ, len(before)


def main() -> None:
    ap = common.parser(__doc__, limit=40, reps=1)
    ap.add_argument("--adapters", type=int, default=5)
    ap.add_argument("--tasks", default="hellaswag_local,arc_easy_local")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--layouts", default="tp1,tp2", help="tp1 (dp=2), tp2 (dp=1), or both")
    ap.add_argument("--model", choices=sorted(MODELS), default="mid")
    args = ap.parse_args()
    base = MODELS[args.model]()
    adapters = make_adapters(base, args.model, args.adapters)
    tasks = args.tasks.split(",")
    layouts = [x for x in args.layouts.split(",") if x]
    common.say(common.machine())
    common.say(f"{len(adapters)} LoRA adapters (r=8, {len(TARGETS)} projections) of a "
               f"{common.n_params(base) / 1e6:.1f}M-param base, tasks {args.tasks}, --limit {args.limit}, batch "
               f"size {args.batch_size}, mpiexec -n 2 at {', '.join(layouts)}, 1 thread per rank")
    common_args = ["--model", base, "--tasks", args.tasks, "--include-path", common.include_path(), "--limit",
                   str(args.limit), "--batch-size", str(args.batch_size), "--threads", "1", "--overwrite"]
    rows, ratios = [], {}
    for lay in layouts:
        tp = ["--tp", str(LAYOUTS[lay])]
        sweeps, seps = [], []
        for rep in range(1, args.reps + 1):
            sweep_dir = WORK / args.model / f"out-sweep-{lay}-{rep}"
            shutil.rmtree(sweep_dir, ignore_errors=True)
            t_sweep = launch(["eval", "--peft", ",".join(adapters), "--output", f"{sweep_dir}/", *tp, *common_args],
                             f"sweep {lay}")
            rows.append([lay, rep, "one sweep launch", t_sweep, ""])
            sep_dir = WORK / args.model / f"out-separate-{lay}-{rep}"
            sep_dir.mkdir(parents=True, exist_ok=True)
            t_sep = []
            for a in adapters:
                name = Path(a).name
                t_sep.append(launch(["eval", "--peft", a, "--output", str(sep_dir / f"{name}.h5"), *tp,
                                     *common_args], f"{name} {lay}"))
                rows.append([lay, rep, f"  separate launch {name}", t_sep[-1], ""])
            rows.append([lay, rep, f"{len(adapters)} separate launches", sum(t_sep), f"{t_sweep / sum(t_sep):.3f}"])
            sweeps.append(t_sweep)
            seps.append(sum(t_sep))
            for a in adapters:
                name = Path(a).name
                n, worst, bad = compare(str(sweep_dir / f"{name}.h5"), str(sep_dir / f"{name}.h5"), tasks)
                verdict = "identical within rel 1e-5" if not bad else "DIFFERENT: " + "; ".join(bad[:5])
                common.say(f"{lay} rep {rep} {name}: {n} requests, max relative |d ll| sweep vs separate "
                           f"{worst:.3g}, {verdict}")
                if bad:
                    raise SystemExit(f"{lay} {name}: the sweep's results differ from the separate launch's")
        ratios[lay] = common.paired(sweeps, seps)
    common.say(common.fmt_table(rows, ["layout", "rep", "run", "launch-to-exit s", "sweep / separate"]))
    worst_ratio = max(ratios.values())
    common.say("sweep / separate per layout: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    common.say(f"target: <= 0.5x: {'MET' if worst_ratio <= 0.5 else 'MISSED'}")
    err, differ, total = restore_error(base, adapters)
    exact = "exact" if differ == 0 else "NOT EXACT"
    for line in (f"restore after 5 apply/restore cycles: max |W - W0| {err!r}, {differ} of {total} parameters not "
                 f"bit-identical ({exact})", common.loadavg(), f"RATIO adapters_sweep_vs_separate {worst_ratio:.3f}",
                 f"RATIO adapters_restore_max_abs_error {err:g}"):
        common.say(line)


if __name__ == "__main__":
    main()
