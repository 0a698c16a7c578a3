"""Python files in the working directory never run inside mpitp's own child interpreters (issue 37, item 4).

mpitp starts Pythons of its own: ``mpitp check`` before ``mpitp submit`` queues a job, prefetch's checks, the model
check beside the task checks, and submit's question to mpi4py about the linked MPI. Started as ``python -m mpitp`` or
``python -c CODE``, each had the working directory first on ``sys.path``: a ``json.py``, ``yaml.py`` or ``mpitp.py``
in a shared job folder ran, as whoever submitted from there, at the first ``import``. Each child now starts isolated
(``-I``) with this process's ``sys.path`` (:mod:`mpitp.isolated`); these tests plant such modules in the working
directory, start each child from there, and require that none of them ran and that the child still did its work.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mpitp.jobs.readiness import CheckSpec, check
from support import STORIES
from support.offline_data import arc_rows, write_jsonl

#: Modules the children import (or, for ``mpitp``, run) first; each planted copy leaves a marker when imported.
PLANTED = ("json", "yaml", "mpitp", "runpy", "mpi4py", "click", "transformers", "torch", "pip")


@pytest.fixture
def job_folder(tmp_path, monkeypatch) -> Path:
    """A shared job folder with planted modules, as the working directory; ``DATA`` beside them serves arc_easy."""
    folder = tmp_path / "jobs"
    folder.mkdir()
    for name in PLANTED:
        (folder / f"{name}.py").write_text(f"open({str(folder / ('RAN-' + name))!r}, 'w').close()\n")
    write_jsonl(folder / "DATA" / "arc_easy" / "test.jsonl", arc_rows(3, "job"))
    monkeypatch.chdir(folder)
    return folder


def ran(folder: Path) -> list[str]:
    return sorted(p.name.removeprefix("RAN-") for p in folder.glob("RAN-*"))


def test_model_check_child_ignores_the_working_directory(job_folder, monkeypatch):
    """The model-check child ran ``import json`` before it replaced ``sys.path``: the planted json.py ran."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # two cores: the child starts
    report = check(CheckSpec(tasks=("arc_easy",), data_dir="DATA", model=str(STORIES)))
    assert ran(job_folder) == []
    assert report.model_beside  # the child answered (its problems would be here: none)
    assert report.ready, [p.line() for p in report.problems]


def test_environment_info_ignores_the_working_directory(job_folder):
    """lm-eval stores torch's ``collect_env`` text, which runs ``python -mpip list`` with its working directory first
    on ``sys.path``: on rank 0 of ``mpitp eval`` a planted pip.py ran (found in review; old code: RAN-pip)."""
    from mpitp.evaluation.envinfo import env_info_isolated

    info = env_info_isolated()
    assert ran(job_folder) == []
    assert "PyTorch version" in info, info[:500]


def test_git_commits_are_quiet_and_read_no_planted_git_file(job_folder, capfd):
    """lm-eval's ``git_hash`` ran ``git describe`` with git's stderr on the terminal ("fatal: not a git repository"
    on every run from a job folder), then, as its ``upper_git_hash`` does for the parent folder, read ``.git/HEAD``
    and the file it names by hand: a planted HEAD naming a FIFO held rank 0 forever (lm-eval's own: still blocked
    after 8 s, checked by hand). mpitp's: quiet, git only, None where git cannot say; a real repository's commit as
    git gives it."""
    import subprocess
    import time

    from mpitp.evaluation.envinfo import folder_commit_quietly, git_hash_quietly

    os.mkfifo(job_folder / "fifo")
    (job_folder / ".git").mkdir()
    (job_folder / ".git" / "HEAD").write_text(f"ref: {job_folder / 'fifo'}\n")
    t0 = time.monotonic()
    assert git_hash_quietly() is None
    assert folder_commit_quietly(job_folder) is None
    assert folder_commit_quietly(job_folder / "DATA") is None  # no .git there: git is not asked
    assert time.monotonic() - t0 < 10
    assert capfd.readouterr().err == ""
    repo = job_folder / "repo"
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["init", "-q", str(repo)], ["-C", str(repo), "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", *argv], check=True, env=env)
    os.chdir(repo)
    short = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True).stdout
    full = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    assert git_hash_quietly() == short.strip() and len(short.strip()) >= 7
    assert folder_commit_quietly(str(repo / "..")) is None  # the job folder: its planted .git is no repository
    assert folder_commit_quietly(repo) == full.strip()


def test_mpi_probe_ignores_the_working_directory(job_folder, monkeypatch):
    """``mpitp submit --srun-mpi auto`` asks mpi4py (MPI not initialised) which MPI it is linked against."""
    from mpitp.jobs.submit import linked_mpi

    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)  # ask the child, as a fresh submit does
    family = linked_mpi()
    assert ran(job_folder) == []
    assert family is not None and family.split()[0] in ("MPICH", "Open"), family


@pytest.mark.mpi  # each starts `python -m mpitp check` (isolated), as test_offline_check's do
def test_submit_and_prefetch_checks_ignore_the_working_directory(job_folder, monkeypatch):
    """``mpitp submit``'s readiness check and ``mpitp prefetch``'s checks run ``mpitp check`` in a child: it found
    the planted ``mpitp.py`` before the package. From the job folder, both still check and pass."""
    from mpitp.jobs.prefetch import fetch_until_ready
    from mpitp.jobs.submit import submit

    bin_dir = job_folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {job_folder}/queued\necho 'Submitted batch job 42'\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    job = job_folder / "job.yaml"
    job.write_text(f"runs:\n  - name: shared\n    model: {STORIES}\n    tasks: [arc_easy]\n    data_dir: DATA\n"
                   f"    output: out.h5\n")
    assert submit("slurm", job, nodes=1, ranks_per_node=1, time="00:10:00") == "42"
    assert (job_folder / "queued").exists()  # the check passed: it ran, and found the package, not mpitp.py
    assert ran(job_folder) == []

    done = fetch_until_ready(CheckSpec(tasks=("arc_easy",), data_dir="DATA"), None, None, echo=lambda line: None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("mpitp check: ready offline: arc_easy"), done.stdout
    assert ran(job_folder) == []


def test_the_mpi_marker_guard_sees_the_isolated_children():
    """``python -m mpitp check`` initialises MPI (a singleton world): started isolated it still needs the ``mpi``
    marker (tests/support/mpi.py), and the argv runs the same command line."""
    from mpitp.isolated import mpitp_argv
    from support.mpi import launch_in

    argv = mpitp_argv("check", "job.yaml")
    assert argv[1:3] == ["-I", "-c"] and argv[-3:] == ["--", "check", "job.yaml"]
    assert "" not in argv and "." not in argv  # no relative sys.path entry: the working directory again
    assert launch_in(argv) == "python -m mpitp check"
    assert launch_in(mpitp_argv("inspect", "a.h5")) is None and launch_in(mpitp_argv("check", "--help")) is None
