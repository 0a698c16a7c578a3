"""Rank 0's seconds per phase of one evaluation ((the demo's model,) checks, load, requests, tokenising, dispatch,
metrics, writing), for the HDF5 file's ``phases_json`` and the run's closing line."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from mpitp.results.speed import PHASE_ORDER

if TYPE_CHECKING:
    from mpitp.replica.stats import GroupStats


class PhaseClock:
    """Rank 0's seconds per phase. lm-eval's request methods on the LM run inside :meth:`timing`: the time inside
    them minus the dispatch is tokenising (lm-eval's encoding, rolling windows),
    before the first call lm-eval loads tasks and builds requests, after the last it computes metrics."""

    ORDER = PHASE_ORDER

    def __init__(self):
        self.phases: dict[str, float] = {"writing": 0.0}
        self.dispatch = 0.0
        self.in_methods = 0.0
        self.t_eval = self.first = self.last = None

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Around one of lm-eval's request methods on the LM (:meth:`mpitp.evaluation.lm.MPITPLM.serving`)."""
        t0 = time.perf_counter()
        self.first = self.first or t0
        try:
            yield
        finally:
            self.last = time.perf_counter()
            self.in_methods += self.last - t0

    def eval_done(self) -> None:
        end = time.perf_counter()
        first, last = self.first or end, self.last or end
        self.phases.update(requests=first - self.t_eval, tokenising=self.in_methods - self.dispatch,
                           dispatch=self.dispatch, metrics=end - last)

    @classmethod
    def describe(cls, phases: dict[str, float], wall: float, all_stats: list[GroupStats]) -> str:
        """The run's closing line: seconds per phase and what rank 0 spent alone."""
        parts = [f"{k} {phases[k]:.1f} s" for k in cls.ORDER if k in phases]
        busy = max((s.busy_s for s in all_stats), default=0.0)
        return (f"rank 0 phases: {', '.join(parts)} (writing: the results thread, off the dispatch path; final "
                f"snapshot {phases.get('final_snapshot', 0.0):.1f} s); rank 0 alone (wall - max group busy) "
                f"{wall - busy:.1f} s")
