"""Shared helpers: real ``mpiexec`` launches of real ``mpitp`` processes, offline task data, reference runs."""

from __future__ import annotations

import os
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


def mpiexec_path() -> str:
    """The ``mpiexec`` installed beside this Python (the PyPI MPICH), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec available")
    return found


def run_mpi(n: int, args: list[str], timeout: float = 600, env: dict | None = None, cwd=None,
            module: str = "mpitp") -> subprocess.CompletedProcess:
    """``mpiexec -n N python -m mpitp ARGS`` (or another module); returns the finished process with timing."""
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, "-m", module, *args]
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    proc.elapsed = time.monotonic() - t0
    return proc


def run_mpi_script(n: int, script: Path, args: list[str] = (), timeout: float = 300,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, str(script), *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **OFFLINE_ENV, **(env or {})})
    proc.elapsed = time.monotonic() - t0
    return proc


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
