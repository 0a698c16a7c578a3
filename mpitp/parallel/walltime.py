"""Stopping at a walltime: the scheduler's warning signal ends the job at once, keeping every landed request.

SLURM sends ``SIGUSR1`` (the script asks for it with ``--signal=B:USR1@GRACE`` and forwards it to the step), PBS
sends ``SIGTERM`` at the walltime. Landed rows go to the results journal on the writer's thread; on a stop signal
rank 0 waits (at most :data:`FLUSH_S`) until every row queued so far is fsync'd, says so in one line and aborts the
MPI job with :data:`STOP_EXIT`, which tells the batch script to requeue; the next start skips the completed runs of
the job file and resumes the interrupted one. Only chunks in flight are computed again.

A signal handler runs between two Python bytecodes of the main thread, which may hold the writer queue's lock at that
instant: the flush and the abort therefore run on a thread of their own, and the handler returns at once.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from mpitp.errors import _stderr, abort

if TYPE_CHECKING:
    from types import FrameType

#: EX_TEMPFAIL: "stopped before the end, run me again". Distinct from 1 (a fault) and 2 (bad input).
STOP_EXIT = 75

_NAMES = {signal.SIGUSR1: "SIGUSR1 (walltime near)", signal.SIGTERM: "SIGTERM"}
_dispatcher = None
_writer = None
FLUSH_S = 20.0  # the longest a stop waits for the results writer (an fsync on a slow shared file system)
_stopping = False
_early: int | None = None  # a stop signal that came before the rank was known (while Python and MPI start up)


def listen_early() -> None:
    """Run on importing the CLI, before numpy and MPI load: remember SIGUSR1 until :func:`install` knows the rank.

    Starting a rank (imports of torch and lm-eval, MPI_Init) takes tens of seconds on a loaded node, and a walltime
    signal in that window must not be lost: SIGUSR1's default action would kill the rank. MPICH installs a SIGUSR1
    handler of its own in MPI_Init and calls the one it found, so this one still hears the signal after that.
    :func:`install` acts on a remembered signal at once.
    """
    def remember(signum: int, frame: FrameType | None) -> None:
        global _early
        _early = signum

    try:
        signal.signal(signal.SIGUSR1, remember)
    except ValueError:  # imported off the main thread (an embedding program): signals are not ours to take
        pass


def finished() -> None:
    """The command has ended and written its results: from now on a walltime signal (the batch script's stop racing
    the end of the job) has nothing left to save, and must not kill the rank on its way out either, which would make
    the script requeue a finished job. Python puts the signals it handles back to their default at exit; an ignored
    one stays ignored.

    SIGTERM too (PBS at the walltime, a scancel racing the end): on rank 0 it ran the stop, which said "no request
    of this run had been scored yet; run the job file again" and exited 75 with the results file complete. What is
    left (``MPI_Finalize``) is bounded by :mod:`mpitp.watchdog`, so an ignored SIGTERM cannot hold the rank."""
    try:
        for sig in _NAMES:
            signal.signal(sig, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


def watch(dispatcher) -> None:
    """The dispatcher whose requests in flight a stop abandons (reported in the stop line). Held weakly: the
    dispatcher reaches the model (through its compute callable), which a sweep must free between checkpoints."""
    import weakref

    global _dispatcher
    _dispatcher = weakref.ref(dispatcher)


def watch_writer(writer) -> None:
    """The results writer a stop flushes before the abort (rank 0); held weakly, like the dispatcher."""
    import weakref

    global _writer
    _writer = weakref.ref(writer)


def hold_if_stopping() -> None:
    """Where new work would start (the dispatcher's next chunk, a job file's next run, a sweep's next item): while a
    stop flushes and aborts on its own thread (:func:`_flush_and_abort`, rank 0), the main thread starts nothing and
    waits for the abort. It went on: a run that finished in that window led into the next run and the job's summary
    (exit 1, not :data:`STOP_EXIT`), and the stop line counted requests in flight that then landed."""
    import time

    while _stopping:
        time.sleep(0.5)


_owner_pid: int | None = None  # the rank's own process: a fork of it (lm-eval's bootstrap pool) is not the rank


def _default_in_child() -> None:
    """In a process forked from the rank: SIGTERM and SIGUSR1 back to their default actions. A worker of lm-eval's
    bootstrap ``multiprocessing.Pool`` is ended by ``Pool.terminate()`` with SIGTERM; running the rank's stop path
    instead, it aborted the whole MPI job with exit 75 while the rank waited for it in ``Pool.join``."""
    for sig in _NAMES:
        signal.signal(sig, signal.SIG_DFL)


def install(rank: int) -> None:
    """Rank 0 stops the job on SIGUSR1 or SIGTERM; other ranks ignore SIGUSR1 (rank 0's abort ends them) and give
    rank 0 :data:`STOP_GRACE_S` on SIGTERM before they die by it (:func:`_await_stop`)."""
    global _owner_pid
    import os

    if _owner_pid is None:
        os.register_at_fork(after_in_child=_default_in_child)
    _owner_pid = os.getpid()
    if rank == 0:
        for sig in _NAMES:
            signal.signal(sig, _stop)
        if _early is not None:
            _stop(_early, None)
    else:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _await_stop)


#: How long a rank other than 0 outlives a SIGTERM: rank 0's stop (the writer flushed, at most :data:`FLUSH_S`, then
#: the abort with :data:`STOP_EXIT`) ends it first, unless rank 0 never got the signal or cannot act on it.
STOP_GRACE_S = FLUSH_S + 5.0


def _await_stop(signum, frame) -> None:
    """SIGTERM on a rank other than 0: die by it only after :data:`STOP_GRACE_S`. PBS at the walltime (and Hydra's
    ``mpiexec`` given SIGTERM) signals every rank at once; dying at once as before, these ranks ended the job with
    the launcher's "signal 15" (exit 15) before rank 0's stop could end it with :data:`STOP_EXIT`, the status the
    batch script requeues on."""
    import threading

    if _died_as_a_fork(signum):
        return
    timer = threading.Timer(STOP_GRACE_S, _die_by, args=(signum,))
    timer.daemon = True
    timer.start()


def _died_as_a_fork(signum) -> bool:
    """In a process forked from the rank that kept a handler of the rank's (one forked while it ran): the signal's
    default action now (it ends the process), and True; False in the rank itself."""
    import os

    if _owner_pid is None or os.getpid() == _owner_pid:
        return False
    _die_by(signum)
    return True


def _die_by(signum) -> None:
    """``signum``'s default action, now: the process ends by it (as the launcher and the scheduler expect).

    Called from :func:`_await_stop`'s timer thread too, where ``signal.signal`` raises ``ValueError`` (main thread
    only): the rank printed that traceback and lived on, its SIGTERM lost. Off the main thread the default action is
    put back through libc; where that cannot be done the process ends with the shell's status for the signal."""
    import os
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    elif not _default_from_libc(signum):
        os._exit(128 + signum)
    os.kill(os.getpid(), signum)


def _default_from_libc(signum) -> bool:
    """``signum`` back to its default action from any thread (libc's ``signal``); False where that failed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        return libc.signal(signum, None) != ctypes.c_void_p(-1).value  # None: SIG_DFL; -1: SIG_ERR
    except (OSError, AttributeError):
        return False


def _stop(signum, frame) -> None:
    import threading

    if _died_as_a_fork(signum):
        return

    global _stopping
    if _stopping:  # one stop per rank: a second signal (the scheduler's and the script's) changes nothing
        return
    _stopping = True
    threading.Thread(target=_flush_and_abort, args=(signum,), name="mpitp-stop", daemon=True).start()


def _flush_and_abort(signum) -> None:
    w = _writer() if _writer is not None else None
    if w is not None:
        try:
            w.flush(timeout=FLUSH_S)
        except Exception as exc:  # noqa: BLE001 - the stop goes on; say what may be missing
            _stderr().write(f"\nmpitp: the results writer did not confirm the last rows: {exc}\n")
    d = _dispatcher() if _dispatcher is not None else None
    lost = f"{d.handed_out - d.landed} requests in flight abandoned, " if d is not None else ""
    # No writer yet (checks, model load): there is no results file of this run to point at.
    kept = ("every request that landed is in the results file (status running)" if w is not None
            else "no request of this run had been scored yet")
    _stderr().write(f"\nmpitp: stopping on {_NAMES.get(signum, signum)}: {lost}{kept}; run the job file again (or "
                    f"mpitp eval with --resume) to continue; exit {STOP_EXIT}\n")
    abort(STOP_EXIT)
