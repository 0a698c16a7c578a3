"""Markers and the guard that keeps them true, and the shared fixtures. Helpers live in the ``support`` package.

``mpi``: the test starts an MPI world (``mpiexec``, ``srun``, ``torchrun``, a singleton ``python -m mpitp``). Every
such start fails a test not marked ``mpi`` (:class:`support.mpi.GuardedPopen` replaces ``subprocess.Popen`` for the
session and :func:`support.mpi.mpiexec_path` checks too), so ``pytest -m "not mpi"`` stays fast and needs no MPI.
``slurm`` tests submit to a real SLURM and must carry ``mpi`` as well (checked at collection). ``slow``: over about
20 s on an idle machine; unmarked tests that took longer are listed at the end of the run (loaded machines are slow,
so this is a reminder, never a failure).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from support import SHARED, STORIES
from support import mpi as _mpi

# The suite steers its runs through MPITP_TEST_* hooks (mpitp.testing), live only with this opt-in; every process
# the suite starts (mpiexec, the emulated nodes, SLURM jobs) inherits it.
os.environ["MPITP_TESTING"] = "1"

SLOW_S = 20.0
_seconds: dict[str, float] = {}  # setup + call of each test not marked slow


def pytest_configure(config):
    config._mpitp_popen = subprocess.Popen
    subprocess.Popen = _mpi.GuardedPopen


def pytest_unconfigure(config):
    subprocess.Popen = getattr(config, "_mpitp_popen", subprocess.Popen)


def pytest_collection_modifyitems(config, items):
    missing = [item.nodeid for item in items if item.get_closest_marker("slurm") and not item.get_closest_marker("mpi")]
    if missing:
        raise pytest.UsageError("marked slurm but not mpi (a SLURM job is an MPI launch): " + ", ".join(missing))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The guard in :mod:`support.mpi` judges launches by the test that runs them, fixtures included."""
    _mpi.set_running_test(item)
    try:
        return (yield)
    finally:
        _mpi.set_running_test(None)


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call") and "slow" not in report.keywords:
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    over = sorted(((took, nodeid) for nodeid, took in _seconds.items() if took > SLOW_S), reverse=True)
    if over:
        terminalreporter.section(f"over {SLOW_S:.0f} s but not marked slow (mark them if an idle machine agrees)")
        for took, nodeid in over:
            terminalreporter.write_line(f"{took:7.1f} s  {nodeid}")


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not STORIES.is_dir():
        pytest.skip(f"{SHARED} not present (the tests read real models and data from ../shared)")
    return SHARED


@pytest.fixture(scope="session")
def test_tasks(tmp_path_factory, shared_dir) -> str:
    """Include path with the offline stock tasks (arc_easy_local, wikitext_local, ...) on ../shared/data."""
    from support.tasks import materialize_test_tasks

    return materialize_test_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture
def gloo_world(tmp_path):
    """A ``torch.distributed`` gloo world of one rank (a file store), torn down after: the process-group calls of
    a tensor-parallel layer, run in one process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def demo_file(tmp_path_factory) -> str:
    """One real ``mpiexec -n 2 mpitp eval --demo`` run (dp 2 x tp 1, samples logged), read-only, shared by every test
    of the session that needs a real results file (``mpitp inspect``'s, ``mpitp report``'s): one launch for all."""
    d = tmp_path_factory.mktemp("inspect_demo")
    out = d / "demo.h5"
    proc = _mpi.run_mpi(2, ["eval", "--demo", "--tp", "1", "--limit", "5", "--log-samples", "--output", str(out),
                            "--overwrite"], timeout=600, cwd=str(d))
    assert proc.returncode == 0 and out.exists(), _mpi.explain(proc)
    os.chmod(out, 0o444)  # tests modify copies only
    return str(out)
