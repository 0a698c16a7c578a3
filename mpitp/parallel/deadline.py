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

__all__ = ["deadline_error", "torch_deadline"]


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
