"""Rank 0's record of where the groups' time went: per request, which DP group computed it and how long it took from
its chunk's dispatch to its result landing on rank 0; per task and per group, what that comes to (the results file's
``speed_json``, read back by :mod:`mpitp.results.speed`; every field is defined in docs/results-format.md).

Why on rank 0 and per chunk: rank 0 is where a request waits (behind the chunk in flight before it, in the group's
queue, then for rank 0 to receive its result), so a latency measured there is the one a run pays; the DP groups'
clocks are not rank 0's, so only durations cross (a group sends its compute seconds with its results). A chunk's
requests share its latency, and its compute seconds are split over them by the weight the chunking gave each
(characters or tokens: :func:`mpitp.evaluation.dispatch.make_chunks`), an estimate of each request's part.

Which task a dispatched item belongs to comes with the items: rank 0's request loop
(:mod:`mpitp.evaluation.runner`) knows each item's lm-eval instance and hands the dispatcher an :data:`Owner` per
item (:func:`whole` for a whole request, one per window of a rolling request). An item without one counts for its
group only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mpitp.results.speed import quantiles

#: Whose part an item is: (the task's name, the request's key among the open ones, the parts the request has).
Owner = tuple[str, object, int]


def whole(tasks: list[str]) -> list[Owner]:
    """Each item one whole request of its task (``tasks[i]``: item i's; loglikelihood, generate_until)."""
    return [(task, None, 1) for task in tasks]


def windows(rows_per_request: list[list], tasks: list[str]) -> list[Owner]:
    """One owner per window, in the order the windows are dispatched: request ``j``'s rows, then ``j + 1``'s; a
    request is complete once all its windows have landed (in any group, in any order)."""
    return [(task, j, len(rows)) for j, (rows, task) in enumerate(zip(rows_per_request, tasks)) for _ in rows]


def _tokens(result) -> int:
    """A result's token count as its row's ``n_tokens``: (ll, greedy, n) scored, (text, n) generated."""
    n = result[-1] if isinstance(result, tuple) and result else 0
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


class _Counts:
    __slots__ = ("requests", "tokens", "busy_s", "chunks", "latencies")

    def __init__(self):
        self.requests, self.tokens, self.busy_s, self.chunks, self.latencies = 0.0, 0, 0.0, 0, []

    def as_dict(self, chunks: bool = False) -> dict:
        d = dict(requests=round(self.requests, 6), tokens=self.tokens, busy_s=round(self.busy_s, 6))
        if chunks:
            d["chunks"] = self.chunks
        lat = quantiles(self.latencies)
        if lat:
            d["latency"] = {k: round(v, 6) for k, v in lat.items()}
        return d


class RequestLog:
    """One evaluation's record (a :class:`~mpitp.evaluation.dispatch.Dispatcher` keeps one): :meth:`sent` when a
    chunk leaves, :meth:`landed` when its results are back, :meth:`summary` for the file."""

    def __init__(self, n_groups: int, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.tasks: dict[str, _Counts] = {}
        self.groups = [_Counts() for _ in range(n_groups)]
        self._sent: dict[int, tuple[float, int]] = {}  # chunk id -> (dispatched at, group)
        self._open: dict[int, list] = {}  # a rolling request's key -> [first dispatch, windows left]

    def sent(self, cid: int, group: int) -> None:
        self._sent[cid] = (self.clock(), group)

    def landed(self, cid: int, owners: list[Owner | None], results: list, weights: list,
               busy_s: float | None = None) -> None:
        """Chunk ``cid``'s ``results`` are on rank 0, its items' ``owners`` in order; ``busy_s``: the group's compute
        seconds for it (None: rank 0 computed it itself, so its latency is its compute time)."""
        now = self.clock()
        at, group = self._sent.pop(cid, (now, 0))
        latency = now - at
        busy = latency if busy_s is None else max(0.0, float(busy_s))
        g = self.groups[group] if 0 <= group < len(self.groups) else _Counts()
        g.chunks += 1
        g.busy_s += busy
        g.latencies.append(latency)
        total = sum(weights)
        for owner, res, w in zip(owners, results, weights):
            part = busy * (w / total if total > 0 else 1 / len(results))
            tokens = _tokens(res)
            task, key, parts = owner or (None, None, 1)
            g.requests += 1 / parts
            g.tokens += tokens
            if task is None:
                continue
            t = self.tasks.setdefault(task, _Counts())
            t.tokens += tokens
            t.busy_s += part
            done = self._part(key, parts, at)
            if done is not None:
                t.requests += 1
                t.latencies.append(now - done)

    def _part(self, key, parts: int, at: float) -> float | None:
        """The request's first dispatch once its last part has landed, else None (still open)."""
        if key is None or parts <= 1:
            return at
        first, left = self._open.get(key, (at, parts))
        first, left = min(first, at), left - 1
        if left > 0:
            self._open[key] = [first, left]
            return None
        self._open.pop(key, None)
        return first

    def summary(self) -> dict:
        """What the file keeps (``speed_json``): plain JSON, seconds rounded to the microsecond."""
        every = [x for t in self.tasks.values() for x in t.latencies]
        lat = quantiles(every)
        return {"latency": {k: round(v, 6) for k, v in lat.items()} if lat else None,
                "tasks": {name: t.as_dict() for name, t in self.tasks.items()},
                "groups": [g.as_dict(chunks=True) for g in self.groups]}
