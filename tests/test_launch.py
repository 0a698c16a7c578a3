"""Launch checks: a launcher that starts N tasks MPI does not join refuses before loading; one writer per output.

The real ``srun --mpi=none`` case runs in tests/test_slurm.py (it needs a SLURM); here torchrun, the launcher PyTorch
users reach for first, starts real singletons, and real processes race for one ``--output``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitp.parallel.netaddr import interface_addresses
from support import OFFLINE_ENV
from support.mpi import explain, mpitp_stderr, run_mpi

SMALL = ["eval", "--demo", "--tasks", "mpitp_demo_mc", "--limit", "2", "--bootstrap-iters", "0"]


def _singleton(args, cwd=None, **popen):
    return subprocess.Popen([sys.executable, "-m", "mpitp", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, env={**os.environ, **OFFLINE_ENV}, **popen)


@pytest.mark.mpi
def test_torchrun_two_singletons_refuse(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this Python")
    out = tmp_path / "x.h5"
    t0 = time.monotonic()
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "mpitp", *SMALL, "--output", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE_ENV})
    took = time.monotonic() - t0
    line = ("mpitp: error: torchrun started 2 tasks (WORLD_SIZE=2) but MPI sees a world of 1: each process would run "
            "the whole evaluation alone; mpitp is launched by MPI, not torchrun: run `mpiexec -n 2 mpitp ...`")
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mpitp:")]
    # One line from each task that got that far: torchrun SIGTERMs the other worker as soon as one fails, so the
    # second line is there only when both refused within the same instant.
    assert lines in ([line], [line, line]), explain(proc)
    assert proc.stderr.count("exitcode  : 2") >= 1, explain(proc)  # torchrun's report of the tasks that exited 2
    assert not re.search(r'File "[^"]*/mpitp/', proc.stderr), explain(proc)  # torchrun's own traceback only
    assert not out.exists() and not list(tmp_path.iterdir()), list(tmp_path.iterdir())
    print(f"torchrun --nproc-per-node 2: {len(lines)} task(s) refused with exit 2 before torchrun stopped the "
          f"rest, {took:.1f} s, no file")


@pytest.mark.mpi
@pytest.mark.openmpi
def test_launcher_count_above_mpi_world_is_one_usage_error(tmp_path):
    """An MPI world of 2 whose launcher environment says 4 srun tasks (the variables a 4-task step sets)."""
    out = tmp_path / "x.h5"
    proc = run_mpi(2, [*SMALL, "--output", str(out)], timeout=120,
                   env={"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
    assert proc.returncode == 2, explain(proc)
    msg = "mpitp: error: srun started 4 tasks (SLURM_STEP_NUM_TASKS=4) but MPI sees a world of 2"
    assert proc.stderr.count(msg) == 1 and "srun --mpi=" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr and not out.exists()


def _own_lines(stderr: str) -> str:
    """What mpitp said, without lm-eval's own timestamped log lines (``--limit`` draws its "SHOULD ONLY BE USED FOR
    TESTING" warning from lm-eval's argument parsing, as under ``lm_eval`` itself)."""
    lm_eval_log = re.compile(r"^\d{4}-\d{2}-\d{2}:\d{2}:\d{2}:\d{2} (DEBUG|INFO|WARNING) ")
    return "\n".join(ln for ln in stderr.strip().splitlines() if not lm_eval_log.match(ln))


@pytest.mark.mpi
def test_second_writer_is_refused_and_stale_claims_are_taken_over(tmp_path):
    from mpitp.results.claim import claim_output, claim_path

    out = tmp_path / "x.h5"
    held = claim_output(str(out))
    try:
        t0 = time.monotonic()
        proc = _singleton([*SMALL, "--output", str(out)])
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, stderr
        assert _own_lines(stderr) == (f"mpitp: error: output {out} is being written by another mpitp process (pid "
                                  f"{os.getpid()} on {os.uname().nodename}); wait for it to finish or choose another "
                                  f"--output"), stderr
        assert not out.exists()
        refused = time.monotonic() - t0
    finally:
        held.release()
    assert not Path(claim_path(str(out))).exists()

    # A claim whose owner was killed: the file stays behind, its lock went with the process.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mpitp.results.claim import claim_output; "
                               f"claim_output({str(out)!r}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert Path(claim_path(str(out))).exists()
    proc = _singleton([*SMALL, "--output", str(out)])
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert out.exists() and not Path(claim_path(str(out))).exists()
    print(f"held claim: second writer refused in {refused:.1f} s; stale claim of a SIGKILLed owner taken over")


@pytest.mark.mpi
def test_two_singletons_on_one_output_never_both_write(tmp_path):
    out = tmp_path / "x.h5"
    procs = [_singleton([*SMALL, "--output", str(out)], cwd=tmp_path) for _ in range(2)]
    done = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    codes = sorted(rc for _, _, rc in done)
    assert codes == [0, 2], [(rc, err[-2000:]) for _, err, rc in done]
    loser = _own_lines(next(err for _, err, rc in done if rc == 2))
    assert loser.startswith(f"mpitp: error: output {out} ") and loser.count("\n") == 0, loser
    assert ("is being written by another mpitp process" in loser or "already exists" in loser), loser
    from mpitp.results.schema import open_h5

    with open_h5(str(out)) as f:
        assert f.attrs["status"] == "complete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.h5"]  # no claim, no temporary left
    print(f"two singletons on one output: one wrote it, the other said: {loser}")


@pytest.mark.mpi
def test_info_names_the_mpi_and_the_launcher():
    proc = run_mpi(2, ["info"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    text = proc.stdout
    assert "launcher: " in text and ("mpiexec (Hydra/PMI)" in text or "prterun (Open MPI)" in text), text
    assert "\x00" not in text
    mpi_line = next(ln for ln in text.splitlines() if ln.startswith("MPI: "))
    assert mpi_line.startswith(("MPI: MPICH ", "MPI: Open MPI ")), mpi_line
    # --iface naming an interface no node has: one line on every rank's exit 2, not another network in silence
    proc = run_mpi(2, ["info", "--iface", "nosuchnic9"], timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert mpitp_stderr(proc.stderr).strip().splitlines() == [
        f"mpitp: error: --iface nosuchnic9 (MPITP_IFACE): node {socket.gethostname()} has no interface of that name "
        "with a non-loopback IPv4 address (it has " + ", ".join(
            f"{n} {' '.join(a)}" for n, a in sorted(interface_addresses().items())) + ")"], explain(proc)


def test_mpi_strings_are_cleaned():
    from mpitp.parallel.world import clean_mpi_string, mpi_library_version

    assert clean_mpi_string("Open MPI v5.0.11, ... Sep 16, 2026\x00") == "Open MPI v5.0.11, ... Sep 16, 2026"
    assert clean_mpi_string(b"host\x00junk") == "host"
    assert clean_mpi_string("a\x07b") == "a b"
    version = mpi_library_version()
    assert version and "\x00" not in version and version.isprintable()


def test_srun_variables_are_read_only_inside_steps():
    from mpitp.parallel.launch import launcher_tasks

    # A batch script's own shell: SLURM_NTASKS of the allocation, no step variables: mpirun -n 2 inside is fine.
    assert launcher_tasks({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}) == []


def test_oversubscription_warning_names_the_setting_only_where_it_is_off():
    from mpitp.parallel.launch import oversubscription_warning

    assert oversubscription_warning(2, 2, "MPICH 5.0.2") is None
    assert oversubscription_warning(4, 2, "MPICH 5.0.2") == "4 ranks on 2 cores: oversubscribed (slow; fine for " \
                                                           "trying things out)"
    # mpirun --oversubscribe turns Open MPI's yield on by itself (it was given 2 slots for 4 ranks); srun does not.
    over = {"OMPI_UNIVERSE_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "4"}
    assert "yield" not in oversubscription_warning(4, 2, "Open MPI 5.0.11", "prterun (Open MPI)", env=over)
    # mpirun --host localhost:4 --bind-to none on 2 cores: 4 slots claimed, mpi_yield_when_idle=false (default)
    claimed = {"OMPI_UNIVERSE_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "4"}
    assert oversubscription_warning(4, 2, "Open MPI 5.0.11", "prterun (Open MPI)", env=claimed).endswith(
        "export OMPI_MCA_mpi_yield_when_idle=1")
    assert oversubscription_warning(4, 2, "Open MPI 5.0.11", "srun (PMIx)", env={}).endswith(
        "export OMPI_MCA_mpi_yield_when_idle=1")
    assert "yield" not in oversubscription_warning(4, 2, "Open MPI 5.0.11", "srun (PMIx)",
                                                   env={"OMPI_MCA_mpi_yield_when_idle": "1"})


def test_binding_warning_only_where_open_mpi_bound_the_ranks_to_fewer_cores():
    from mpitp.parallel.launch import binding_warning

    # mpirun -n 1 on 2 cores: Open MPI bound the rank to core 0 (threads 1); --bind-to none: both cores (threads 2)
    said = binding_warning(1, 2, "Open MPI 5.0.11", "prterun (Open MPI)")
    assert said == ("its ranks are bound to 1 of the 2 cores their launcher may use (Open MPI binds each rank to a "
                    "core when it starts 2 or fewer): `mpirun --bind-to none` lets their threads use all 2")
    assert binding_warning(2, 2, "Open MPI 5.0.11", "prterun (Open MPI)") is None
    assert binding_warning(1, 2, "MPICH 5.0.2", "mpiexec (Hydra)") is None  # Hydra binds only when asked
    assert binding_warning(1, 2, "Open MPI 5.0.11", "srun (PMIx)") is None  # SLURM's binding is the site's choice


@pytest.mark.mpi
@pytest.mark.openmpi
def test_info_warns_where_open_mpi_bound_a_rank_to_one_core():
    """Under Open MPI's mpirun -n 1 (bound to one core by default) on a node of more cores: the warning, 1 thread."""
    if os.cpu_count() < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    from support.mpi import mpiexec_path

    # without --oversubscribe (mpiexec_cmd's, which turns Open MPI's binding off)
    proc = run_mpi(1, ["info"], timeout=120, launcher=[mpiexec_path(), "-n", "1"])
    assert proc.returncode == 0, explain(proc)
    family = "Open MPI" if "MPI: Open MPI" in proc.stdout else "MPICH"
    warned = "Open MPI binds each rank to a core when it starts 2 or fewer" in proc.stdout
    assert warned == (family == "Open MPI"), explain(proc)
