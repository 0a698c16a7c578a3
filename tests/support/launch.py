"""A launch watched while it runs (fault drills strike it mid-run), results-file polling, ``mpitp inspect diff``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil  # accelerate's dependency: always installed beside mpitp
import pytest

from . import OFFLINE_ENV
from .mpi import installed, mpi_env, mpiexec_cmd


def file_rows(path) -> tuple[str | None, int]:
    """(status, number of request rows) of a results file, (None, 0) while it does not exist or cannot be read."""
    from mpitp.results.rows import load_rows

    try:  # the HDF5 snapshot and the journal beside it (rows landed since the snapshot)
        attrs, counts = load_rows(str(path), counts_only=True)
        return str(attrs.get("status")), sum(counts.values())
    except (OSError, KeyError):
        return None, 0


def _dump(py_spy: str, pid: int) -> str:
    """``py-spy dump`` of one process: Python and native frames, Python's alone where native unwinding fails; else
    what py-spy said."""
    said = ""
    for native in (["--native"], []):
        try:
            dump = subprocess.run([py_spy, "dump", *native, "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=30)
        except subprocess.TimeoutExpired:
            said = "py-spy dump took over 30 s"
            continue
        if dump.returncode == 0:
            return dump.stdout.strip()
        said = f"py-spy: {dump.stderr.strip()}"
    return said


def inspect_diff(a, b, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpitp", "inspect", "diff", str(a), str(b), *extra],
                          capture_output=True, text=True, timeout=120)


class Launch:
    """``mpiexec -n N python -m mpitp ARGS`` in its own session; output lines are kept with their arrival time."""

    def __init__(self, n: int, args: list[str], env: dict | None = None, cwd=None, script=None,
                 launcher: list[str] | None = None, module: str = "mpitp"):
        """``script``: run ``python SCRIPT ARGS`` instead of ``python -m MODULE ARGS``. ``launcher``: the launch prefix
        for N ranks instead of the local ``mpiexec -n N`` (ranks started over ssh on other nodes:
        :mod:`support.nodes`); the ranks are then found by the tag this launch puts in their environment."""
        entry = [str(script)] if script else ["-m", module]
        cmd = [*(launcher or mpiexec_cmd(n)), sys.executable, *entry, *args]
        self.t0 = time.monotonic()
        self.t_end: float | None = None
        self.tag = f"{os.getpid()}-{time.monotonic_ns()}" if launcher else None
        tag = {"MPITP_TEST_LAUNCH_TAG": self.tag} if self.tag else {}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                     env={**os.environ, **OFFLINE_ENV, **mpi_env(), **(env or {}), **tag},
                                     start_new_session=True)
        self.out: dict[str, list[tuple[float, str]]] = {"stdout": [], "stderr": []}
        self.readers = [threading.Thread(target=self._read, args=(s, name), daemon=True)
                        for s, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr"))]
        for t in self.readers:
            t.start()
        self.pids: dict[int, int] = {}

    def _read(self, stream, name):
        for raw in iter(stream.readline, b""):
            self.out[name].append((time.monotonic(), raw.decode("utf-8", "replace")))

    @property
    def stdout(self) -> str:
        return "".join(s for _, s in self.out["stdout"])

    @property
    def stderr(self) -> str:
        return "".join(s for _, s in self.out["stderr"])

    def explain(self) -> str:
        return f"exit {self.proc.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-6000:]}"

    def rank_pids(self) -> dict[int, int]:
        """Global rank -> pid of the python processes under this mpiexec.

        A rank's own subprocesses inherit its environment (rank 0 runs ``pip list`` while lm-eval collects its
        environment info through torch.utils.collect_env), so a rank is the topmost process carrying the rank
        variable: one whose parent does not carry it too. (Taking the last match picked that ``pip``: a SIGKILL or
        SIGUSR1 meant for rank 0 hit it and the run went on to exit 0.)
        """
        tagged = {}
        procs = psutil.process_iter() if self.tag else psutil.Process(self.proc.pid).children(recursive=True)
        for child in procs:
            try:
                env = child.environ()
                parent = child.ppid()
            except (psutil.Error, OSError):
                continue
            if self.tag and env.get("MPITP_TEST_LAUNCH_TAG") != self.tag:
                continue
            rank = env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK"))  # MPICH's Hydra / Open MPI's prterun
            if rank is not None:
                tagged[child.pid] = (int(rank), parent)
        found = {rank: pid for pid, (rank, parent) in tagged.items() if parent not in tagged}
        self.pids.update(found)
        return found

    def wait_rows(self, path, more_than: int = 0, timeout: float = 180) -> int:
        """Poll the results file until it holds more than ``more_than`` rows; fail if the job ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, n = file_rows(path)
            if n > more_than:
                return n
            if self.proc.poll() is not None:
                self.wait()
                pytest.fail(f"job ended before writing rows ({n} rows)\n{self.explain()}")
            time.sleep(0.05)
        pytest.fail(f"no rows after {timeout} s\n{self.explain()}")

    def wait(self, timeout: float = 300) -> int:
        """mpiexec's exit status; fails the test if it still runs after ``timeout`` s, with every rank's stack."""
        try:
            return self._wait(timeout)
        except subprocess.TimeoutExpired:
            stacks = self.stacks()  # finds the ranks first
            pytest.fail(f"mpiexec still running {timeout:.0f} s after the launch or the strike (ranks alive: "
                        f"{self.ranks_alive()})\n{self.explain()}\n{stacks}")

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        """:meth:`wait`, then the run as ``subprocess.run(..., capture_output=True, text=True)`` gives it (text mode's
        newlines: a progress bar's ``\\r`` ends a line), with ``elapsed`` seconds from launch to exit."""
        rc = self.wait(timeout)

        def text(s: str) -> str:
            return s.replace("\r\n", "\n").replace("\r", "\n")

        proc = subprocess.CompletedProcess(self.proc.args, rc, text(self.stdout), text(self.stderr))
        proc.elapsed = self.t_end - self.t0
        return proc

    def _wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.t_end = time.monotonic()
        for t in self.readers:
            t.join(timeout=10)
        return rc

    def stacks(self) -> str:
        """Where each rank is now, Python and native frames (``py-spy dump``): a hang found in a CI log explains
        itself instead of waiting to be reproduced (session 25's one hang in 1324 tests never came back in 30 tries).
        """
        py_spy = installed("py-spy")
        if py_spy is None:
            return "--- no stacks: py-spy is not installed (pip install py-spy)"
        try:
            self.rank_pids()
        except psutil.Error:  # mpiexec left meanwhile: the ranks found before, if any
            pass
        parts = [f"--- rank {rank} (pid {pid})\n{_dump(py_spy, pid)}" for rank, pid in sorted(self.pids.items())]
        return "\n".join(parts) or "--- no stacks: no rank process found"

    def ranks_alive(self) -> list[int]:
        alive = []
        for rank, pid in self.pids.items():
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(rank)
            except psutil.NoSuchProcess:
                pass
        return alive

    def gone_within(self, t_strike: float, bound: float) -> float:
        """Wait for mpiexec and every rank to go; returns seconds since ``t_strike`` (asserts ``bound``)."""
        self.wait(timeout=bound + 30)
        while self.ranks_alive() and time.monotonic() - t_strike < bound:
            time.sleep(0.1)
        took = time.monotonic() - t_strike
        assert not self.ranks_alive(), f"ranks {self.ranks_alive()} outlived mpiexec"
        assert took < bound, f"job took {took:.1f} s to go away (bound {bound} s)\n{self.explain()}"
        return took

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.pids.values():  # ranks are ours; hydra may have put them in another process group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self._wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
