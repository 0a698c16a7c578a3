"""Sharding lm-eval requests across DP groups: size-balanced chunks, handed out dynamically, results in order.

Global rank 0 owns the queue. Chunks are cut from the requests sorted longest first (memory trouble shows up in the
first minute, not the last hour) so that each carries about the same weight: characters of text for requests the DP
leaders tokenise themselves, tokens for rolling windows. Every remote DP leader keeps
``prefetch`` chunks in flight until the last few (:func:`refill_now`); rank 0's own group computes a chunk whenever
no result is waiting, so it works too without starving the others. A group that gets no chunk simply waits for the
stop message.

Each chunk's dispatch and landing go to the dispatcher's :class:`~mpitp.evaluation.requestlog.RequestLog` (a remote
group sends its compute seconds with its results), which becomes the results file's ``speed_json``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpitp import testing
from mpitp.errors import RelayedRefusal
from mpitp.evaluation.requestlog import RequestLog
from mpitp.parallel import comm as mpicomm
from mpitp.parallel.deadline import later_deadline
from mpitp.parallel.walltime import hold_if_stopping

if TYPE_CHECKING:
    from mpitp.parallel.layout import Layout
    from mpitp.replica.stats import Stats

#: ``compute(kind, items, tick) -> results``: a chunk run on this DP group (``tick()`` between its batches)
Compute = Callable[[str, list, Callable[[], object]], list]

log = logging.getLogger("mpitp")

TAG_WORK = 11
TAG_RESULT = 12


@dataclass(frozen=True)
class Chunk:
    cid: int
    kind: str
    indices: tuple[int, ...]
    items: list


def make_chunks(kind: str, items: list, weights: list[int], n_groups: int, per_group: int = 4,
                max_items: int | None = None, min_items: int = 1, tail_split: int = 8) -> list[Chunk]:
    """Cut ``items`` (sorted by weight, heaviest first) into weight-balanced chunks that shrink towards the end.

    Each chunk carries about ``remaining / (n_groups * per_group)`` tokens, but not less than ``1 / tail_split``
    of the first chunk (guided self-scheduling): early chunks are large (few round trips), the last ones small, so
    the groups finish within a small chunk of each other instead of one whole equal share (with equal chunks, dp=2
    measured busy times of 16.5 s vs 18.2 s). With one group there is nothing to balance: equal chunks.

    A chunk holds a multiple of ``min_items`` (the batch size) where it can: a group batches only within a chunk,
    so a smaller one would run short batches (fewer prompts per ``generate`` call, more decode steps).
    """
    if not items:
        return []
    order = sorted(range(len(items)), key=lambda i: -weights[i])
    total = sum(weights)
    parts = max(1, n_groups * per_group)
    first = max(1, total // parts)
    floor = first if n_groups <= 1 else max(1, first // max(1, tail_split))
    chunks, cur, cur_w, remaining = [], [], 0, total
    target = max(floor, remaining // parts)
    for i in order:
        cur.append(i)
        cur_w += weights[i]
        full = len(cur) % min_items == 0
        if (cur_w >= target and full) or (max_items and len(cur) >= max_items):
            chunks.append(cur)
            remaining -= cur_w
            cur, cur_w = [], 0
            target = max(floor, remaining // parts)
    if cur:
        chunks.append(cur)
    return [Chunk(cid, kind, tuple(ix), [items[i] for i in ix]) for cid, ix in enumerate(chunks)]


def prefetch_order(n_chunks: int, n_groups: int, prefetch: int) -> list[int]:
    """The remote DP groups a chunk is sent to before rank 0's own group takes one, in order: one each, then up to
    ``prefetch`` each only while every group, rank 0's included, would still find a chunk left. Sent ahead without
    that rule, a short queue went whole to the remote groups and left rank 0's idle: 4 gsm8k questions at dp=2,
    batch 2, went as both chunks to group 1 (``bench_forward_limit.py``: busy 0.00 / 6.80 s, 1.30x the forwards)."""
    out: list[int] = []
    for rnd in range(prefetch):
        for dest in range(1, n_groups):
            left = n_chunks - len(out)
            if left == 0 or (rnd > 0 and left <= n_groups):
                return out
            out.append(dest)
    return out


def refill_now(left: int, n_groups: int, holding: int) -> bool:
    """Whether a remote DP group whose chunk just landed is sent its next one at once, holding ``holding`` chunks
    still (one it computes, maybe one queued): always while more than ``n_groups`` chunks are ``left``, so that it
    never waits for rank 0 to notice; on the last few only when it holds none. A chunk held ahead at a remote group
    at the end is one rank 0's group could have taken: rank 0's group then idled while the remote group computed it
    (hellaswag at dp=2, ``--limit 3000``: rank 0's group idle for the last 0.6 of 12.3 s; full hellaswag,
    ``bench_scaling.py``: the groups' busy 93.8 / 96.3 s, with this rule 94.3 / 94.7 s)."""
    return left > n_groups or holding == 0


class Dispatcher:
    """Rank 0's side. ``compute(kind, items, tick) -> results`` runs a chunk on rank 0's own DP group.

    ``compute`` must call ``tick()`` between its batches: MPI moves large messages only while the sender is inside
    an MPI call, so without it a remote group would wait for rank 0's whole chunk before receiving its next one.
    """

    def __init__(self, layout: Layout, compute: Compute, timeout: float, stats: Stats | None, prefetch: int = 2,
                 per_group: int = 4, batch_size: int = 1, idle: Callable[[], None] | None = None):
        self.comm = layout.dp_leader_comm
        self.layout = layout  # its DP leaders' world ranks are named when a group's results are late
        self.n_groups = layout.dp
        self.compute = compute
        self.timeout = timeout
        self.stats = stats
        self.prefetch = prefetch
        self.per_group = per_group
        self.batch_size = batch_size
        self.idle = idle  # releases rank 0's own TP workers from the deadline when a run ends (see serve_remote)
        self.between_runs = True  # every remote group waits for rank 0's next message: not inside run() (chunks
        # may be in flight, whose results a later receive would meet), not after shutdown() (the groups left their loop)
        self.handed_out = 0  # requests sent to a group or being computed here, and of those, landed: what a stop
        self.landed = 0  # abandons is the difference (mpitp.parallel.walltime reports it)
        self.requests = RequestLog(self.n_groups)  # where each request went and how long it took; rank 0's stats
        # carry its summary to the results file (mpitp.evaluation.finish), set after every run()
        from mpitp.parallel.walltime import watch

        watch(self)

    def run(self, kind: str, items: list, weights: list[int],
            on_chunk: Callable[[tuple[int, ...], list], None] | None = None, owners: list | None = None) -> list:
        """Compute every item somewhere; returns results in item order. ``on_chunk(indices, results)`` as they land.
        ``owners``: each item's :data:`~mpitp.evaluation.requestlog.Owner` (its task), for the run's speed record."""
        self.between_runs = False
        per_group = testing.chunks_per_group(kind, len(items), self.per_group)
        chunks = make_chunks(kind, items, weights, self.n_groups, per_group, min_items=self.batch_size)
        results: list = [None] * len(items)
        queue = deque(chunks)

        def land(c: Chunk, res: list, busy_s: float | None = None) -> None:
            self.requests.landed(c.cid, [owners[i] for i in c.indices] if owners else [None] * len(c.indices), res,
                                 [weights[i] for i in c.indices], busy_s)
            self.landed += len(c.indices)
            for i, r in zip(c.indices, res):
                results[i] = r
            if on_chunk is not None:
                on_chunk(c.indices, res)

        by_cid = {c.cid: c for c in chunks}
        held: dict[int, int] = {}  # chunk id -> the remote group it was sent to, until its results land: in flight
        sends: list = []

        def send_next(dest: int) -> bool:
            hold_if_stopping()
            if not queue:
                return False
            c = queue.popleft()
            pending = mpicomm.isend_obj(("work", c.kind, c.cid, c.items), dest, TAG_WORK, self.comm)
            self.stats.mpi_bytes += pending.nbytes
            self.requests.sent(c.cid, dest)
            held[c.cid] = dest
            sends.append(pending)
            self.handed_out += len(c.indices)
            return True

        def receive(block: bool) -> bool:
            if block:
                late = mpicomm.rank_words(self.layout.leader_ranks[d] for d in held.values())
                got = mpicomm.recv_obj(self.comm, tag=TAG_RESULT, timeout=later_deadline(self.timeout, 1),
                                       phase=f"waiting for {kind} results from DP leader {late}")
            else:  # a matched probe: the message looked at is the one received (see mpicomm._matched_head)
                got = mpicomm.try_recv_obj(self.comm, tag=TAG_RESULT)
                if got is None:
                    return False
            (_, cid, res, *busy), src, _ = got  # busy: the group's compute seconds for the chunk
            del held[cid]
            if refill_now(len(queue), self.n_groups, sum(d == src for d in held.values())):
                send_next(src)  # the group's next chunk first: recording this one must not keep it waiting
            land(by_cid[cid], res, busy[0] if busy else None)
            return True

        def tick() -> None:
            while receive(block=False):
                pass
            sends[:] = [s for s in sends if not s.done()]

        for dest in prefetch_order(len(queue), self.n_groups, self.prefetch):
            send_next(dest)
        while queue or held:
            tick()
            hold_if_stopping()
            if queue:
                c = queue.popleft()
                self.handed_out += len(c.indices)
                self.requests.sent(c.cid, 0)
                land(c, self.compute(c.kind, c.items, tick))
                testing.stall("between_chunks")
            elif held:
                receive(block=True)
        for s in sends:
            s.wait(self.timeout, "handing out chunks")
        for dest in range(1, self.n_groups):
            mpicomm.send_obj(("idle",), dest, TAG_WORK, self.comm, timeout=self.timeout, phase="releasing DP groups")
        if self.idle is not None:
            self.idle()
        self.between_runs = True
        if self.stats is not None:
            self.stats.speed = self.requests.summary()
        return results

    def shutdown(self) -> None:
        self.between_runs = False
        for dest in range(1, self.n_groups):
            mpicomm.send_obj(("stop",), dest, TAG_WORK, self.comm, timeout=self.timeout, phase="stopping DP groups")

    def fail(self, message: str) -> bool:
        """Rank 0 refused the run between two dispatch runs (lm-eval building a task's requests, a check of
        lm-eval's results): every remote DP group raises ``message`` as a :class:`~mpitp.errors.RelayedRefusal`
        instead of a stop. False, and nothing sent, inside a run: a chunk in flight would answer a later receive."""
        if not self.between_runs:
            return False
        for dest in range(1, self.n_groups):
            mpicomm.send_obj(("fail", message), dest, TAG_WORK, self.comm, timeout=self.timeout,
                             phase="telling the DP groups rank 0's refusal")
        return True


def serve_remote(layout: Layout, compute: Compute, timeout: float, stats: Stats | None = None,
                 idle: Callable[[], None] | None = None) -> None:
    """A remote DP leader's loop: take chunks from rank 0, compute them, send results, until told to stop.

    The deadline applies only while rank 0 hands out work (between a run's chunks). Outside a run rank 0 does work
    of its own of any length (lm-eval building tasks, computing metrics, writing the file): the leader then waits
    without a deadline, as its TP workers do (``idle``, called on each "idle" message, tells them) — a peer that
    dies ends the job through the launcher (MPICH's hydra, Open MPI's mpirun and ``srun --kill-on-bad-exit`` kill
    every rank) and a rank that fails aborts it itself, so an idle wait still ends when the job cannot go on.
    """
    comm = layout.dp_leader_comm
    pending = None
    busy = False  # inside a run: rank 0 is handing out chunks
    while True:
        msg, _, _ = mpicomm.recv_obj(comm, source=0, tag=TAG_WORK, timeout=later_deadline(timeout, 1) if busy else None,
                                     phase="DP leader waiting for work from rank 0")
        if msg[0] == "stop":
            break
        if msg[0] == "fail":  # between runs: no result of this group's is in flight
            raise RelayedRefusal(msg[1])
        if msg[0] == "idle":
            busy = False
            if pending is not None:
                pending.wait(timeout, "returning results to rank 0")
            if idle is not None:
                idle()
            continue
        busy = True
        _, kind, cid, items = msg
        t0 = time.perf_counter()
        result = compute(kind, items, lambda: pending is None or pending.done())
        busy_s = time.perf_counter() - t0  # rank 0 splits it over the chunk's tasks (mpitp.evaluation.requestlog)
        if pending is not None:
            pending.wait(timeout, "returning results to rank 0")
        pending = mpicomm.isend_obj(("result", cid, result, busy_s), 0, TAG_RESULT, comm)
        if stats is not None:
            stats.mpi_bytes += pending.nbytes
    if pending is not None:
        pending.wait(timeout, "returning results to rank 0")
