"""A real SLURM (hpc/local-slurm.sh starts one on this machine): submit exactly as a user would, wait, compare.

Skipped when no SLURM answers; CI starts one first. Each test copies jobs/demo.yaml so its outputs (and the batch
logs next to them) land in the test's own folder. The reference is a plain ``mpiexec -n 4 mpitp run`` of the same
job file; results must be the same by ``mpitp inspect diff``.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import OFFLINE_ENV, REPO
from support.mpi import explain, run_mpi
from support.nodes import SCHEDULABLE

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

DEMO_OUTPUTS = ["demo-tp1.h5", "demo-tp2.h5", "demo-tp2-bs8-limit10.h5"]


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        pytest.skip("no SLURM commands (hpc/local-slurm.sh start sets one up)")
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60)
    states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=60).stdout.split()
    if "UP" not in ping.stdout or not SCHEDULABLE & set(states):
        pytest.skip(f"no SLURM answers (scontrol ping: {ping.stdout.strip() or ping.stderr.strip()}; "
                    f"node states {states})")


def _job_copy(folder: Path) -> Path:
    (folder / "jobs").mkdir(parents=True)
    shutil.copy(REPO / "jobs" / "demo.yaml", folder / "jobs" / "demo.yaml")
    return folder


def _submit(folder: Path, *options: str, timeout: float = 1200, env: dict | None = None):
    """``mpitp submit ... --wait`` as a user types it; a job still queued when the test gives up is cancelled (a
    requeueing job would otherwise go on after the test)."""
    cmd = [sys.executable, "-m", "mpitp", "submit", "jobs/demo.yaml", "--scheduler", "slurm", "--nodes", "1",
           "--ranks-per-node", "4", *options, "--wait"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder,
                            env={**os.environ, **OFFLINE_ENV, "MPITP_PROGRESS_INTERVAL": "5", **(env or {})})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        job = re.search(r"Submitted slurm job (\d+)", stdout)
        if job:
            subprocess.run(["scancel", job.group(1)], timeout=60)
        pytest.fail(f"submit --wait still waiting after {timeout} s (job cancelled)\n{stdout}\n{stderr}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    done.elapsed = time.monotonic() - t0
    return done


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory):
    folder = _job_copy(tmp_path_factory.mktemp("slurm_reference"))
    proc = run_mpi(4, ["run", "jobs/demo.yaml"], cwd=str(folder), timeout=900)
    assert proc.returncode == 0, explain(proc)
    return folder / "results" / "demo", proc.elapsed


def _same_results(got: Path, ref: Path) -> None:
    for name in DEMO_OUTPUTS:
        diff = subprocess.run([sys.executable, "-m", "mpitp", "inspect", "diff", str(got / name), str(ref / name)],
                              capture_output=True, text=True, timeout=120)
        assert diff.returncode == 0, f"{name}: {diff.stdout}{diff.stderr}"


def _logs(folder: Path, proc) -> tuple[str, str]:
    job_id = re.search(r"Submitted slurm job (\d+)", proc.stdout).group(1)
    base = folder / "results" / "demo" / f"mpitp-demo-{job_id}"
    return Path(f"{base}.out").read_text(), Path(f"{base}.err").read_text()


def test_submit_demo_job_completes_and_matches_mpiexec(slurm, reference, tmp_path):
    folder = _job_copy(tmp_path)
    proc = _submit(folder, "--time", "00:10:00")
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"ended COMPLETED \(exit 0:0, restarts 0,", proc.stdout), proc.stdout
    assert "3/3 runs ok" in proc.stdout
    out, err = _logs(folder, proc)
    assert "job " in out and "3/3 runs ok" in out, out  # mpitp run's own summary, in the batch log
    script = (folder / "results" / "demo" / "mpitp-demo.slurm.sh").read_text()
    launch = re.search(r"^srun --mpi=(\w+) ", script, flags=re.M).group(1)
    assert launch in ("pmi2", "pmix"), script
    assert "\r" not in err, "carriage-return progress in the batch log"
    assert re.search(r"^mpitp: \d+/\d+ requests \(\d+%\), \d+ tok/s", err, flags=re.M), err[-3000:]
    _same_results(folder / "results" / "demo", reference[0])
    print(f"sbatch demo job: COMPLETED, 3/3 runs, srun --mpi={launch}, submit --wait {proc.elapsed:.0f} s "
          f"(mpiexec reference {reference[1]:.0f} s); inspect diff: same for all 3 outputs")


def test_srun_without_the_mpi_plugin_refuses_on_every_task(slurm, tmp_path):
    out = tmp_path / "x.h5"
    proc = subprocess.run(["srun", "-n", "2", "--mpi=none", sys.executable, "-m", "mpitp", "eval", "--demo",
                           "--output", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **OFFLINE_ENV})
    assert proc.returncode == 2, explain(proc)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mpitp:")]
    assert len(lines) == 2 and lines[0] == lines[1], explain(proc)
    assert lines[0].startswith("mpitp: error: srun started 2 tasks (SLURM_STEP_NUM_TASKS=2) but MPI sees a world "
                               "of 1:") and "srun --mpi=" in lines[0], lines[0]
    # srun reports tasks that end together as one range, or one line each when they end apart (both seen here)
    assert "tasks 0-1: Exited with exit code 2" in proc.stderr or all(
        f"task {t}: Exited with exit code 2" in proc.stderr for t in (0, 1)), explain(proc)
    assert "Traceback" not in proc.stderr and not out.exists()


# The walltime drill. Its time limit follows the plain mpiexec run of the same job measured just before (the
# `reference` fixture): starting four ranks (imports, MPI_Init, loading the model) takes 20 s on an idle machine and
# over 2 minutes on this 2-core VM under the other helpers' load, and only a start that outlasts it makes progress.
# SLURM 22.05 checks time limits every 30 s and sends USR1 up to 30 s (docs: 60 s) before the asked grace; the batch
# script times the stop from the job's end time instead, so a start ends REQUEUE_GRACE_S before its limit.
REQUEUE_GRACE_S = 10  # short: mpitp needs a second or two (flush the journal, abort); the step is ended at half
REQUEUE_MIN_S = 120  # --time 00:01:00 leaves 50-55 s a start: less than the 50-140 s from srun to the first chunk here


def _requeue_time(reference_s: float) -> str:
    """Twice the uninterrupted run, in whole minutes, at least REQUEUE_MIN_S."""
    minutes = math.ceil(max(REQUEUE_MIN_S, 2 * reference_s) / 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


@pytest.mark.timeout(2400)
def test_walltime_requeue_resumes_to_the_same_results(slurm, reference, tmp_path):
    """A job longer than its --time: rank 0 stalls after its first chunk (the test hook stands for an evaluation
    longer than the walltime), so the start is stopped by the walltime signal with rows landed and requests in
    flight; the script requeues, the next start resumes without the stall and completes. A start whose start-up
    outlasted its window (a load spike) landed nothing and keeps the stall for the next. The results equal an
    uninterrupted run's; starts and recomputed requests are printed."""
    folder = _job_copy(tmp_path)
    time_limit = _requeue_time(reference[1])
    # --env-setup as a site would use it. "test hook: stalling" is logged once rank 0's first chunk has landed.
    err_log = folder / "results" / "demo" / "mpitp-demo-$SLURM_JOB_ID.err"
    setup = (f'export PATH={Path(sys.executable).parent}:"$PATH"\n'
             f'if grep -qs "test hook: stalling" "{err_log}"; then unset MPITP_TEST_STALL; fi')
    proc = _submit(folder, "--time", time_limit, "--signal-grace", str(REQUEUE_GRACE_S), "--env-setup", setup,
                   timeout=2200, env={"MPITP_TEST_STALL": "between_chunks:3600"})
    assert proc.returncode == 0, explain(proc)
    ended = re.search(r"ended COMPLETED \(exit 0:0, restarts (\d+),", proc.stdout)
    assert ended, explain(proc)
    restarts = int(ended.group(1))
    assert restarts >= 1, proc.stdout  # the work did not fit one start
    out, err = _logs(folder, proc)
    starts = re.findall(r"^mpitp: start (\d+) of job", out, flags=re.M)
    assert [int(s) for s in starts] == list(range(1, restarts + 2)), out
    assert out.count("requeueing job") == restarts, out
    # One stop line per requeue: mpitp stopped itself (exit 75) every time, never killed at the limit. A start
    # stopped before its first run dispatched anything has no dispatcher to count requests in flight.
    stops = re.findall(r"stopping on SIGUSR1 \(walltime near\): (?:(\d+) requests in flight abandoned, )?(?:every|no "
                       r"request of this run)", err)
    assert len(stops) == restarts, err[-5000:]
    abandoned = [int(n or 0) for n in stops]
    reused = [int(n) for n in re.findall(r"resume: reusing (\d+) of", err)]
    assert sum(reused) > 0, err[-5000:]  # the first start landed rows that a later one reused
    _same_results(folder / "results" / "demo", reference[0])
    print(f"walltime requeue: {restarts + 1} starts under --time {time_limit} --signal-grace {REQUEUE_GRACE_S} "
          f"(uninterrupted mpiexec run {reference[1]:.0f} s), submit --wait {proc.elapsed:.0f} s; requests "
          f"abandoned in flight per stop {abandoned} (computed twice: at most {sum(abandoned)}); resumed rows "
          f"reused {reused}; inspect diff: same for all 3 outputs")
