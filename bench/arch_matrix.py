"""The full architecture matrix: every causal-LM architecture of the installed transformers, built tiny and at
random (tests/support/arch.py), scored by mpitp at tp=1, tp=2 and pp=2 (one MPI launch per layout, a job file with one
run per model) and compared request by request with single-process ``lm_eval --model hf``.

    python bench/arch_matrix.py [--work DIR] [--only a,b]

Prints one row per architecture: its TP plan (transformers' own: yes; mpitp's own, mpitp/replica/tp_plans.py:
mpitp), its layouts and the largest relative |d ll| against lm-eval, a refusal (no TP / PP plan), or why it is not
in the matrix (not a plain decoder, cannot be built at random, lm-eval cannot score it). CI runs a subset of this
(tests/test_architectures.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from support import arch as A  # noqa: E402


def _mpirun(n: int, job: Path) -> subprocess.CompletedProcess:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    return subprocess.run([str(mpiexec), "-n", str(n), sys.executable, "-m", "mpitp", "run", str(job)],
                          capture_output=True, text=True)


def main() -> None:
    import os
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    import transformers

    transformers.logging.set_verbosity_error()
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None)
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="arch-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    from support.tasks import materialize_test_tasks

    include = materialize_test_tasks(work / "tasks")
    rows: dict[str, dict] = {}
    models: dict[str, Path] = {}
    archs = A.architectures()
    if args.only:
        archs = [a for a in archs if a.model_type in args.only.split(",")]
    for arch in archs:
        row = rows[arch.model_type] = dict(tp_plan="yes" if arch.tp_plan else "mpitp" if arch.own_plan else "no",
                                           pp_plan=arch.pp_plan)
        why = A.not_plain_decoder(arch)
        if why:
            row["reason"] = f"not in matrix: {why}"
            continue
        d = work / "models" / arch.model_type
        try:
            row["changed"] = A.build(arch, d)
        except Exception as exc:  # noqa: BLE001 - the reason is the row
            row["reason"] = f"cannot build at random: {A.first_line(exc)}"
            continue
        models[arch.model_type] = d
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=include)
    refs = {}
    for name, d in list(models.items()):
        try:
            refs[name] = A.reference(d, include, tm)
        except Exception as exc:  # noqa: BLE001
            rows[name]["reason"] = f"lm-eval hf cannot score it: {A.first_line(exc)}"
            del models[name]
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        todo = {n: d for n, d in models.items() if pp == 1 or rows[n]["pp_plan"]}
        out = work / f"tp{tp}pp{pp}"
        out.mkdir(exist_ok=True)
        job = A.job_file(work / f"matrix-tp{tp}-pp{pp}.yaml", todo, include, out, tp, pp)
        t0 = time.time()
        proc = _mpirun(tp * pp, job)
        print(f"layout tp={tp} pp={pp}: {len(todo)} models, {time.time() - t0:.0f} s, exit {proc.returncode}",
              flush=True)
        (work / f"log-tp{tp}-pp{pp}.txt").write_text(proc.stdout + proc.stderr)
        for name in todo:
            key = f"tp{tp}" if pp == 1 else f"pp{pp}"
            h5 = out / f"{name}.h5"
            if not h5.exists():
                lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if f"{name}-tp{tp}-pp{pp} failed" in ln]
                rows[name][key] = ("refused: " + lines[0].split("failed: ", 1)[-1][:90]) if lines else "no output"
                continue
            try:
                worst, problems = A.compare(refs[name], h5)
            except KeyError as exc:  # a run that died part-way (the launch's other models still get their row)
                rows[name][key] = f"partial output: {exc}"
                continue
            rows[name][key] = f"{worst:.1e}" + ("" if not problems else f" MISMATCH ({len(problems)})")
    (work / "matrix.json").write_text(json.dumps(rows, indent=1, default=str))
    print("\n| architecture | TP plan | PP plan | tp=1 | tp=2 | pp=2 | non-default options / reason |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        extra = r.get("reason") or ", ".join(f"{k}={v}" for k, v in (r.get("changed") or {}).items())
        print(f"| {name} | {r['tp_plan']} | {'yes' if r['pp_plan'] else 'no'} | "
              f"{r.get('tp1', '-')} | {r.get('tp2', '-')} | {r.get('pp2', '-')} | {extra} |")


if __name__ == "__main__":
    main()
