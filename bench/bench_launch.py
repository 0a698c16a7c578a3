"""Launch cost: ``mpitp check`` of a small job cold and warm, and what rank 0 spends alone in a small launch and in
the README's demo (issue 41).

    python bench/bench_launch.py [--reps 3] [--tree DIR] [--no-demo]

Each command is launched as a user launches it and timed from outside (wall clock of the whole command), on
stories260K with the test tasks ``arc_easy_local`` and ``gsm8k_local`` (``--include-path``, ``--limit 20``,
``max_gen_toks=32``):

- ``mpitp check JOB.yaml``, a one-run job at ``tp: 2``: *cold* with a new, empty ``MPITP_CHECK_CACHE`` (the model
  checked in its child interpreter), then *warm* with the folder the cold run filled (its kept "ready": the tasks
  alone);
- the small launch, ``mpiexec -n 2 mpitp eval ... --tp 2``: its closing line's ``rank 0 alone`` and phases;
- the README's demo, ``mpiexec -n 4 mpitp eval --demo --tp 2`` (4 ranks: oversubscribed on 2 cores), the same.

``--tree DIR`` runs another checkout's mpitp (``PYTHONPATH=DIR``): run it and this tree alternately for before/after.
Last lines: ``RATIO check_warm_s``, ``RATIO check_cold_s``, ``RATIO launch_alone_s``, ``RATIO demo_alone_s`` (medians
over the repetitions; targets: warm check <= 2 s, small launch alone <= 3 s).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from pathlib import Path

import common

TASKS = "arc_easy_local,gsm8k_local"
PHASES = re.compile(r"rank 0 phases: (.*?) \(writing:.*?rank 0 alone \(wall - max group busy\) ([\d.]+) s")


def timed(cmd: list[str], env: dict, cwd: str, label: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{label} failed (rc {p.returncode}): {' '.join(cmd)}\n{(p.stdout + p.stderr)[-3000:]}")
    return wall, p.stdout + p.stderr


def alone(out: str, label: str) -> tuple[float, str]:
    found = PHASES.search(out)
    if not found:
        raise RuntimeError(f"{label}: no closing line with rank 0's phases in:\n{out[-2000:]}")
    return float(found.group(2)), found.group(1)


def main() -> None:
    ap = common.parser(__doc__, limit=20, reps=3)
    ap.add_argument("--tree", help="another checkout's folder (holding mpitp/) to run instead of this one")
    ap.add_argument("--no-demo", action="store_true", help="leave out the README's demo")
    args = ap.parse_args()
    env = common.bench_env(**({"PYTHONPATH": args.tree} if args.tree else {}))
    include = common.include_path()
    # Each launch imports mpitp from its tree: its bytecode compiled first, as installing a package does. A checkout
    # run with PYTHONDONTWRITEBYTECODE=1 (this project's VMs) otherwise compiles its ~100 modules in every process
    # of every launch: 0.7 s of the small launch's rank 0 alone (session 22, bench/README).
    subprocess.run([common.PYTHON, "-m", "compileall", "-q", str(Path(args.tree or common.ROOT) / "mpitp")],
                   env=env, check=True, capture_output=True)
    mpitp = [common.PYTHON, "-m", "mpitp"]
    common.say(common.machine())
    common.say(f"tree {args.tree or common.ROOT}; stories260K, {TASKS}, --limit {args.limit}, reps {args.reps}")
    found: dict[str, list[float]] = {"check_cold_s": [], "check_warm_s": [], "launch_alone_s": [],
                                     "demo_alone_s": []}
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as work:
        job = Path(work) / "job.yaml"
        job.write_text(f"defaults: {{model: {common.STORIES}, tasks: [{TASKS}], include_path: {include}, "
                       f"limit: {args.limit}}}\nruns:\n  - {{name: small, tp: 2, output: {work}/small.h5}}\n")
        evaluate = [common.MPIEXEC, "-n", "2", *mpitp, "eval", "--model", str(common.STORIES), "--tasks", TASKS,
                    "--include-path", include, "--tp", "2", "--limit", str(args.limit), "--gen-kwargs",
                    "max_gen_toks=32", "--overwrite", "--output", f"{work}/launch.h5"]
        demo = [common.MPIEXEC, "-n", "4", *mpitp, "eval", "--demo", "--tp", "2", "--overwrite", "--output",
                f"{work}/demo.h5"]
        for rep in range(1, args.reps + 1):
            verdicts = tempfile.mkdtemp(prefix="verdicts-", dir=work)
            check_env = {**env, "MPITP_CHECK_CACHE": verdicts}
            for kind in ("cold", "warm"):
                wall, _ = timed([*mpitp, "check", str(job)], check_env, work, f"check ({kind})")
                found[f"check_{kind}_s"].append(wall)
                common.say(f"[{rep}] mpitp check job.yaml, {kind}: {wall:.2f} s")
            wall, out = timed(evaluate, env, work, "small launch")
            seconds, phases = alone(out, "small launch")
            found["launch_alone_s"].append(seconds)
            common.say(f"[{rep}] small launch: wall {wall:.1f} s, rank 0 alone {seconds:.1f} s ({phases})")
            if not args.no_demo:
                wall, out = timed(demo, env, work, "demo")
                seconds, phases = alone(out, "demo")
                found["demo_alone_s"].append(seconds)
                common.say(f"[{rep}] demo: wall {wall:.1f} s, rank 0 alone {seconds:.1f} s ({phases})")
    common.say(common.loadavg())
    for name, values in found.items():
        if values:
            print(f"RATIO {name} {common.median(values):.2f}")


if __name__ == "__main__":
    main()
