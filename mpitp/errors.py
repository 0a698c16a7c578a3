"""Errors and failure containment.

Two kinds of failure exist and they must look different to the user:

- :class:`UsageError`: bad input (a missing model, tp not dividing the world, ...). Detected on rank 0 (or agreed by
  all ranks), printed as one line, every rank exits with status 2.
- anything else: a bug or a fault on some rank. The first rank that sees it prints it once, prefixed with its rank,
  and aborts the whole MPI job so that no other rank waits forever in a collective.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

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


class DeadlineError(RuntimeError):
    """A collective did not complete before its deadline. The message names the phase and the timeout."""


def _stderr():
    """The process's real stderr. ``torch.distributed.init_process_group`` wraps ``sys.excepthook`` and points
    ``sys.stderr`` at a StringIO while the wrapped hook runs, to prefix its output afterwards; our hook aborts before
    that happens, so anything written to ``sys.stderr`` there would be lost."""
    return sys.__stderr__ if sys.__stderr__ is not None else sys.stderr


def abort(code: int = 1) -> None:
    """Abort every rank of the MPI job (or just exit when MPI is not initialised)."""
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            sys.stdout.flush()
            sys.stderr.flush()
            _stderr().flush()
            time.sleep(ABORT_GRACE_S)
            MPI.COMM_WORLD.Abort(code)
    except Exception:  # pragma: no cover - last resort
        pass
    os._exit(code)


def world_rank() -> int:
    """This process's rank in COMM_WORLD (0 when MPI is not initialised)."""
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
    except Exception:  # pragma: no cover
        return 0


PEER_ABORT_WAIT_S = 5.0
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")


def _peer_lost(exc: BaseException) -> bool:
    """A torch.distributed error that says a peer of this rank's collective went away (gloo, NCCL)."""
    return any(s in str(exc) for s in _PEER_LOST)


def _node_name() -> str:
    try:
        from mpi4py import MPI

        return MPI.Get_processor_name()
    except Exception:  # pragma: no cover
        import socket

        return socket.gethostname()


def report_and_abort(exc: BaseException) -> None:
    """Print ``exc`` once with the failing rank and bring the whole job down."""
    rank = world_rank()
    if isinstance(exc, UsageError):
        # A usage error raised on a single rank (not agreed collectively) still ends the job with status 2.
        from mpitp.results.untrusted import shown  # a message may quote a file's names: escaped

        _stderr().write(f"mpitp: error: {shown(exc)}\n")
        abort(USAGE_EXIT)
    if isinstance(exc, DeadlineError):
        # A wait that ran out is a fault of the job, not a bug of this rank: one line naming where, no traceback.
        _stderr().write(f"\nmpitp: error: rank {rank} on {_node_name()}: {exc}\n")
        abort(1)
    if _peer_lost(exc):
        # The real error is a peer's: it is printing it and aborting the job. Under MPICH that abort arrives at
        # once; Open MPI takes a moment longer, and this rank's echo of it would be printed as a second fatal error.
        time.sleep(PEER_ABORT_WAIT_S)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    # Leading newline: rank 0's progress bar may own the current terminal line.
    _stderr().write(f"\n[rank {rank}] mpitp: fatal {type(exc).__name__}: {exc}\n{tb}")
    abort(1)


#: Seconds MPI_Finalize may take at the end of a command before the rank leaves without it. Finalize holds a
#: barrier through the launcher (Hydra's PMI); a node whose network went away after the work was done would keep
#: every rank in it forever, and mpi4py runs it at exit where no deadline applies.
FINALIZE_WAIT_S = 30.0


def finalize_within(seconds: float = FINALIZE_WAIT_S) -> None:
    """Finalize MPI now (if this process started it), or leave with status 1 and one line after ``seconds``."""
    try:
        from mpi4py import MPI
    except ImportError:  # pragma: no cover
        return
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    import threading

    def give_up():
        _stderr().write(f"mpitp: error: rank {world_rank()} on {_node_name()}: MPI_Finalize did not complete within "
                        f"{seconds:g} s (a node unreachable?); leaving without it, the results written are kept\n")
        _stderr().flush()
        os._exit(1)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()  # MPI_Finalize releases the GIL (mpi4py), so the timer runs while it waits
    MPI.Finalize()
    timer.cancel()


def install_excepthook() -> None:
    """Make an uncaught exception on any rank abort the job instead of leaving the other ranks hanging."""

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            _stderr().write(f"[rank {world_rank()}] interrupted\n")
            abort(130)
        report_and_abort(exc.with_traceback(tb))

    sys.excepthook = hook
