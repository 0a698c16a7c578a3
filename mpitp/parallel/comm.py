"""Object collectives over MPI sub-communicators, with deadlines and without busy spinning.

Why not mpi4py's lowercase ``bcast``/``scatter``/``gather`` directly: a rank blocked in them spins at 100% CPU under
MPICH (halving the speed of a co-located rank that does real work) and waits forever when a peer stalls. Here every
wait for a *peer* is a non-blocking request polled with a sleep backoff and a deadline whose error names the phase.

Payloads are pickled with protocol 5 and out-of-band buffers, so numpy arrays and tensors travel without a copy into
the pickle stream, and are moved in chunks of at most ``CHUNK`` bytes so no single MPI call exceeds the 2 GiB count
limit of older MPI libraries.
"""

from __future__ import annotations

import pickle
import time
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from mpitp.parallel import DEFAULT_TIMEOUT
from mpitp.parallel.deadline import deadline_error

if TYPE_CHECKING:
    from collections.abc import Sequence

CHUNK = 1 << 30  # bytes per MPI call: well below the 2**31 - 1 element limit
_HEADER_SLOTS = 16  # small messages fit their sizes in one fixed-size header


class Poller:
    """Sleep backoff for polling MPI requests: microseconds while a reply is imminent, up to 50 ms when idle.

    The cap grows with the time already waited, so a decode-step handshake costs tens of microseconds while a worker
    idling for minutes between chunks costs almost no CPU.
    """

    def __init__(self, timeout: float | None, phase: str):
        self.start = time.monotonic()
        self.timeout = timeout
        self.phase = phase
        self.delay = 1e-5

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def sleep(self) -> None:
        waited = self.elapsed()
        if self.timeout is not None and waited > self.timeout:
            raise deadline_error(self.timeout, self.phase)
        cap = 5e-4 if waited < 0.1 else 5e-3 if waited < 2.0 else 5e-2
        time.sleep(min(self.delay, cap))
        self.delay = min(self.delay * 2, cap)


def wait(request: MPI.Request, timeout: float | None, phase: str) -> MPI.Status:
    """Wait for ``request`` with backoff; raise :class:`DeadlineError` naming ``phase`` after ``timeout`` s."""
    status = MPI.Status()
    poller = Poller(timeout, phase)
    while not request.Test(status):
        poller.sleep()
    return status


def others(comm: MPI.Comm) -> str:
    """The other ranks of ``comm`` by their world rank ("rank 1", "ranks 1, 2, 3"), for the phase of a wait on them:
    a collective cannot tell which peer did not arrive, but with two ranks that is the one named, and with more the
    user learns which ranks (and so which nodes) to look at."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    return rank_words(r for r in ranks if r != MPI.COMM_WORLD.Get_rank())


def rank_words(ranks) -> str:
    """World ranks as a deadline's phase names them: "rank 1", "ranks 1, 2, 3"."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "no other rank"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def barrier(comm: MPI.Comm, timeout: float | None = DEFAULT_TIMEOUT, phase: str = "barrier") -> None:
    """A barrier with a deadline (``Ibarrier`` + polling), never a busy spin."""
    wait(comm.Ibarrier(), timeout, phase)


# ---------------------------------------------------------------------------------------------------------------
# serialisation


def _dumps(obj) -> tuple[list[int], list]:
    """Pickle ``obj`` with protocol 5; returns the sizes and the flat byte views (main stream first)."""
    buffers: list[pickle.PickleBuffer] = []
    main = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    views = [memoryview(main)] + [b.raw() for b in buffers]
    return [v.nbytes for v in views], views


def _loads(views: list) -> object:
    return pickle.loads(views[0], buffers=views[1:])


def _chunks(view, nbytes: int):
    mv = memoryview(view).cast("B") if nbytes else memoryview(b"")
    for off in range(0, nbytes, CHUNK):
        yield mv[off : off + CHUNK]


def _header(sizes: list[int]) -> np.ndarray:
    head = np.zeros(_HEADER_SLOTS, dtype=np.int64)
    head[0] = len(sizes)
    n = min(len(sizes), _HEADER_SLOTS - 1)
    head[1 : 1 + n] = sizes[:n]
    return head


def _sizes_from_header(head: np.ndarray) -> tuple[list[int], bool]:
    count = int(head[0])
    if count <= _HEADER_SLOTS - 1:
        return [int(x) for x in head[1 : 1 + count]], True
    return [], False


# ---------------------------------------------------------------------------------------------------------------
# broadcast


def bcast_obj(obj: object, comm: MPI.Comm, root: int = 0, timeout: float | None = DEFAULT_TIMEOUT,
              phase: str = "broadcast") -> object:
    """Broadcast a Python object from ``root``; every rank returns it. Only the wait for the root is polled.

    Once the small header has arrived every rank is inside the collective, so the payload itself moves with blocking
    ``Bcast`` calls at full speed.
    """
    is_root = comm.Get_rank() == root
    if is_root:
        sizes, views = _dumps(obj)
        head = _header(sizes)
    else:
        head = np.zeros(_HEADER_SLOTS, dtype=np.int64)
    wait(comm.Ibcast(head, root=root), timeout, phase)
    if not is_root:
        sizes, complete = _sizes_from_header(head)
        if not complete:
            sizes = [0] * int(head[0])
    if int(head[0]) > _HEADER_SLOTS - 1:  # many out-of-band buffers: sizes travel separately
        size_arr = np.asarray(sizes if is_root else [0] * int(head[0]), dtype=np.int64)
        comm.Bcast(size_arr, root=root)
        sizes = [int(x) for x in size_arr]
    if not is_root:
        views = [bytearray(n) for n in sizes]
    for view, n in zip(views, sizes):
        for part in _chunks(view, n):
            comm.Bcast(part, root=root)
    return obj if is_root else _loads(views)


# ---------------------------------------------------------------------------------------------------------------
# point to point (scatter, gather and the dispatcher are built on these)


class PendingSend:
    """Non-blocking framed send: keeps its buffers alive until every part has been delivered."""

    def __init__(self, requests: list, keep: list, nbytes: int = 0):
        self.requests = requests
        self._keep = keep
        self.nbytes = nbytes

    def done(self) -> bool:
        return MPI.Request.Testall(self.requests)

    def wait(self, timeout: float | None = DEFAULT_TIMEOUT, phase: str = "send") -> None:
        poller = Poller(timeout, phase)
        while not self.done():
            poller.sleep()


def isend_obj(obj: object, dest: int, tag: int, comm: MPI.Comm) -> PendingSend:
    """Start sending a Python object of any size to ``dest`` (framed: header, then chunked buffers, same tag).

    Non-blocking on purpose: two leaders that send each other large messages with blocking sends deadlock once the
    messages exceed the eager limit.
    """
    sizes, views = _dumps(obj)
    head = _header(sizes)
    keep = [head, views]
    reqs = [comm.Isend(head, dest=dest, tag=tag)]
    if len(sizes) > _HEADER_SLOTS - 1:
        arr = np.asarray(sizes, dtype=np.int64)
        keep.append(arr)
        reqs.append(comm.Isend(arr, dest=dest, tag=tag))
    for view, n in zip(views, sizes):
        for part in _chunks(view, n):
            reqs.append(comm.Isend(part, dest=dest, tag=tag))
    return PendingSend(reqs, keep, nbytes=int(head.nbytes) + sum(sizes))


def send_obj(obj: object, dest: int, tag: int, comm: MPI.Comm, timeout: float | None = DEFAULT_TIMEOUT,
             phase: str = "send") -> None:
    """Send a Python object and wait (polled, with a deadline) until it has been delivered."""
    isend_obj(obj, dest, tag, comm).wait(timeout, phase)


def probe(comm: MPI.Comm, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> MPI.Status | None:
    """Non-blocking check for an incoming framed object; returns its status (source, tag) or None. Only to look:
    take the message with :func:`try_recv_obj`, which receives exactly the message its probe matched."""
    status = MPI.Status()
    if comm.Iprobe(source=source, tag=tag, status=status):
        return status
    return None


def _matched_head(comm: MPI.Comm, source: int, tag: int) -> tuple[np.ndarray, int, int] | None:
    """Matched probe (``Improbe`` + ``Mrecv``) for the header of a framed object from any of ``source``.

    Why not ``Iprobe`` then ``Irecv(ANY_SOURCE)``: under MPICH's ch4 with a network module (UCX, between nodes) a
    wildcard receive posted after a wildcard probe matched nothing at all, although the probed message had arrived
    (a dp=4 run across two nodes hung: issue 25). A matched probe removes the message it found from the queue, so
    the receive that follows cannot miss it or take another; the rest of the object then comes from that one source.
    """
    status = MPI.Status()
    message = comm.Improbe(source=source, tag=tag, status=status)
    if message is None:
        return None
    head = np.zeros(_HEADER_SLOTS, dtype=np.int64)
    message.Recv(head)
    return head, status.Get_source(), status.Get_tag()


def try_recv_obj(comm: MPI.Comm, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> tuple | None:
    """Receive one framed object if its header has arrived (``(obj, source, tag)``), else None at once."""
    found = _matched_head(comm, source, tag)
    if found is None:
        return None
    head, src, tg = found
    return _recv_payload(comm, head, src, tg), src, tg


def recv_obj(comm: MPI.Comm, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,
             timeout: float | None = DEFAULT_TIMEOUT, phase: str = "receive") -> tuple[object, int, int]:
    """Receive one framed object; returns ``(obj, source, tag)``. The wait for the header is polled.

    From one source: a posted ``Irecv``. From any source: a polled matched probe (see :func:`_matched_head`)."""
    if source == MPI.ANY_SOURCE:
        poller = Poller(timeout, phase)
        while (found := _matched_head(comm, source, tag)) is None:
            poller.sleep()
        head, src, tg = found
        return _recv_payload(comm, head, src, tg), src, tg
    head = np.zeros(_HEADER_SLOTS, dtype=np.int64)
    status = wait(comm.Irecv(head, source=source, tag=tag), timeout, phase)
    src, tg = status.Get_source(), status.Get_tag()
    return _recv_payload(comm, head, src, tg), src, tg


def _recv_payload(comm: MPI.Comm, head: np.ndarray, src: int, tg: int) -> object:
    """The rest of a framed object whose header has arrived (every part follows at once: blocking receives)."""
    sizes, complete = _sizes_from_header(head)
    if not complete:
        size_arr = np.zeros(int(head[0]), dtype=np.int64)
        comm.Recv(size_arr, source=src, tag=tg)
        sizes = [int(x) for x in size_arr]
    views = [bytearray(n) for n in sizes]
    for view, n in zip(views, sizes):
        for part in _chunks(view, n):
            comm.Recv(part, source=src, tag=tg)
    return _loads(views)


_SCATTER_TAG = 7001
_GATHER_TAG = 7002


def scatter_obj(items: Sequence | None, comm: MPI.Comm, root: int = 0,
                timeout: float | None = DEFAULT_TIMEOUT, phase: str = "scatter") -> object:
    """Root passes one item per rank; every rank returns its own item."""
    if comm.Get_rank() == root:
        if len(items) != comm.Get_size():
            raise ValueError(f"scatter_obj needs {comm.Get_size()} items, got {len(items)}")
        pending = [isend_obj(item, r, _SCATTER_TAG, comm) for r, item in enumerate(items) if r != root]
        for p in pending:
            p.wait(timeout, phase)
        return items[root]
    obj, _, _ = recv_obj(comm, source=root, tag=_SCATTER_TAG, timeout=timeout, phase=phase)
    return obj


def gather_obj(obj: object, comm: MPI.Comm, root: int = 0, timeout: float | None = DEFAULT_TIMEOUT,
               phase: str = "gather") -> list | None:
    """Every rank passes an object; root returns the list in rank order, other ranks None."""
    if comm.Get_rank() != root:
        send_obj(obj, root, _GATHER_TAG, comm, timeout=timeout, phase=phase)
        return None
    out = [None] * comm.Get_size()
    out[root] = obj
    # Every header is awaited under one deadline (receiving rank by rank, each with its own, could wait N x timeout).
    others = [r for r in range(comm.Get_size()) if r != root]
    heads = [np.zeros(_HEADER_SLOTS, dtype=np.int64) for _ in others]
    requests = [comm.Irecv(h, source=r, tag=_GATHER_TAG) for h, r in zip(heads, others)]
    poller = Poller(timeout, phase)
    while not MPI.Request.Testall(requests):
        poller.sleep()
    for r, head in zip(others, heads):
        out[r] = _recv_payload(comm, head, r, _GATHER_TAG)
    return out


def first_objection(why: str | None, comm: MPI.Comm, timeout: float | None = DEFAULT_TIMEOUT,
                    phase: str = "agreement") -> str | None:
    """Every rank passes why it would not do something (None: it would); every rank returns the first objection in
    rank order, or None when no rank objects. For choices every rank of a group must make alike (a pipeline's
    stages, each probing its own layers)."""
    said = gather_obj(why, comm, root=0, timeout=timeout, phase=phase)
    if said is not None:
        why = next((w for w in said if w), None)
    return bcast_obj(why, comm, root=0, timeout=timeout, phase=phase)
