"""The fault matrix (issue 42): {a node's link cut, a node's ranks killed, rank 0 killed, SIGTERM to every rank as a
scheduler sends it} x {during load, mid-run, during the exit}, on two emulated nodes (``hpc/local-nodes.sh``).

One cell: an uninterrupted-able run of the built-in demo at dp 2 x tp 2 (a TP group on each node), struck at its
instant (a ``MPITP_TEST_STALL`` holds every rank there: ``before_load``, ``between_chunks``, ``before_finalize``),
then: seconds from the strike until the launcher and every rank are gone, the exit status, what mpitp said
(``mpitp: ...`` lines), no traceback, the results file readable (status, rows), and ``--resume`` completing to the
numbers of an uninterrupted run (``mpitp inspect diff``). MPI runs over TCP in every cell, and a cell whose cut did
not cut (the job went on as if nothing happened) fails: :func:`run_cell` asserts it.

Used by ``tests/test_fault_matrix.py`` (CI) and ``bench/drill_faults.py`` (the table for a note).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from .launch import Launch, file_rows, inspect_diff
from .mpi import mpi_family
from .nodes import launcher, launcher_on, namespace, set_link, slurm_nodes_ready

FAULTS = ("link_cut", "nodeb_killed", "rank0_killed", "sigterm")
INSTANTS = ("load", "mid_run", "exit")
TIMEOUT = 20  # --timeout: how long a rank waits for a peer before it says so and ends the job
#: The stated bound: every cell is gone within --timeout + this many seconds after the strike.
BOUND_AFTER_TIMEOUT = 60.0
STALLS = {"load": "before_load:8", "mid_run": "between_chunks:1", "exit": "before_finalize:6"}
TWO_BY_TWO = {"nodea": 2, "nodeb": 2}
ARGS = ["eval", "--demo", "--tp", "2", "--limit", "6", "--batch-size", "1", "--bootstrap-iters", "0",
        "--timeout", str(TIMEOUT)]
_SAID = re.compile(r"^mpitp: (?:error: )?.*$|^\[rank \d+\] .*$", re.M)


@dataclass
class Cell:
    fault: str
    instant: str
    launcher: str
    took: float = float("nan")
    exit: int | None = None
    said: list[str] | None = None
    traceback: bool = False
    status: str | None = None
    rows: int = 0
    resumed_equal: bool | None = None
    note: str = ""

    def row(self) -> str:
        said = "; ".join(s[:90] for s in (self.said or [])[:2]) or "-"
        eq = {True: "yes", False: "NO", None: "-"}[self.resumed_equal]
        return (f"| {self.launcher} | {self.instant} | {self.fault} | {self.took:.1f} | {self.exit} | "
                f"{'yes' if self.traceback else 'no'} | {self.status} {self.rows} | {eq} | {said} |")


HEADER = ("| launcher | instant | fault | s to gone | exit | traceback | file (status rows) | resume = uninterrupted "
          "| said (first lines) |\n|---|---|---|---|---|---|---|---|---|")


def launch_prefix(kind: str, names=()) -> list[str]:
    """``mpich``: Hydra started on nodea as a batch script runs on a job's first node; ``openmpi``: prterun with its
    daemons over ssh (the suite's MPI must be Open MPI); ``srun``: a SLURM step on the emulated nodes' partition
    (``hpc/local-slurm.sh``), as the batch scripts ``mpitp submit`` writes launch it."""
    if kind == "srun":
        return ["srun", "--partition", "nodes", "--nodes", "2", "--ntasks", "4", "--ntasks-per-node", "2",
                "--mpi=pmi2", "--kill-on-bad-exit=1"]
    if kind == "mpich":
        return launcher_on("nodea", TWO_BY_TWO)
    # prterun passes only the variables named with -x: the drill's own (``names``) are set per launch, after
    # launcher() looked at this process's environment
    return [*launcher(TWO_BY_TWO), *[a for k in sorted(set(names)) for a in ("-x", k)]]


def node_ranks(job: Launch, node: str) -> list[int]:
    inside = {int(p) for p in subprocess.run(["ip", "netns", "pids", namespace(node)], capture_output=True,
                                             text=True, timeout=30).stdout.split()}
    return sorted(rank for rank, pid in job.rank_pids().items() if pid in inside)


def _wait_for(job: Launch, what, timeout: float = 240.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        if job.proc.poll() is not None:
            return False
        time.sleep(0.1)
    return False


def _rows(out: Path) -> tuple[str | None, int]:
    return file_rows(out) if out.exists() else (None, 0)


def strike(job: Launch, fault: str) -> None:
    pids = job.rank_pids()
    if fault == "link_cut":
        set_link("nodeb", up=False)
    elif fault == "nodeb_killed":
        for rank in node_ranks(job, "nodeb"):
            psutil.Process(pids[rank]).send_signal(signal.SIGKILL)
    elif fault == "rank0_killed":
        psutil.Process(pids[0]).send_signal(signal.SIGKILL)
    elif fault == "sigterm":  # slurmstepd / PBS at walltime: every task of the step gets SIGTERM
        for pid in pids.values():
            with _quiet():
                psutil.Process(pid).send_signal(signal.SIGTERM)
    else:
        raise ValueError(fault)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is not None and issubclass(kind, psutil.Error)


def run_cell(fault: str, instant: str, kind: str, workdir: Path, reference: Path, env: dict | None = None) -> Cell:
    """Strike one run at ``instant`` with ``fault``; measure; resume; compare with ``reference`` (a complete file of
    the same run). Asserts only that the strike happened while the job ran (a drill that struck nothing fails)."""
    cell = Cell(fault, instant, kind)
    out = workdir / f"{fault}-{instant}.h5"
    run_env = {**(env or {}), "MPITP_TEST_STALL": STALLS[instant], "UCX_TLS": "tcp,self"}
    if kind == "srun":
        slurm_nodes_ready()
    try:
        with Launch(4, [*ARGS, "--output", str(out)], env=run_env, launcher=launch_prefix(kind, run_env)) as job:
            if instant == "load":
                ready = _wait_for(job, lambda: "stalling 8 s at before_load" in job.stderr)
            elif instant == "mid_run":
                ready = _wait_for(job, lambda: _rows(out)[1] > 0)
            else:
                ready = _wait_for(job, lambda: _rows(out)[0] == "complete"
                                  and "stalling 6 s at before_finalize" in job.stderr)
            assert ready and job.proc.poll() is None, f"the job ended before the strike\n{job.explain()}"
            time.sleep(0.5)
            len(job.rank_pids())  # every rank found while it is alive
            assert len(job.pids) == 4, (job.pids, job.explain())
            t = time.monotonic()
            strike(job, fault)
            cell.took = job.gone_within(t, TIMEOUT + BOUND_AFTER_TIMEOUT)
            cell.exit = job.proc.returncode
            err = job.stderr
    finally:
        set_link("nodeb", up=True)
    from .mpi import mpitp_stderr

    mine = mpitp_stderr(err)
    cell.said = [s for s in _SAID.findall(mine) if "test hook" not in s and "%" not in s]
    cell.traceback = "Traceback" in mine
    cell.status, cell.rows = _rows(out)
    if fault == "link_cut":
        _wait_link()
    if cell.status is not None:
        resume = [*ARGS, "--output", str(out), "--resume"] if cell.status != "complete" else None
        if resume is not None:
            if kind == "srun":
                slurm_nodes_ready()
            with Launch(4, resume, env={**(env or {}), "UCX_TLS": "tcp,self"}, launcher=launch_prefix(kind)) as again:
                rc = again.wait(timeout=300)
            cell.note = "" if rc == 0 else f"resume exit {rc}"
        diff = inspect_diff(out, reference)
        cell.resumed_equal = diff.returncode == 0
    return cell


def _wait_link(timeout: float = 30.0) -> None:
    """After a cut: nodeb answers over ssh again (the bridge needs a moment to forward on a link brought back up)."""
    deadline = time.monotonic() + timeout
    ssh = os.environ.get("MPITP_NODES_SSH", "/var/tmp/mpitp-nodes/ssh")
    while time.monotonic() < deadline:
        if subprocess.run([ssh, "nodeb", "true"], capture_output=True, timeout=20).returncode == 0:
            return
        time.sleep(0.5)


def reference_run(kind: str, workdir: Path, env: dict | None = None) -> Path:
    """The uninterrupted run every resumed cell is compared with."""
    out = workdir / "reference.h5"
    with Launch(4, [*ARGS, "--output", str(out)], env={**(env or {}), "UCX_TLS": "tcp,self"},
                launcher=launch_prefix(kind)) as job:
        rc = job.wait(timeout=400)
    assert rc == 0 and file_rows(out)[0] == "complete", job.explain()
    return out


def family() -> str:
    return mpi_family()
