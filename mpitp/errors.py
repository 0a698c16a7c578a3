"""Errors and failure containment.

Two kinds of failure exist and they must look different to the user:

- :class:`UsageError`: bad input (a missing model, tp not dividing the world, ...). Detected on rank 0 (or agreed by
  all ranks), printed as one line, every rank exits with status 2.
- :class:`JobError` (a deadline that ran out, memory that ran out in a replica with workers): a fault of the job,
  not a bug; the rank that sees it prints one line naming itself, its node and what happened, and aborts the job.
- anything else: a bug or a fault on some rank. The first rank that sees it prints it once, prefixed with its rank,
  and aborts the whole MPI job so that no other rank waits forever in a collective.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contextlib import AbstractContextManager
    from types import TracebackType

USAGE_EXIT = 2

#: Seconds between writing the fatal message and calling ``MPI_Abort``. Hydra (MPICH's launcher) kills every rank as
#: soon as it learns of the abort, and a message still in the pipe to its proxy was lost in about one run of ten
#: (measured with stderr piped); this pause lets the proxy forward it first.
ABORT_GRACE_S = 0.5


class UsageError(Exception):
    """Bad input from the user. The message is one line and spells out what is wrong.

    ``collective`` is True when every rank raised it together (so each can simply exit with status 2); a usage error
    seen by one rank alone must abort the job instead, or the others would wait for it forever.
    """

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


class RelayedRefusal(UsageError):
    """Rank 0's refusal of a run already under way (an index past a task's documents, a request the model cannot
    score), told to every rank while none held work in flight (:meth:`mpitp.evaluation.dispatch.Dispatcher.fail`):
    each raises it together, so ``mpitp.evaluate``'s caller may catch it on every rank and go on, and a sweep or job
    file goes on to its next run, instead of the other ranks waiting for rank 0 for ever."""

    def __init__(self, message: str):
        super().__init__(message, collective=True)


class JobError(RuntimeError):
    """A fault of the job rather than a bug of this rank: printed as one line naming the rank, its node and the
    message, with no traceback (it would only show where the rank happened to be, and bury the line that says what to
    do). The message is one line and says what happened and, where there is one, the remedy."""


class DeadlineError(JobError):
    """A collective did not complete before its deadline. The message names the phase and the timeout."""


class ReplicaOutOfMemory(JobError):
    """Out of memory in a forward of a replica with workers: its peers may sit inside a collective of the very forward
    that failed, so no retry can be agreed with them and the job ends. The message names the batch and the remedy.
    Not a ``torch.OutOfMemoryError``: a handler that retries those must not catch it."""


def _stderr():
    """The process's real stderr. ``torch.distributed.init_process_group`` wraps ``sys.excepthook`` and points
    ``sys.stderr`` at a StringIO while the wrapped hook runs, to prefix its output afterwards; our hook aborts before
    that happens, so anything written to ``sys.stderr`` there would be lost."""
    return sys.__stderr__ if sys.__stderr__ is not None else sys.stderr


def abort(code: int = 1, join_peers: bool = False) -> None:
    """Abort every rank of the MPI job (or just exit when MPI is not initialised).

    ``join_peers``: a rank that fails before it started MPI (an import that breaks, a bug in start-up code) while its
    launcher started others leaves them in ``MPI_Init`` waiting for it, forever under Hydra (measured: 5 min, then
    killed by hand). Such a rank starts MPI itself, which completes their ``MPI_Init``, and aborts them; bounded, with
    the launcher ended when even that cannot complete (a peer that is gone too)."""
    try:
        MPI = _mpi()
        joining = MPI is None and join_peers and _launched_with_peers()
        if joining or (MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()):
            sys.stdout.flush()
            sys.stderr.flush()
            _stderr().flush()
            time.sleep(ABORT_GRACE_S)
            from mpitp.watchdog import bounded, launcher_nudge

            # MPI_Abort holds the GIL too, and may wait for an unreachable node: bounded, then the exit below. A local
            # Hydra that still waits for an unreachable node's proxy after the abort is ended (LAUNCHER_NUDGE_S).
            with bounded(ABORT_WAIT_S, f"mpitp: rank {world_rank()}: MPI_Abort did not return within "
                                       f"{ABORT_WAIT_S:g} s; leaving without it", nudge=launcher_nudge(),
                         nudge_after=LAUNCHER_NUDGE_S, nudge_on_exit=True):
                if joining:
                    from mpi4py import MPI  # initialises MPI: the peers waiting in MPI_Init complete it
                MPI.COMM_WORLD.Abort(code)
    except Exception:  # pragma: no cover - last resort
        pass
    os._exit(code)


def _launched_with_peers() -> bool:
    """The launcher started this process as one of several ranks (read from its variables, MPI not started)."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value) > 1
    return False


def _mpi():
    """mpi4py's MPI module if this process imported it, else None: importing it initialises MPI (seconds under some
    launchers), which commands that never use MPI (``inspect``, ``report``, ``--help``) must not pay for."""
    return sys.modules.get("mpi4py.MPI")


#: Where launchers put a task's rank (Hydra, Open MPI, PMIx, srun), read when MPI is not initialised.
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def world_rank() -> int:
    """This process's rank in COMM_WORLD. Before MPI is initialised (a command that never starts it, or its options
    refused by click first): the rank its launcher gave it, so that a line meant for rank 0 is still printed once."""
    MPI = _mpi()
    try:
        if MPI is not None and MPI.Is_initialized():
            return MPI.COMM_WORLD.Get_rank()
    except Exception:  # pragma: no cover
        return 0
    for var in _RANK_VARIABLES:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


PEER_ABORT_WAIT_S = 5.0
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")


def _peer_lost(exc: BaseException) -> bool:
    """A torch.distributed error that says a peer of this rank's collective went away (gloo, NCCL), or any MPI error:
    mpitp's MPI calls fail when a peer has gone (MPICH under srun: "process_vm_readv failed (errno 3)" in a receive
    from rank 0 that had just aborted on scancel), and the abort that follows is the job's real message."""
    return any(s in str(exc) for s in _PEER_LOST) or type(exc).__module__ == "mpi4py.MPI"


def _node_name() -> str:
    MPI = _mpi()
    try:
        if MPI is not None:
            return MPI.Get_processor_name()
    except Exception:  # pragma: no cover
        pass
    import socket

    return socket.gethostname()


def report_and_abort(exc: BaseException) -> None:
    """Print ``exc`` once with the failing rank and bring the whole job down."""
    rank = world_rank()
    if isinstance(exc, UsageError):
        # A usage error raised on a single rank (not agreed collectively) still ends the job with status 2.
        from mpitp.escape import shown  # a message may quote a file's names: escaped

        _stderr().write(f"mpitp: error: {shown(exc)}\n")
        abort(USAGE_EXIT)
    if isinstance(exc, JobError):
        # A wait or the memory that ran out is a fault of the job, not a bug of this rank: one line, no traceback.
        _stderr().write(f"\nmpitp: error: rank {rank} on {_node_name()}: {exc}\n")
        abort(1)
    if _peer_lost(exc):
        # The real error is a peer's: it is printing it and aborting the job. Under MPICH that abort arrives at
        # once; Open MPI takes a moment longer, and this rank's echo of it would be printed as a second fatal error.
        time.sleep(PEER_ABORT_WAIT_S)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    # Leading newline: rank 0's progress bar may own the current terminal line.
    _stderr().write(f"\n[rank {rank}] mpitp: fatal {type(exc).__name__}: {exc}\n{tb}")
    abort(1, join_peers=True)


#: Seconds each blocking MPI call at the end of a command (``MPI_Finalize``, the replica's torch world torn down) may
#: take before the rank leaves without it. Finalize holds a barrier through the launcher (Hydra's PMI); a node whose
#: network went away after the work was done would keep every rank in it forever, and mpi4py runs it at exit where no
#: deadline applies.
FINALIZE_WAIT_S = 30.0

#: Seconds the launcher may go on after a rank's exit bound fired before that rank's watchdog ends it
#: (:func:`mpitp.watchdog.launcher_nudge`: a local Hydra ``mpiexec`` by SIGTERM, a SLURM step by ``scancel``): Hydra's
#: control connection to an unreachable node's proxy has no keepalive, and srun waits for that node's tasks until
#: slurmctld declares the node down.
LAUNCHER_NUDGE_S = 10.0

#: Seconds ``MPI_Abort`` may take: under MPICH it asks the launcher to kill the job, which waits for a node it cannot
#: reach as long as Finalize would. The rank leaves with the abort's status anyway after this.
ABORT_WAIT_S = 10.0


def exit_bound(phase: str, seconds: float = FINALIZE_WAIT_S) -> AbstractContextManager[None]:
    """A context manager: the block (a blocking call at exit, which may hold the interpreter lock) ends within
    ``seconds``, or the process leaves with status 1 and one line naming this rank, its node and ``phase``
    (:func:`mpitp.watchdog.bounded`: enforced outside the interpreter, since mpi4py holds the GIL in MPI_Finalize)."""
    from mpitp.watchdog import bounded, launcher_nudge

    return bounded(seconds, f"mpitp: error: rank {world_rank()} on {_node_name()}: {phase} did not complete within "
                            f"{seconds:g} s (a node unreachable?); leaving without it, the results written are kept",
                   nudge=launcher_nudge(), nudge_after=LAUNCHER_NUDGE_S)


def finalize_within(seconds: float = FINALIZE_WAIT_S) -> None:
    """Finalize MPI now (if this process started it), or leave with status 1 and one line after ``seconds``."""
    MPI = _mpi()
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    sys.stdout.flush()
    with exit_bound("MPI_Finalize", seconds):
        MPI.Finalize()


def install_excepthook() -> None:
    """Make an uncaught exception on any rank abort the job instead of leaving the other ranks hanging."""

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            _stderr().write(f"[rank {world_rank()}] interrupted\n")
            abort(130)
        report_and_abort(exc.with_traceback(tb))

    sys.excepthook = hook
