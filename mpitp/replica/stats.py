"""Per-rank counters of a run: time, requests, tokens, forwards and the bytes each channel carried."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from mpitp.replica.scoring import CommCounter

if TYPE_CHECKING:
    from collections.abc import Iterator


@dataclass
class Stats:
    """Per-rank counters; the DP leader's are the group's and end up in the results file."""

    busy_s: float = 0.0
    requests: float = 0.0  # rolling requests count 1/n per window computed, so they can span DP groups
    tokens_scored: int = 0
    row_tokens: int = 0  # input tokens of the rows scored, each row alone
    tokens_read: int = 0  # input tokens the forwards read for them (fewer where rows share a context)
    tokens_generated: int = 0
    forwards: int = 0
    tp: CommCounter = field(default_factory=CommCounter)
    tp_score: CommCounter = field(default_factory=CommCounter)
    pp: CommCounter = field(default_factory=CommCounter)
    mpi_bytes: int = 0
    # Rank 0 only: per task and per DP group, the requests, tokens, busy seconds and latency quantiles of the run, as
    # plain JSON data (mpitp.evaluation.requestlog fills it, the results file keeps it as ``speed_json``).
    speed: dict | None = None

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """The start-up checks' traffic (head check, prefix-sharing probe) is none of the run's, as their forwards
        are none of its forwards: the byte counters are put back as they were when the block ends. What the checks
        send is fixed by the probes' sizes (tests/test_traffic.py holds it), whatever the workload."""
        saved = {name: replace(getattr(self, name)) for name in ("tp", "tp_score", "pp")}
        try:
            yield
        finally:
            for name, was in saved.items():
                now = getattr(self, name)  # the same object the collectives hold: reset in place
                now.bytes, now.calls = was.bytes, was.calls

    def snapshot(self) -> GroupStats:
        """What the DP leader sends rank 0 at the end of a run (plain numbers, one small pickle)."""
        return GroupStats(busy_s=self.busy_s, requests=self.requests, tokens_scored=self.tokens_scored,
                          row_tokens=self.row_tokens, tokens_read=self.tokens_read,
                          tokens_generated=self.tokens_generated, forwards=self.forwards, tp_bytes=self.tp.bytes,
                          tp_calls=self.tp.calls, tp_score_bytes=self.tp_score.bytes, mpi_bytes=self.mpi_bytes,
                          pp_bytes=self.pp.bytes, speed=self.speed)


@dataclass(frozen=True)
class GroupStats:
    """One DP group's counters at the end of a run, as its leader hands them to rank 0: a row of the results file's
    ``/stats`` (:meth:`file_row`) and of the run's console report."""

    busy_s: float
    requests: float
    tokens_scored: int
    row_tokens: int
    tokens_read: int
    tokens_generated: int
    forwards: int
    tp_bytes: int
    tp_calls: int
    tp_score_bytes: int
    mpi_bytes: int
    pp_bytes: int
    speed: dict | None = None  # rank 0's group only: the run's speed record (mpitp.evaluation.requestlog)

    def file_row(self) -> dict[str, float]:
        """The ``/stats`` columns (:mod:`mpitp.results.schema`): every counter, not the speed record."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "speed"}
