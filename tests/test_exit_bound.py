"""The exit path is bounded from outside the interpreter (issue 42).

mpi4py calls ``MPI_Finalize`` holding the GIL, so the Python timer that used to bound it never fired: a node whose
link went down while the ranks left held every rank in ``MPI_Finalize`` until walltime. :mod:`mpitp.watchdog` bounds
such a call with faulthandler's C thread and a watchdog process; these tests block the call for real: a C function
that holds the GIL (the stand-in) and ``MPI_Finalize`` waiting for a rank that never arrives (one node). The link of
an emulated node cut while the ranks leave, issue 42's own reproduction, is a cell of ``tests/test_fault_matrix.py``
(``exit-link_cut``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from support.mpi import explain, mpi_family, mpitp_stderr, run_mpi, run_mpi_script

STAND_IN = textwrap.dedent("""
    import ctypes, sys, time
    from mpitp.watchdog import bounded
    t = time.monotonic()
    with bounded(5.0, "returned: never printed"):
        time.sleep(0.2)
    print(f"in time {time.monotonic() - t:.2f}", flush=True)
    with bounded(float(sys.argv[1]), "mpitp: error: the stand-in did not complete within the bound"):
        ctypes.PyDLL(None).sleep(60)  # libc sleep through PyDLL: the GIL stays held, as in MPI_Finalize
    print("not reached", flush=True)
""")


def test_a_call_holding_the_gil_is_ended_with_one_line():
    """A Python timer cannot fire while a C call holds the GIL; the bound still ends the process, with status 1 and
    exactly the one prepared line on stderr (the stack dump goes to the watchdog's pipe, not the terminal). A block
    that returns in time prints nothing and leaves no watchdog process behind."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STAND_IN, "1.5"], capture_output=True, text=True, timeout=50)
    took = time.monotonic() - t0
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.startswith("in time 0.2") and "not reached" not in proc.stdout, proc.stdout
    assert proc.stderr.splitlines() == ["mpitp: error: the stand-in did not complete within the bound"], proc.stderr
    assert took < 20, took  # 1.5 s bound + interpreter start; the stand-in alone sleeps 60 s
    # this test's own watchdogs, by their messages (another job's run on the machine has watchdogs of its own)
    left = subprocess.run(["pgrep", "-f", "mpitp-watchdog (returned: never printed|mpitp: error: the stand-in)"],
                          capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def test_bounds_do_not_nest():
    """faulthandler has one timer per process: an inner bound would silently replace the outer one."""
    from mpitp.watchdog import bounded

    with bounded(30, "outer"):
        with pytest.raises(RuntimeError, match="does not nest"):
            with bounded(30, "inner"):
                pass
    with bounded(30, "again"):  # the outer one was released
        pass


NUDGE = "from mpitp.watchdog import launcher_nudge; print('nudge:', launcher_nudge(), flush=True)\n"


@pytest.mark.mpi
def test_the_launcher_to_nudge_is_found(tmp_path):
    """Under a local Hydra the nudge is a SIGTERM to that very mpiexec (checked by name first); in a SLURM step it
    cancels the step; elsewhere there is none."""
    import shutil

    from mpitp.watchdog import launcher_nudge
    from support.mpi import run_mpi_script

    script = tmp_path / "nudge.py"
    script.write_text(NUDGE)
    proc = run_mpi_script(1, script, timeout=60)
    assert proc.returncode == 0, explain(proc)
    said = proc.stdout.strip().splitlines()[-1]
    if mpi_family() == "mpich":
        pid = int(re.search(r"kill -TERM (\d+)$", said).group(1))
        assert "= mpiexec ]" in said and pid > 1, said  # the launcher (its name is checked again before the signal)
    else:
        assert said == "nudge: None", said  # prterun: it notices a lost daemon itself
    assert launcher_nudge({}) is None or "kill -TERM" not in (launcher_nudge({}) or "")
    if shutil.which("scancel"):
        assert launcher_nudge({"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "3"}) == "scancel --quiet 12.3"


@pytest.mark.mpi
@pytest.mark.openmpi
def test_mpi_finalize_waiting_for_a_rank_is_bounded():
    """Rank 1 does not reach ``MPI_Finalize`` (it stalls 120 s first); rank 0 sits in it, in C, holding the GIL.
    With a 3 s bound rank 0 leaves with one line naming its rank, node and the phase, and the launcher ends the job
    within seconds, not after rank 1's stall (the old Python timer never fired: the job lasted the whole stall)."""
    env = {"MPITP_TEST_STALL": "before_finalize_rank1:120", "MPITP_TEST_FINALIZE_WAIT": "3"}
    t0 = time.monotonic()
    proc = run_mpi(2, ["info", "--tp", "1"], env=env, timeout=100)
    took = time.monotonic() - t0
    err = mpitp_stderr(proc.stderr)
    assert proc.returncode != 0, explain(proc)
    assert "mpitp: error: rank 0 on " in err and "MPI_Finalize did not complete within 3 s" in err, explain(proc)
    assert "Traceback" not in err, explain(proc)
    assert took < 60, (took, explain(proc))
    print(f"MPI_Finalize blocked ({mpi_family()}): job gone {took:.1f} s after start (bound 3 s, rank 1 stalls 120 s)")


@pytest.mark.mpi
@pytest.mark.openmpi
def test_a_rank_failing_before_mpi_started_ends_the_job():
    """Rank 0 raises before it imports mpi4py.MPI; rank 1 waits for it in MPI_Init (then in a barrier with a one-hour
    deadline). The failing rank starts MPI to abort its peers: the job ends in seconds with rank 0's report once (it
    hung in MPI_Init until killed before: the failing rank exited without MPI, which no launcher here notices)."""
    from support import REPO

    proc = run_mpi_script(2, REPO / "tests" / "mpi" / "crash_before_mpi.py", timeout=120)
    err = mpitp_stderr(proc.stderr)
    assert proc.returncode != 0, explain(proc)
    assert err.count("mpitp: fatal RuntimeError: deliberate failure before MPI started") == 1, explain(proc)
    assert "got past the barrier" not in proc.stdout, explain(proc)
    assert proc.elapsed < 30, (proc.elapsed, explain(proc))


def test_a_stop_before_the_results_file_exists_does_not_point_at_one(monkeypatch, capfd):
    """SIGTERM during the checks or the model load: there is no results file of this run yet, so the stop line says
    that no request was scored instead of "every request that landed is in the results file"."""
    from mpitp.parallel import walltime

    aborted = []
    monkeypatch.setattr(walltime, "_writer", None)
    monkeypatch.setattr(walltime, "_dispatcher", None)
    monkeypatch.setattr(walltime, "abort", aborted.append)
    walltime._flush_and_abort(signal.SIGTERM)
    sys.__stderr__.flush()
    err = capfd.readouterr().err
    assert aborted == [walltime.STOP_EXIT]
    assert "mpitp: stopping on SIGTERM: no request of this run had been scored yet; run the job file again" in err
    assert "results file" not in err, err


def test_an_mpi_error_waits_for_the_peer_abort_that_caused_it():
    """A rank in a receive when its peer aborts (scancel: rank 0 stops, aborts) gets an MPI error from its MPI call;
    it waits for the abort instead of printing a traceback of its own at once (``report_and_abort``)."""
    probe = ("import mpi4py; mpi4py.rc.initialize = False\n"  # no MPI world in the test's process
             "from mpi4py import MPI\nfrom mpitp.errors import _peer_lost\n"
             "print(_peer_lost(MPI.Exception(MPI.ERR_OTHER)), _peer_lost(RuntimeError('[gloo] Connection closed by "
             "peer [10.0.0.2]:1234')), _peer_lost(RuntimeError('a bug of this rank')))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["True", "True", "False"], p.stdout + p.stderr


def test_nothing_new_starts_while_a_stop_aborts(monkeypatch):
    """The dispatcher's next chunk, a job's next run and a sweep's next item wait while a stop is under way (its own
    thread flushes and aborts); they went on, into the next run and the job's summary."""
    import inspect
    import threading

    from mpitp.evaluation import dispatch
    from mpitp.jobs import jobrun, sweep
    from mpitp.parallel import walltime
    for where in (dispatch.Dispatcher.run, jobrun.run_job, sweep.run_each):
        assert "hold_if_stopping()" in inspect.getsource(where), where.__qualname__
    monkeypatch.setattr(walltime, "_stopping", True)
    t = threading.Thread(target=walltime.hold_if_stopping, daemon=True)
    t.start()
    t.join(1.2)
    assert t.is_alive()
    walltime._stopping = False
    t.join(2)
    assert not t.is_alive()


def test_a_sigterm_on_a_rank_other_than_0_ends_it_after_the_grace():
    """_await_stop's timer ran _die_by on its own thread, where signal.signal raises: a traceback, and the rank lived
    on with its SIGTERM lost (mpiexec -n 2, SIGTERM to rank 1 mid-run: the job ran to the end, exit 0)."""
    script = textwrap.dedent("""
        import os, signal, time
        from mpitp.parallel import walltime
        walltime.STOP_GRACE_S = 0.3
        walltime.install(1)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            time.sleep(0.1)
        print("still alive")
    """)
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "still alive" not in proc.stdout, proc.stderr
    assert time.monotonic() - t < 8


def test_a_sigterm_after_the_command_finished_changes_nothing():
    """SIGTERM to rank 0 while it left a finished run (in MPI_Finalize): the stop said "no request of this run had
    been scored yet; run the job file again" and exited 75, the results file complete."""
    script = textwrap.dedent("""
        import os, signal, time
        from mpitp.parallel import walltime
        walltime.install(0)
        walltime.finished()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
        print("left normally")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "left normally" in proc.stdout, (proc.returncode, proc.stderr)
    assert "stopping on" not in proc.stderr, proc.stderr
