"""Checkpoint sweep: one ``mpitp eval --model 'step-*'`` launch vs one ``mpitp eval`` launch per checkpoint.

    python bench/bench_sweep.py [--limit 40] [--checkpoints 5] [--reps 1] [--tasks hellaswag_local,arc_easy_local]

Checkpoints: the random-weight Llama h512/l8 with the GPT-2 vocabulary (~77M params, built once under
``bench/.cache``), copied to ``/tmp/mpitp-bench-sweep/step-<i>`` with every tensor perturbed by a different seed (so
every checkpoint has its own results). dp=2 (``mpiexec -n 2``, tp=1), one torch thread per rank, batch size 8.

Timed from outside, launch to exit (what a user waits for): the sweep against the sum of the separate launches,
which pay MPI start-up, imports, lm-eval's task index, dataset loading and the torch world once per checkpoint. The
runs alternate (sweep, then separate) per repetition. Then every checkpoint's sweep file is compared with its
separate file: each request's loglikelihood within relative 1e-5 (``|d| <= 1e-5 * max(1, |ll|)``) and every metric.

Last line: ``RATIO sweep <t(sweep) / t(separate launches)>`` (target <= 0.6).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import common

WORK = Path("/tmp/mpitp-bench-sweep")


def make_checkpoints(base: str, n: int) -> list[str]:
    import torch
    from safetensors.torch import load_file, save_file

    out = []
    for i in range(1, n + 1):
        d = WORK / f"step-{i}"
        if not (d / "DONE").exists():
            common.say(f"[sweep] writing checkpoint {d} ...")
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            for f in Path(base).iterdir():
                if f.is_file() and not f.name.endswith(".safetensors") and f.name != "DONE":
                    shutil.copyfile(f, d / f.name)
            g = torch.Generator().manual_seed(i)
            for f in Path(base).glob("*.safetensors"):
                tensors = load_file(str(f))
                for t in tensors.values():
                    t.add_(torch.randn(t.shape, generator=g) * 0.02 * t.float().std())
                save_file(tensors, str(d / f.name), metadata={"format": "pt"})
            (d / "DONE").write_text("ok\n")
        out.append(str(d))
    return out


def _mpiexec() -> str:
    if Path(common.MPIEXEC).exists():
        return common.MPIEXEC
    import sys

    here = Path(sys.executable).parent / "mpiexec"  # the venv's PyPI MPICH when the repo has no .venv of its own
    return str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")


def launch(args: list[str], label: str) -> float:
    cmd = [_mpiexec(), "-n", "2", common.PYTHON, "-m", "mpitp", *args]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=common.bench_env(), cwd=str(common.ROOT), capture_output=True, text=True,
                       timeout=7200)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = "\n".join((p.stdout + "\n" + p.stderr).splitlines()[-30:])
        raise RuntimeError(f"{label} failed (rc {p.returncode}): {' '.join(cmd)}\n{tail}")
    return wall


def compare(a: str, b: str, tasks: list[str]) -> tuple[int, float, list[str]]:
    """(requests compared, max relative |d ll|, differences) between two results files."""
    from mpitp.results.rows import read_metrics, read_requests

    n, worst, bad = 0, 0.0, []
    for task in tasks:
        ra, rb = read_requests(a, task), read_requests(b, task)
        if list(ra["args_hash"]) != list(rb["args_hash"]):
            bad.append(f"{task}: different requests")
            continue
        for x, y in zip(ra["loglikelihood"], rb["loglikelihood"]):
            n += 1
            rel = abs(x - y) / max(1.0, abs(y))
            worst = max(worst, rel)
            if rel > 1e-5:
                bad.append(f"{task}: ll {x!r} vs {y!r}")
        ma, mb = read_metrics(a, task), read_metrics(b, task)
        for k in ma:
            va, vb = ma[k], mb.get(k)
            if isinstance(va, float) and isinstance(vb, float):
                if not (va == vb or (math.isnan(va) and math.isnan(vb)) or
                        abs(va - vb) <= 1e-5 * max(1.0, abs(vb))):
                    bad.append(f"{task}: metric {k} {va!r} vs {vb!r}")
            elif va != vb:
                bad.append(f"{task}: metric {k} {va!r} vs {vb!r}")
    return n, worst, bad


def main() -> None:
    ap = common.parser(__doc__, limit=40, reps=1)
    ap.add_argument("--checkpoints", type=int, default=5)
    ap.add_argument("--tasks", default="hellaswag_local,arc_easy_local")
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    base = common.small_model()
    ckpts = make_checkpoints(base, args.checkpoints)
    tasks = args.tasks.split(",")
    common.say(common.machine())
    common.say(f"{len(ckpts)} checkpoints of {common.n_params(base) / 1e6:.1f}M params, tasks {args.tasks}, "
               f"--limit {args.limit}, batch size {args.batch_size}, dp=2 (mpiexec -n 2, tp=1), 1 thread per rank")
    common_args = ["--tasks", args.tasks, "--include-path", common.include_path(), "--limit", str(args.limit),
                   "--batch-size", str(args.batch_size), "--threads", "1", "--overwrite"]
    rows, sweeps, seps = [], [], []
    for rep in range(1, args.reps + 1):
        sweep_dir = WORK / f"out-sweep-{rep}"
        shutil.rmtree(sweep_dir, ignore_errors=True)
        t_sweep = launch(["eval", "--model", ",".join(ckpts), "--output", f"{sweep_dir}/", *common_args],
                         "sweep")
        rows.append([rep, "one sweep launch", t_sweep, ""])
        t_sep = []
        sep_dir = WORK / f"out-separate-{rep}"
        sep_dir.mkdir(parents=True, exist_ok=True)
        for c in ckpts:
            name = Path(c).name
            t = launch(["eval", "--model", c, "--output", str(sep_dir / f"{name}.h5"), *common_args], name)
            t_sep.append(t)
            rows.append([rep, f"  separate launch {name}", t, ""])
        rows.append([rep, f"{len(ckpts)} separate launches", sum(t_sep), f"{t_sweep / sum(t_sep):.3f}"])
        sweeps.append(t_sweep)
        seps.append(sum(t_sep))
        for c in ckpts:
            name = Path(c).name
            n, worst, bad = compare(str(sweep_dir / f"{name}.h5"), str(sep_dir / f"{name}.h5"), tasks)
            common.say(f"rep {rep} {name}: {n} requests, max relative |d ll| {worst:.3g}, "
                       f"{'identical within rel 1e-5' if not bad else 'DIFFERENT: ' + '; '.join(bad[:5])}")
        summary = json.loads((sweep_dir / "sweep-summary.json").read_text())
        common.say("sweep per-checkpoint wall s: " + " ".join(f"{r['name']} {r['wall_s']:.1f}"
                                                              for r in summary["checkpoints"]))
    common.say(common.fmt_table(rows, ["rep", "run", "launch-to-exit s", "sweep / separate"]))
    ratio = common.paired(sweeps, seps)
    common.say(f"target: <= 0.6x: {'MET' if ratio <= 0.6 else 'MISSED'}")
    common.say(common.loadavg())
    common.say(f"RATIO sweep {ratio:.3f}")


if __name__ == "__main__":
    main()
