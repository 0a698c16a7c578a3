"""How fast a run was, from its results file: what ``mpitp inspect`` prints and ``inspect diff`` compares.

A results file keeps rank 0's seconds per phase (``phases_json``, written at the end of the run: checks, load,
building requests, tokenising, dispatch, metrics, writing, in that order), the wall time and each DP group's busy
seconds (``/stats``). From them: the seconds rank 0 spent outside the groups' busy time (what a launch costs: ``rank
0 alone``), device-seconds (ranks x wall: what the allocation paid) and throughput. Two files from two clusters,
layouts or versions then compare without a stopwatch. ``phases_json`` is untrusted input like the rest of the file:
bounded JSON, finite non-negative numbers only, names escaped when printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Rank 0's phases in the order a run passes through them (the stored dict's keys may come in another order).
PHASE_ORDER = ("checks", "load", "requests", "tokenising", "dispatch", "metrics", "writing")
#: Keys of ``phases_json`` that are totals rather than rank 0's phases (shown on their own).
_TOTALS = ("wall", "max_group_busy", "final_snapshot", "head_check")
_MAX_PHASES = 32


@dataclass(frozen=True)
class Speed:
    wall: float
    ranks: int | None
    phases: dict[str, float] = field(default_factory=dict)  # rank 0's, in the run's order
    max_group_busy: float | None = None
    requests: float = 0.0
    tokens: float = 0.0

    @property
    def alone(self) -> float | None:
        """Wall time outside the busiest group's busy seconds: what rank 0 spent with no group computing."""
        return None if self.max_group_busy is None else max(0.0, self.wall - self.max_group_busy)

    @property
    def device_s(self) -> float | None:
        return None if self.ranks is None else self.ranks * self.wall


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v >= 0 else None


def phases_of(attrs: dict) -> dict[str, float]:
    """``phases_json`` as {phase: seconds}; {} when absent or malformed (never fails a print)."""
    from mpitp.results.untrusted import load_json

    text = attrs.get("phases_json")
    if not isinstance(text, str):
        return {}
    try:
        data = load_json(text, "phases_json", max_chars=1 << 16)
    except ValueError:  # BadInput included
        return {}
    if not isinstance(data, dict):
        return {}
    out = {}
    for k, v in list(data.items())[:_MAX_PHASES]:
        n = _number(v)
        if isinstance(k, str) and n is not None:
            out[k] = n
    return out


def speed(run, totals: dict | None) -> Speed | None:
    """The run's :class:`Speed` (``totals``: the /stats sums the text view computes); None before the run ended."""
    wall = _number(run.attrs.get("wall_time_s"))
    if not wall:
        return None
    phases = phases_of(run.attrs)
    ranks = _number(run.attrs.get("world_size"))
    busy = phases.get("max_group_busy")
    if busy is None and totals is not None:
        busy = totals.get("busy_max")
    totals = totals or {}
    order = {k: i for i, k in enumerate(PHASE_ORDER)}
    ordered = sorted((k for k in phases if k not in _TOTALS), key=lambda k: order.get(k, len(order)))
    return Speed(wall=wall, ranks=int(ranks) if ranks else None, phases={k: phases[k] for k in ordered},
                 max_group_busy=busy,
                 requests=totals.get("requests", 0.0),
                 tokens=totals.get("tokens_scored", 0.0) + totals.get("tokens_generated", 0.0))


def speed_lines(s: Speed) -> list[str]:
    """``inspect``'s lines (after ``wall time`` and ``throughput``)."""
    from mpitp.escape import shown

    lines = []
    if s.phases:
        lines.append("phases      " + ", ".join(f"{shown(k)} {v:.1f} s" for k, v in s.phases.items()) + " (rank 0)")
    cost = []
    if s.alone is not None:
        cost.append(f"rank 0 alone {s.alone:.1f} s (wall - busiest group)")
    if s.device_s is not None:
        cost.append(f"{s.device_s:.1f} device-seconds ({s.ranks} ranks x {s.wall:.1f} s)")
    if cost:
        lines.append("cost        " + ", ".join(cost))
    return lines


def compare_lines(a: Speed | None, b: Speed | None) -> list[str]:
    """``inspect diff``'s speed lines: B against A (ratios B/A; above 1 means B took longer)."""
    if a is None or b is None:
        return []
    from mpitp.escape import shown

    def pair(name: str, x: float | None, y: float | None, unit: str = " s") -> str | None:
        if x is None or y is None:
            return None
        ratio = f" ({y / x:.2f}x)" if x > 0 else ""
        return f"{name} {x:.1f}{unit} -> {y:.1f}{unit}{ratio}"

    parts = [pair("wall", a.wall, b.wall), pair("rank 0 alone", a.alone, b.alone),
             pair("device-seconds", a.device_s, b.device_s, ""),
             pair("tokens/s", a.tokens / a.wall, b.tokens / b.wall, "") if a.tokens and b.tokens else None]
    lines = ["speed       " + ", ".join(p for p in parts if p)]
    common = [k for k in a.phases if k in b.phases]
    if common:
        lines.append("phases      " + ", ".join(pair(shown(k), a.phases[k], b.phases[k]) for k in common))
    return lines
