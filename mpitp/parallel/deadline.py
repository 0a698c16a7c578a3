"""The one error of a wait that ran out, whichever library noticed: an MPI wait's (:class:`mpitp.parallel.comm.Poller`)
or a torch.distributed collective's (:func:`torch_deadline`). No MPI here: the replica's modules that call torch's
collectives import it without starting MPI."""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

from mpitp.errors import DeadlineError

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["deadline_error", "later_deadline", "torch_deadline"]

#: How much later a wait gives up for each wait that may stand between it and a stall. A chain of waits starts at a
#: stalled rank: its TP peers wait in a collective (``--timeout``); rank 0, waiting for a DP group's results, and a
#: remote DP leader, waiting for rank 0's next chunk, wait on a rank that may be in such a collective (one step); a TP
#: worker waits for its leader, which may be in either (two steps). Each step gives up this much later, so the line
#: printed is the nearest rank's, naming its phase and the ranks it waited for, and its abort ends the job before
#: the others, which could only blame the rank they wait for, give up too. Measured before: a SIGSTOP of rank 1 at
#: dp2 x tp2, --timeout 10, printed rank 0's 'TP all-reduce' and rank 2's 'waiting for work from rank 0' at 10 s.
#: Longer than a forward (the most by which one wait may start before the next one in the chain) and than
#: :data:`mpitp.errors.ABORT_GRACE_S` plus an abort.
STEP_GRACE_S = 5.0


def later_deadline(timeout: float | None, steps: int) -> float | None:
    """The deadline of a wait ``steps`` waits away from a stall (see :data:`STEP_GRACE_S`); None: no deadline."""
    return None if timeout is None else timeout + steps * STEP_GRACE_S


def deadline_error(timeout: float | None, phase: str) -> DeadlineError:
    """The one error of every wait that ran out, MPI's (:class:`~mpitp.parallel.comm.Poller`) and torch's
    (:func:`torch_deadline`)."""
    after = "" if timeout is None else f" after {timeout:g} s"
    return DeadlineError(f"timed out{after} in phase '{phase}' (a peer rank did not arrive; "
                         f"raise --timeout if this phase is legitimately slow)")


#: How torch.distributed says that a collective ran past its process group's timeout (gloo: "Timed out waiting
#: 10000ms for send operation to complete"; the TCP store: "Socket Timeout"; NCCL: "Timeout(ms)=10000"). torch has
#: no exception type of its own for it: a plain RuntimeError (or DistBackendError, one of those).
_TORCH_TIMED_OUT = re.compile(r"\btimed out\b|\btimeout\b", re.IGNORECASE)
_TORCH_WAITED_MS = re.compile(r"(?:waiting |Timeout\(ms\)=)(\d+) ?ms", re.IGNORECASE)


@contextlib.contextmanager
def torch_deadline(phase: str, timeout: float | None) -> Iterator[None]:
    """Around a torch.distributed call: its timeout (the replica's process group has ``--timeout`` as its own) becomes
    the :class:`DeadlineError` naming ``phase`` that an MPI wait raises, so a stalled peer reads the same one line
    whichever library noticed first, not a traceback from inside gloo. ``timeout``: the process group's, said when
    torch's message does not give the time it waited."""
    try:
        yield
    except DeadlineError:
        raise
    except RuntimeError as exc:
        text = str(exc)
        if not _TORCH_TIMED_OUT.search(text):
            raise
        waited = _TORCH_WAITED_MS.search(text)
        raise deadline_error(int(waited.group(1)) / 1000 if waited else timeout, phase) from exc
