"""Fault drills inside a forward: a DP leader fails (an exception, a simulated out-of-memory) while its TP workers
are inside a torch collective of the same forward, or while the next pipeline stage waits for its activations.

The job must end within ``GONE_AFTER_ERROR`` seconds of the error line, print the real error once, and keep the rows
computed so far (status ``running``): no message to the stuck workers (``GEN_END``, ``stop``, a barrier) may stand
between the exception and the abort. Failures come from ``MPITP_TEST_RAISE_IN_FORWARD`` (mpitp/testing.py), which fires
in a forward pre-hook of the last decoder layer, after the earlier layers' all-reduces.

Out of memory there, on a leader or a worker, is a fault of the job rather than a bug: one line naming the rank, the
batch and the remedy, no traceback. So is a torch collective that runs past its deadline (gloo's own timeout): the
line an MPI wait gives, naming the phase.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mpitp.replica.protocol import ControlChannel
from support import REPO, STORIES
from support.launch import Launch, file_rows

GONE_AFTER_ERROR = 10.0
TIMEOUT = "60"  # the failure must surface long before this
DEMO_MC = ["eval", "--demo", "--tasks", "mpitp_demo_mc", "--limit", "6", "--batch-size", "1", "--bootstrap-iters",
           "0", "--timeout", TIMEOUT]


def _oom_line(rank: int) -> str:
    """The whole line an out-of-memory error in a forward (rank ``rank``, its third, batch size 1, tp=2) prints."""
    return (f"mpitp: error: rank {rank} on {socket.gethostname()}: out of memory in a forward of a batch of 1 rows in "
            f"a replica of 2 ranks (test hook: simulated out of memory inside a forward on rank {rank} after 2 "
            f"forwards); rerun with a smaller --batch-size and --resume")


CASES = {
    # name: (layout args, hook spec, expected error text; a whole line for a one-line error)
    "tp2-leader-raises": (["--tp", "2"], "0:3", "RuntimeError: test hook: injected failure inside a forward on rank 0"),
    "pp2-stage0-leader-raises": (["--pp", "2"], "0:3",
                                 "RuntimeError: test hook: injected failure inside a forward on rank 0"),
    "tp2-remote-leader-oom": (["--tp", "2"], "2:2:oom", _oom_line(2)),
    "tp2-worker-oom": (["--tp", "2"], "1:2:oom", _oom_line(1)),
}


def _check(job, rc, out, expected: str, label: str) -> str:
    assert rc != 0, job.explain()
    one_line = expected.startswith("mpitp: error: ")
    marker = "mpitp: error: " if one_line else "mpitp: fatal"
    fatal = [(t, line) for t, line in job.out["stderr"] if marker in line]
    assert len(fatal) == 1, f"the error must be printed once\n{job.explain()}"
    t_error, line = fatal[0]
    if one_line:  # a fault of the job (mpitp.errors.JobError): that line alone, no traceback
        assert line.rstrip("\n") == expected, job.explain()
        assert "Traceback" not in job.stderr and "mpitp: fatal" not in job.stderr, job.explain()
    else:
        assert expected in line, line
    assert "DeadlineError" not in job.stderr, job.explain()
    took = job.t_end - t_error
    assert took < GONE_AFTER_ERROR, f"job ended {took:.1f} s after the error\n{job.explain()}"
    status, n = file_rows(out)
    assert status == "running" and n > 0, (status, n)
    return (f"{label}: job gone {took:.2f} s after the error line, mpiexec exit {rc}, {n} rows kept, total wall "
            f"{job.t_end - job.t0:.1f} s")


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(CASES))
def test_leader_fails_inside_a_forward(case, tmp_path):
    layout, spec, expected = CASES[case]
    out = tmp_path / "failed.h5"
    with Launch(4, DEMO_MC + layout + ["--output", str(out)], env={"MPITP_TEST_RAISE_IN_FORWARD": spec}) as job:
        rc = job.wait(timeout=300)
    print(_check(job, rc, out, expected, case))


@pytest.mark.mpi
def test_leader_fails_inside_a_forward_under_the_api(tmp_path):
    """mpitp.evaluate (tp=2, 4 ranks): the API's closing barrier must not hold the real error back."""
    out = tmp_path / "api.h5"
    script = Path(__file__).parent / "mpi" / "api_fail.py"
    include = str(REPO / "mpitp" / "tasks" / "demo" / "tasks")
    with Launch(4, [str(STORIES), include, str(out), TIMEOUT], script=script,
                env={"MPITP_TEST_RAISE_IN_FORWARD": "0:3"}) as job:
        rc = job.wait(timeout=300)
    print(_check(job, rc, out, "RuntimeError: test hook: injected failure inside a forward on rank 0",
                 "mpitp.evaluate, tp2 leader raises"))


@pytest.mark.mpi
def test_a_launch_still_running_fails_with_each_rank_stack(tmp_path):
    """The drills' harness: a launch that outlives its wait fails the test with where every rank stands (py-spy), so a
    hang seen once in CI is diagnosed from its log (session 25: one hang in 1324 tests, none in 30 tries alone)."""
    script = tmp_path / "stuck.py"
    script.write_text("import time\n\ndef stuck_here():\n    time.sleep(120)\n\nstuck_here()\n")
    with Launch(2, [], script=script) as job:
        time.sleep(1)  # both ranks started
        with pytest.raises(pytest.fail.Exception) as failed:
            job.wait(timeout=2)
    message = str(failed.value)
    if "py-spy: " in message and ("ermission" in message or "not permitted" in message):
        pytest.skip("this machine does not let py-spy read another process (ptrace): no stacks in hang reports here")
    assert "mpiexec still running 2 s" in message, message
    assert message.count("stuck_here (stuck.py:4)") == 2, message  # rank 0 and rank 1 (py-spy: a dev dependency)
    assert "--- rank 0" in message and "--- rank 1" in message and "ranks alive: [0, 1]" in message, message


GLOO_PAIR = """
import sys, time, datetime, torch, torch.distributed as dist
from mpitp.parallel.deadline import torch_deadline
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=2))
if rank == 1:  # a stalled worker
    time.sleep(5)
    sys.exit(0)
try:
    with torch_deadline("TP control", 2.0):
        dist.broadcast(torch.zeros(3), src=0)
    print("stalled no error")
except Exception as exc:
    print("stalled", type(exc).__name__, " ".join(str(exc).split())[:200], flush=True)
"""


def test_a_torch_timeout_is_the_deadline_line_naming_the_phase(tmp_path):
    """gloo's own timeout (the replica's process group has --timeout too) on a broadcast to a stalled peer, real
    gloo in two processes: the one deadline line naming the phase, as when an MPI wait notices first (session 27: a
    traceback from inside gloo, once in four drills)."""
    import subprocess
    import sys

    script = tmp_path / "pair.py"
    script.write_text(GLOO_PAIR)
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), store], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    out = procs[0].communicate(timeout=60)[0]
    procs[1].communicate(timeout=60)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith("stalled"))
    assert lines["stalled"] == ("DeadlineError timed out after 2 s in phase 'TP control' (a peer rank did not "
                                "arrive; raise --timeout if this phase is legitimately slow)"), out


def test_a_job_error_is_one_line_without_traceback(monkeypatch, capsys):
    """What :func:`mpitp.errors.report_and_abort` prints for an out-of-memory error of a replica with workers."""
    from mpitp import errors

    def abort(code=1, join_peers=False):
        raise SystemExit(code)

    monkeypatch.setattr(errors, "abort", abort)
    monkeypatch.setattr(errors, "_stderr", lambda: __import__("sys").stderr)
    monkeypatch.setattr(errors, "_node_name", lambda: "nodeA")
    channel = ControlChannel(SimpleNamespace(replica_size=2, pp=1), 10.0, "cpu")
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        except torch.OutOfMemoryError as exc:
            raise channel.out_of_memory(exc, "a batch of 8 rows") from exc
    except RuntimeError as exc:
        with pytest.raises(SystemExit) as exited:
            errors.report_and_abort(exc)
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        "\nmpitp: error: rank 0 on nodeA: out of memory in a forward of a batch of 8 rows in a replica of 2 ranks "
        "(CUDA out of memory. Tried to allocate 2.00 GiB); rerun with a smaller --batch-size and --resume\n")
