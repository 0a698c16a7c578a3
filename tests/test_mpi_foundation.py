"""The MPI foundation under real ``mpiexec`` launches (2 and 4 ranks, gloo, CPU).

The per-rank code lives in tests/mpi/*.py: each script runs many checks in one launch, aborts the whole job on the
first failure (install_excepthook) and prints ``OK <name>`` from rank 0 when every rank passed. Launches are few and
small on purpose (the whole file takes about a minute on 2 cores).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from support import OFFLINE_ENV, REPO
from support.mpi import explain, mpitp_stderr, run_mpi, run_mpi_script

pytestmark = [pytest.mark.openmpi, pytest.mark.mpi]  # the MPI layer itself: every test here also runs under Open MPI

SCRIPTS = REPO / "tests" / "mpi"
LAUNCH_TIMEOUT = 180


def _ok(proc, name: str) -> None:
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count(f"OK {name}:") == 1, explain(proc)


# --------------------------------------------------------------------------- object collectives


@pytest.mark.parametrize("n", [2, 4])
def test_object_collectives_round_trip(n):
    """bcast/scatter/gather of small objects, nested dicts of arrays and tensors and 100 MB arrays, every root, on
    COMM_WORLD, the layout's tp_comm and dp_leader_comm (tp=2), an own Split and COMM_SELF; then in small chunks."""
    proc = run_mpi_script(n, SCRIPTS / "collectives.py", timeout=LAUNCH_TIMEOUT)
    _ok(proc, "collectives")
    for comm in ("COMM_WORLD", "tp_comm", "dp_leader_comm", "own_split", "COMM_SELF", "chunked"):
        assert f"  {comm}: ok" in proc.stdout, explain(proc)


# --------------------------------------------------------------------------- deadlines and idle CPU


def test_deadline_barrier_and_idle_cpu():
    """Deadline 2 s vs a rank 5 s late: DeadlineError naming the phase within 4 s; a 20 s deadline survives the same
    sleep; a late bcast root times out too; waiting ranks use < 30% CPU (they sleep, they do not spin)."""
    proc = run_mpi_script(4, SCRIPTS / "deadline.py", timeout=LAUNCH_TIMEOUT)
    _ok(proc, "deadline")
    assert "barrier deadline: DeadlineError after" in proc.stdout, explain(proc)
    assert "idle bcast_obj:" in proc.stdout, explain(proc)
    assert "gather_obj deadline: DeadlineError after" in proc.stdout, explain(proc)


# --------------------------------------------------------------------------- TP worlds


def test_tp_all_reduce_stays_inside_each_group():
    """runtime.start(tp=2) on 4 ranks: two independent gloo worlds; each all_reduce sums its own ranks only; each
    world's rendezvous store listens on loopback only."""
    proc = run_mpi_script(4, SCRIPTS / "tp_allreduce.py", ["2"], timeout=LAUNCH_TIMEOUT)
    _ok(proc, "tp_allreduce")
    # Values are 10**rank: group 0 (ranks 0, 1) sums to 11, group 1 (ranks 2, 3) to 1100, the world would be 1111.
    assert "group sums: [(0, 11), (1, 1100)], world sum 1111" in proc.stdout, explain(proc)
    assert "store listens on ['127.0.0.1'] port " in proc.stdout, explain(proc)  # not *:port (issue 27)


# --------------------------------------------------------------------------- failure containment


def test_exception_on_one_rank_aborts_the_job():
    """Rank 2 of 4 raises while the others wait in a barrier with a one-hour deadline: mpiexec ends non-zero within
    10 s of the raise, and the error is reported once, by rank 2."""
    proc = run_mpi_script(4, SCRIPTS / "crash.py", ["2"], timeout=60)
    ended = time.time()
    assert proc.returncode != 0, explain(proc)
    m = re.search(r"RAISING AT (\d+\.\d+)", proc.stdout)
    assert m, explain(proc)
    assert ended - float(m.group(1)) < 10.0, f"job took {ended - float(m.group(1)):.1f} s to end\n{explain(proc)}"
    assert proc.elapsed < 30.0, explain(proc)
    fatal = [line for line in proc.stderr.splitlines() if "mpitp: fatal" in line]
    assert fatal == ["[rank 2] mpitp: fatal RuntimeError: deliberate failure from the crash test"], explain(proc)
    assert proc.stderr.count("Traceback (most recent call last)") == 1, explain(proc)
    assert "got past the barrier" not in proc.stdout, explain(proc)


# --------------------------------------------------------------------------- mpitp info


def _table(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    head = [i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "node"]]
    assert len(head) == 1, stdout
    rows = []
    for line in lines[head[0] + 2:]:
        if not line.strip() or not line.split()[0].isdigit():
            break
        rows.append(line.split())
    return rows


def test_info_tp2_on_4_ranks_prints_the_layout_once():
    proc = run_mpi(4, ["info", "--tp", "2"], timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("world 4 = dp 2 x tp 2") == 1, explain(proc)
    assert proc.stdout.count("TP backend: gloo") == 1, explain(proc)
    rows = _table(proc.stdout)
    # columns: rank node local_rank dp_rank pp_rank tp_rank role device threads
    assert [[int(r[0]), int(r[3]), int(r[4]), int(r[5]), r[6], r[7]] for r in rows] == [
        [0, 0, 0, 0, "leader", "cpu"],
        [1, 0, 0, 1, "worker", "cpu"],
        [2, 1, 0, 0, "leader", "cpu"],
        [3, 1, 0, 1, "worker", "cpu"],
    ], explain(proc)


def test_info_pp2_tp2_prints_stages_and_the_layer_split(shared_dir):
    """TP fastest, then PP; --model shows which layers each stage loads (stories260K: 5 layers -> 3 + 2)."""
    model = shared_dir / "models" / "stories260K"
    proc = run_mpi(4, ["info", "--tp", "2", "--pp", "2", "--model", str(model)], timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("world 4 = dp 1 x pp 2 x tp 2") == 1, explain(proc)
    rows = _table(proc.stdout)
    assert [[int(r[0]), int(r[3]), int(r[4]), int(r[5]), r[6]] for r in rows] == [
        [0, 0, 0, 0, "leader"],
        [1, 0, 0, 1, "worker"],
        [2, 0, 1, 0, "stage-leader"],
        [3, 0, 1, 1, "worker"],
    ], explain(proc)
    assert f"pipeline split of {model}: stage 0: layers 0-2 (3), stage 1: layers 3-4 (2)" in proc.stdout, \
        explain(proc)
    bad = run_mpi(4, ["info", "--pp", "4", "--tp", "1", "--model", str(model)], timeout=LAUNCH_TIMEOUT)
    assert bad.returncode == 0, explain(bad)  # 4 stages of 5 layers: fine
    bad = run_mpi(2, ["info", "--pp", "2", "--tp", "2"], timeout=LAUNCH_TIMEOUT)
    assert bad.returncode == 2 and mpitp_stderr(bad.stderr).strip().splitlines() == [
        "mpitp: error: tp=2 x pp=2 = 4 does not divide world size 2"], explain(bad)


def test_info_tp3_on_4_ranks_is_one_usage_error():
    proc = run_mpi(4, ["info", "--tp", "3"], timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 2, explain(proc)
    # Printed once (rank 0), not once per rank, and nothing else.
    assert mpitp_stderr(proc.stderr).strip().splitlines() == ["mpitp: error: tp=3 does not divide world size 4"], \
        explain(proc)
    assert proc.stdout.strip() == "", explain(proc)


def _singleton(args):
    """``python -m mpitp ARGS`` with no launcher at all (and no launcher variables inherited)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "SLURM_", "PALS_", "MPIEXEC_"))}
    env.update(OFFLINE_ENV)
    return subprocess.run([sys.executable, "-m", "mpitp", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)


def test_info_singleton():
    proc = _singleton(["info"])
    assert proc.returncode == 0, explain(proc)
    assert "world 1 = dp 1 x tp 1 on 1 node(s), launcher: singleton" in proc.stdout, explain(proc)
    assert "TP backend: none (tp=1)" in proc.stdout, explain(proc)
    rows = _table(proc.stdout)
    assert [[r[0], r[3], r[4], r[5], r[6]] for r in rows] == [["0", "0", "0", "0", "leader"]], explain(proc)

    proc = _singleton(["info", "--tp", "2"])
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.strip().splitlines() == ["mpitp: error: tp=2 does not divide world size 1"], explain(proc)
