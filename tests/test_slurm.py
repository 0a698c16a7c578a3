"""A real SLURM (hpc/local-slurm.sh starts one on this machine): submit exactly as a user would, wait, compare.

Skipped when no SLURM answers; CI starts one first. Each test copies jobs/demo.yaml so its outputs (and the batch
logs next to them) land in the test's own folder. The reference is a plain ``mpiexec -n 4 mpitp run`` of the same
job file; results must be the same by ``mpitp inspect diff``.
"""

from __future__ import annotations

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

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

DEMO_OUTPUTS = ["demo-tp1.h5", "demo-tp2.h5", "demo-tp2-bs8-limit10.h5"]


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        pytest.skip("no SLURM commands (hpc/local-slurm.sh start sets one up)")
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60)
    states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=60).stdout.split()
    if "UP" not in ping.stdout or not {"idle", "mix", "alloc"} & set(states):
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
    assert "tasks 0-1: Exited with exit code 2" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr and not out.exists()


# Rank 0 sleeps this long after each chunk it computes in the requeue drill. The demo job's evaluation itself takes
# a few seconds now (results go to a journal, no file rewrite per chunk): without the stall the whole job fits one
# start and nothing is requeued. With it the three runs take about a minute of work beyond start-up, more than one
# start's window (USR1 came about 32 s after each start here); the results do not depend on it.
REQUEUE_STALL_S = 1


@pytest.mark.skipif(not os.environ.get("MPITP_TEST_REQUEUE"),
                    reason="walltime requeue drill: not yet seen to pass (issue 15 stays open); starts after the first "
                           "made no progress on the loaded 2-core VM. Run it with MPITP_TEST_REQUEUE=1")
@pytest.mark.timeout(1900)  # several starts of >= 1 min each plus SLURM's requeue delay; submit waits 1800 s
def test_walltime_requeue_resumes_to_the_same_results(slurm, reference, tmp_path):
    """--time 00:01:00 for about two minutes of work: USR1 5 s before the limit (SLURM checks limits every 30 s, so
    it comes 5-35 s before), requeue, resume, until done."""
    folder = _job_copy(tmp_path)
    proc = _submit(folder, "--time", "00:01:00", "--signal-grace", "5", timeout=1800,
                   env={"MPITP_TEST_STALL": f"between_chunks:{REQUEUE_STALL_S}"})
    assert proc.returncode == 0, explain(proc)
    ended = re.search(r"ended COMPLETED \(exit 0:0, restarts (\d+),", proc.stdout)
    assert ended, explain(proc)
    restarts = int(ended.group(1))
    assert restarts >= 1, proc.stdout  # the work did not fit one start
    out, err = _logs(folder, proc)
    starts = re.findall(r"^mpitp: start (\d+) of job", out, flags=re.M)
    assert [int(s) for s in starts] == list(range(1, restarts + 2)), out
    assert out.count("requeueing job") == restarts, out
    abandoned = [int(n) for n in re.findall(r"stopping on SIGUSR1 \(walltime near\): (\d+) requests in flight", err)]
    reused = [int(n) for n in re.findall(r"resume: reusing (\d+) of", err)]
    _same_results(folder / "results" / "demo", reference[0])
    print(f"walltime requeue: {restarts + 1} starts for the demo job under --time 00:01:00 --signal-grace 5, "
          f"submit --wait {proc.elapsed:.0f} s; requests abandoned in flight per stop {abandoned} "
          f"(computed twice: {sum(abandoned)}); resumes reused {reused} rows; inspect diff: same for all 3 outputs")
