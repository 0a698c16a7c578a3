"""A bound on a call that may block while holding the interpreter lock (``MPI_Finalize``, ``MPI_Abort``, ...).

Why not a Python timer: mpi4py calls ``MPI_Finalize`` (and ``MPI_Abort``) *holding* the GIL, so while the call waits
for a node that went away, no Python thread can run and a ``threading.Timer`` never fires: a job whose work was done
sat in ``MPI_Finalize`` until the scheduler's walltime (issue 42: 194 s and counting after a link cut at exit).

The bound here needs no Python code to run while the call blocks:

- :func:`faulthandler.dump_traceback_later` with ``exit=True`` runs in a C thread that takes no lock: when the time is
  up it writes the Python stacks into a pipe and calls ``_exit(1)``. The process ends with status 1, as a failure.
- a tiny watchdog process (``/bin/sh``, started before the call) reads that pipe. If anything arrives (the timer
  fired) it prints the one line prepared beforehand, naming the rank, the node and the phase, to the rank's own
  stderr; if the pipe closes without data (the call returned and the bound was cancelled, or the process ended
  otherwise) it leaves silently. So the line is printed exactly when the bound ended the process, never for a call
  that returned in time, and the stack dump itself (for a developer) never reaches the user's terminal.

Only one such bound can be armed at a time (faulthandler keeps one timer per process); :func:`bounded` refuses to
nest rather than silently replace an outer one. Nothing here imports the rest of mpitp: ``errors`` uses it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shlex
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

#: The watchdog process: print ``$1`` to stderr if a line arrives on stdin, then drain it (faulthandler must never
#: block on a full pipe); leave on EOF. With a nudge (``$2``, a shell command), a detached subshell runs it ``$3`` s
#: after the bound fired (or, with ``$4`` = 1, after the process ended in any way).
_WATCH = ('if IFS= read -r _; then printf "%s\\n" "$1" >&2; n=1; else n=$4; fi; '
          'if [ -n "$2" ] && [ "$n" = 1 ]; then ( sleep "$3"; eval "$2" ) </dev/null >/dev/null 2>&1 & fi; '
          'exec cat >/dev/null')

_armed = False

#: Launchers that wait forever for a node they cannot reach once the ranks have left (MPICH's Hydra: its control
#: connection to that node's proxy has no keepalive; measured: still waiting 5 min after a link cut at exit, gone at
#: once on SIGTERM). Recognised as the parent of this rank's ``hydra_pmi_proxy``, on this node only.
HYDRA_LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun")


def _parent(pid: int | str) -> tuple[int, str] | None:
    """(parent pid, its command name) from ``/proc``; None where there is no such process or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{ppid}/comm") as f:
            return ppid, f.read().strip()
    except (OSError, ValueError, IndexError):
        return None


def local_hydra_launcher() -> tuple[int, str] | None:
    """The Hydra ``mpiexec`` that started this rank through a proxy on this same node (pid, name), else None (a
    remote launcher, srun, Open MPI, or no launcher)."""
    proxy = _parent("self")
    if proxy is None or proxy[1] != "hydra_pmi_proxy":
        return None
    launcher = _parent(proxy[0])
    return launcher if launcher is not None and launcher[1] in HYDRA_LAUNCHERS else None


def launcher_nudge(env: Mapping[str, str] | None = None) -> str | None:
    """The shell command that ends this job's launcher when it still waits for a node it cannot reach, or None:

    - a local Hydra ``mpiexec`` (:func:`local_hydra_launcher`): SIGTERM, if it is still there under the same name;
    - a SLURM step (``SLURM_JOB_ID``, ``SLURM_STEP_ID``; ``scancel`` on PATH): ``scancel JOB.STEP``. srun waits for
      the unreachable node's tasks until slurmctld declares the node down (``SlurmdTimeout``: 300 s by default);
      a cancelled step ends srun within ``KillWait`` (measured: 12 s here).
    """
    env = os.environ if env is None else env
    hydra = local_hydra_launcher()
    if hydra is not None:
        pid, name = hydra
        return f'[ "$(cat /proc/{pid}/comm 2>/dev/null)" = {shlex.quote(name)} ] && kill -TERM {pid}'
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    if job.isdigit() and step.isdigit() and shutil.which("scancel"):
        return f"scancel --quiet {job}.{step}"
    return None


@contextlib.contextmanager
def bounded(seconds: float, message: str, nudge: str | None = None, nudge_after: float = 10.0,
            nudge_on_exit: bool = False) -> Iterator[None]:
    """Run the block; if it has not finished after ``seconds``, print ``message`` (one line) and end the process
    with status 1, even when the block is a C call that holds the interpreter lock.

    ``nudge``: a shell command run ``nudge_after`` seconds after the bound fired (:func:`launcher_nudge`: ends a
    launcher that would wait forever for a node it cannot reach).
    ``nudge_on_exit``: also when the process ended inside the block in another way (``MPI_Abort``: the launcher kills
    this rank, then waits for the unreachable node as it would for Finalize).

    Falls back to no bound (the block simply runs) where the watchdog process cannot be started (no ``/bin/sh``):
    the block must not fail because its guard could not be set up.
    """
    global _armed
    if _armed:
        raise RuntimeError("mpitp.watchdog.bounded does not nest (faulthandler has one timer per process)")
    read_fd, write_fd = os.pipe()
    try:
        nudged = [nudge or "", f"{nudge_after:g}", "1" if nudge_on_exit else ""]
        watcher = subprocess.Popen(["/bin/sh", "-c", _WATCH, "mpitp-watchdog", message.replace("\n", " "), *nudged],
                                   stdin=read_fd, stdout=subprocess.DEVNULL, stderr=_stderr_fd(),
                                   start_new_session=True, close_fds=True)
    except OSError:
        watcher = None
    os.close(read_fd)
    if watcher is None:
        os.close(write_fd)
        yield
        return
    _armed = True
    for stream in (sys.stdout, sys.stderr):  # the bound ends the process with _exit: nothing buffered is lost
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.flush()
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=write_fd)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    finally:
        _armed = False
        os.close(write_fd)  # EOF: the watchdog process leaves without a word
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            watcher.wait(timeout=5)


def _stderr_fd() -> int:
    """The process's real standard error (fd 2), whatever ``sys.stderr`` was replaced with."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.__stderr__.flush()
    return 2
