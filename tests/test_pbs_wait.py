"""``mpitp submit --scheduler pbs --wait`` against stand-ins for ``qsub`` and ``qstat`` (no PBS server here; the
SLURM path runs against a real SLURM in test_slurm.py). The stand-ins print what PBS Pro prints: ``qsub`` the job id,
``qstat -x -f`` the job's attributes, through Q, R and F; the submit command must follow them to the end, report the
exit status, run count and walltime used, and exit 1 unless every run of the job file is complete."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

QSTAT = r'''#!/bin/bash
# qstat -x -f ID: one more state of the list in $FAKE_PBS_STATES per call, the last one for ever after
[[ $1 == -x && $2 == -f && $3 == 4242.pbs01 ]] || { echo "qstat: Unknown Job Id $3" >&2; exit 35; }
n=$(cat "$FAKE_PBS_DIR/calls" 2>/dev/null || echo 0); echo $((n + 1)) > "$FAKE_PBS_DIR/calls"
read -ra states <<< "$FAKE_PBS_STATES"
state=${states[$((n < ${#states[@]} ? n : ${#states[@]} - 1))]}
cat <<EOT
Job Id: 4242.pbs01
    Job_Name = mpitp-demo
    Job_Owner = user@login1
    resources_used.cpupercent = 180
    resources_used.walltime = 00:01:02
    job_state = $state
    queue = workq
    Rerunable = True
EOT
if [[ $state == F ]]; then printf '    Exit_status = %s\n    run_count = 1\n' "$FAKE_PBS_EXIT"; fi
if [[ $state != Q ]]; then echo "    exec_host = node7/0*4"; fi
'''

QSUB = r'''#!/bin/bash
cp "$1" "$FAKE_PBS_DIR/submitted.sh"
echo 4242.pbs01
'''


@pytest.fixture
def fake_pbs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("qstat", QSTAT), ("qsub", QSUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "jobs").mkdir()
    shutil.copy(REPO / "jobs" / "demo.yaml", tmp_path / "jobs" / "demo.yaml")
    return tmp_path


def _submit_wait(folder: Path, states: str, exit_status: str):
    env = {**os.environ, "PATH": f"{folder / 'bin'}:{os.environ['PATH']}", "FAKE_PBS_DIR": str(folder),
           "FAKE_PBS_STATES": states, "FAKE_PBS_EXIT": exit_status}
    return subprocess.run([sys.executable, "-m", "mpitp", "submit", "jobs/demo.yaml", "--scheduler", "pbs",
                           "--nodes", "1", "--ranks-per-node", "4", "--time", "00:10:00", "--wait"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_pbs_wait_follows_the_job_to_its_end_and_reports_it(fake_pbs):
    proc = _submit_wait(fake_pbs, "Q R F", "0")  # submit polls every 5 s
    out = proc.stdout
    assert "Submitted pbs job 4242.pbs01" in out, out + proc.stderr
    assert (fake_pbs / "submitted.sh").read_text().startswith("#!/bin/bash"), "qsub was not given the script"
    assert out.index("job 4242.pbs01: QUEUED") < out.index("job 4242.pbs01: RUNNING") < out.index(
        "job 4242.pbs01: FINISHED"), out
    assert "job 4242.pbs01 ended FINISHED (exit 0, restarts 1, run time 00:01:02," in out, out
    # The stand-in ran nothing: the job file's outputs are missing, so the job did not do its work: exit 1.
    assert "0/3 runs ok" in out and proc.returncode == 1, out + proc.stderr
    assert int((fake_pbs / "calls").read_text()) == 3  # polled until F, not beyond


def test_pbs_wait_reports_a_job_killed_at_its_walltime(fake_pbs):
    proc = _submit_wait(fake_pbs, "F", "-29")  # PBS Pro's JOB_EXEC_KILL_WALLTIME
    assert "ended FINISHED (exit -29, restarts 1, run time 00:01:02," in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1
