"""How fast a run was, from its results file: what ``mpitp inspect`` prints, ``inspect diff`` compares and the report
shows (one formatter each, shared: the page and the terminal say the same).

A results file keeps rank 0's seconds per phase (``phases_json``, written at the end of the run: the demo's model when
``--demo`` runs, checks, load, building requests, tokenising, dispatch, metrics, writing, in that order), the wall time
and each DP group's busy seconds (``/stats``). From them: the seconds rank 0 spent outside the groups' busy time (what a
launch costs: ``rank 0 alone``), device-seconds (ranks x wall: what the allocation paid) and throughput. Two files from
two clusters, layouts or versions then compare without a stopwatch.

``speed_json`` (files written since it exists; absent from older ones, and then nothing of it is shown) says where
the groups' time went: per task its requests, tokens, busy seconds and request latency quantiles, per DP group the
same counts and the latency of its chunks (:mod:`mpitp.evaluation.requestlog` records them; ``docs/results-format.md``
defines each field). Both JSON attributes are untrusted input like the rest of the file: bounded JSON, finite
non-negative numbers only, quantiles in order, names escaped when printed; whatever fails that is left out, never an
error (the numbers are reported, not judged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from mpitp.results.reader import RunFile


#: Rank 0's phases in the order a run passes through them (the stored dict's keys may come in another order).
PHASE_ORDER = ("demo", "checks", "load", "requests", "tokenising", "dispatch", "metrics", "writing")
#: Keys of ``phases_json`` that are totals rather than rank 0's phases (shown on their own).
_TOTALS = ("wall", "max_group_busy", "final_snapshot", "head_check")
_MAX_PHASES = 32
#: The latency quantiles a file keeps, by name: nearest rank (:func:`quantiles`), then the largest.
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
LATENCY_KEYS = tuple(k for k, _ in QUANTILES) + ("max",)
#: What a reader takes from ``speed_json`` at most: a benchmark suite has hundreds of subtasks, not millions.
MAX_SPEED_CHARS = 1 << 21
MAX_SPEED_TASKS = 4096
MAX_SPEED_GROUPS = 4096
#: The per-task table's columns (inspect's text table and the report's HTML table show :func:`task_rows` under them).
TASK_HEAD = ("task", "requests", "tokens", "busy s", "req/s", "tok/s", "p50 s", "p90 s", "p99 s", "max s")
#: A sweep's table of speed per checkpoint (the summary's text and the report's Sweep view: :func:`checkpoint_row`).
CHECKPOINT_HEAD = ("checkpoint", "wall s", "req/s", "tok/s", "p50 s", "p99 s", "rank 0 alone s")


def quantiles(values: Iterable[float]) -> dict[str, float]:
    """``{p50, p90, p99, max}`` of ``values`` ({} when there are none): the nearest-rank quantile, the smallest value
    that at least that fraction of the values do not exceed. Why nearest rank: every number shown is a latency some
    request had (no interpolation between two chunks' times), and the same definition holds for any count."""
    v = sorted(values)
    if not v:
        return {}
    out = {name: v[max(0, math.ceil(q * len(v)) - 1)] for name, q in QUANTILES}
    out["max"] = v[-1]
    return out


@dataclass(frozen=True)
class Latency:
    """Seconds from a request's dispatch on rank 0 to its result there (definition: docs/results-format.md)."""

    p50: float
    p90: float
    p99: float
    max: float

    def text(self) -> str:
        return f"p50 {self.p50:.3g} s, p90 {self.p90:.3g} s, p99 {self.p99:.3g} s, max {self.max:.3g} s"


@dataclass(frozen=True)
class Share:
    """One task's or one DP group's part of the run: requests computed (resumed ones are not), tokens (scored
    continuation tokens and generated ones, as the rows' ``n_tokens``), the groups' busy seconds on them, latency."""

    name: str
    requests: float
    tokens: float
    busy_s: float
    latency: Latency | None = None
    chunks: int | None = None  # groups only

    def rate(self, n: float) -> float | None:
        """Per busy second of a replica: what one group does per second on this task (tasks share the wall)."""
        return n / self.busy_s if self.busy_s > 0 else None


@dataclass(frozen=True)
class Speed:
    wall: float
    ranks: int | None
    phases: dict[str, float] = field(default_factory=dict)  # rank 0's, in the run's order
    max_group_busy: float | None = None
    requests: float = 0.0
    tokens: float = 0.0
    latency: Latency | None = None  # every request computed in the run (speed_json)
    tasks: tuple[Share, ...] = ()
    groups: tuple[Share, ...] = ()  # in DP rank order

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


def _json_attr(attrs: dict, name: str, max_chars: int):
    """The JSON of attribute ``name``, or None when absent or not bounded JSON (never fails a print)."""
    from mpitp.results.untrusted import load_json

    text = attrs.get(name)
    if not isinstance(text, str):
        return None
    try:
        return load_json(text, name, max_chars=max_chars)
    except ValueError:  # BadInput included
        return None


def phases_of(attrs: dict) -> dict[str, float]:
    """``phases_json`` as {phase: seconds}; {} when absent or malformed (never fails a print)."""
    data = _json_attr(attrs, "phases_json", 1 << 16)
    if not isinstance(data, dict):
        return {}
    out = {}
    for k, v in list(data.items())[:_MAX_PHASES]:
        n = _number(v)
        if isinstance(k, str) and n is not None:
            out[k] = n
    return out


def latency_of(d: object) -> Latency | None:
    """A stored ``{p50, p90, p99, max}``, or None unless each is a finite non-negative number, in that order."""
    if not isinstance(d, dict):
        return None
    vals = [_number(d.get(k)) for k in LATENCY_KEYS]
    if any(v is None for v in vals) or any(a > b for a, b in zip(vals, vals[1:])):
        return None
    return Latency(*vals)


def _share(name: str, d) -> Share | None:
    if not isinstance(d, dict):
        return None
    counts = [_number(d.get(k)) for k in ("requests", "tokens", "busy_s")]
    if any(c is None for c in counts):
        return None
    chunks = _number(d.get("chunks"))
    return Share(name, *counts, latency=latency_of(d.get("latency")),
                 chunks=int(chunks) if chunks is not None and chunks == int(chunks) else None)


def requests_of(attrs: dict) -> tuple[Latency | None, tuple[Share, ...], tuple[Share, ...]]:
    """``speed_json`` as (latency of all requests, per task, per DP group); nothing of what is malformed: a task
    entry that is not counts is dropped, a group list with any such entry is dropped whole (its positions are the DP
    ranks), an absent attribute (an older file) gives (None, (), ())."""
    data = _json_attr(attrs, "speed_json", MAX_SPEED_CHARS)
    if not isinstance(data, dict):
        return None, (), ()
    tasks = data.get("tasks")
    shares = [_share(k, v) for k, v in list(tasks.items())[:MAX_SPEED_TASKS]
              if isinstance(k, str)] if isinstance(tasks, dict) else []
    groups = data.get("groups")
    per_group = [_share(str(i), g) for i, g in enumerate(groups[:MAX_SPEED_GROUPS])] if isinstance(groups, list) else []
    if None in per_group:
        per_group = []
    tasks_by_name = sorted((s for s in shares if s is not None), key=lambda s: s.name)  # stored in landing order
    return latency_of(data.get("latency")), tuple(tasks_by_name), tuple(per_group)


def speed(run: RunFile, totals: dict | None) -> Speed | None:
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
    latency, tasks, groups = requests_of(run.attrs)
    return Speed(wall=wall, ranks=int(ranks) if ranks else None, phases={k: phases[k] for k in ordered},
                 max_group_busy=busy,
                 requests=totals.get("requests", 0.0),
                 tokens=totals.get("tokens_scored", 0.0) + totals.get("tokens_generated", 0.0),
                 latency=latency, tasks=tasks, groups=groups)


# ------------------------------------------------------------------------------------------------ formatters


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def count(x: float) -> str:
    """A DP group's request count: whole as it is, else (its shares of rolling requests whose windows other groups
    computed too) with two decimals, so the groups' counts add up to the run's: rounded, 2.00 + 1.60 + 0.76 + 0.64
    requests of a 5-request run read 2 + 2 + 1 + 1 = 6."""
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def summary_text(s: Speed) -> str:
    """One line for a run (the report's Runs table, a sweep's row): throughput, rank 0 alone, device-seconds,
    the requests' median and p99 latency."""
    parts = [f"{s.tokens / s.wall:.1f} tokens/s"] if s.tokens else []  # no /stats: not counted, not zero
    if s.alone is not None:
        parts.append(f"rank 0 alone {s.alone:.1f} s")
    if s.device_s is not None:
        parts.append(f"{s.device_s:.1f} device-s")
    if s.latency is not None:
        parts.append(f"latency p50 {s.latency.p50:.3g} s, p99 {s.latency.p99:.3g} s")
    return ", ".join(parts)


def task_rows(s: Speed) -> list[list[str]]:
    """One row per task under :data:`TASK_HEAD` (names as stored: the caller escapes, as text_table and jinja2 do)."""
    rows = []
    for t in s.tasks:
        lat = t.latency
        rows.append([t.name, f"{t.requests:.0f}", f"{t.tokens:.0f}", _num(t.busy_s, 2), _num(t.rate(t.requests), 2),
                     _num(t.rate(t.tokens)), *(_sec(getattr(lat, k)) if lat else "-" for k in LATENCY_KEYS)])
    return rows


def group_text(g: Share) -> str:
    """What one DP group computed and how long its chunks took from dispatch to result."""
    chunks = f", {g.chunks} chunk{'' if g.chunks == 1 else 's'}" if g.chunks is not None else ""
    lat = f", chunk latency {g.latency.text()}" if g.latency is not None else ""
    return f"{count(g.requests)} requests, {g.tokens:.0f} tokens, busy {g.busy_s:.2f} s{chunks}{lat}"


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
    if s.latency is not None:
        lines.append(f"latency     {s.latency.text()} (per request, dispatch to result on rank 0)")
    lines += [f"{'group ' + g.name:<12}{group_text(g)}" for g in s.groups]
    return lines


def task_table(s: Speed) -> str:
    """``inspect``'s per-task table, below the metrics ('' when the file keeps none)."""
    if not s.tasks:
        return ""
    from mpitp.results.texttable import text_table

    return ("speed per task (requests computed in this run; req/s and tok/s per busy second of a replica):\n"
            + text_table(TASK_HEAD, task_rows(s), right=set(range(1, len(TASK_HEAD)))))


def _pair(name: str, x: float | None, y: float | None, unit: str = " s", fmt: str = ".1f") -> str | None:
    if x is None or y is None:
        return None
    ratio = f" ({y / x:.2f}x)" if x > 0 else ""
    return f"{name} {x:{fmt}}{unit} -> {y:{fmt}}{unit}{ratio}"


def _latency_pairs(a: Latency | None, b: Latency | None) -> list[str]:
    if a is None or b is None:
        return []
    return [_pair(k, getattr(a, k), getattr(b, k), fmt=".3g") for k in LATENCY_KEYS]


def _share_lines(label: str, a: tuple[Share, ...], b: tuple[Share, ...]) -> list[str]:
    """Each task (or group) both runs have: its rates per busy second and latency quantiles, B against A."""
    from mpitp.escape import shown

    other = {x.name: x for x in b}
    out = []
    for x in a:
        y = other.get(x.name)
        if y is None:
            continue
        parts = [_pair("busy", x.busy_s, y.busy_s, fmt=".2f"),
                 _pair("tok/s", x.rate(x.tokens), y.rate(y.tokens), ""),
                 *_latency_pairs(x.latency, y.latency)]
        out.append(f"{label + ' ' + shown(x.name) + ':':<11} " + ", ".join(p for p in parts if p))
    return out


def compare_lines(a: Speed | None, b: Speed | None) -> list[str]:
    """``inspect diff``'s speed lines: B against A (ratios B/A; above 1 means B took longer)."""
    if a is None or b is None:
        return []
    from mpitp.escape import shown

    parts = [_pair("wall", a.wall, b.wall), _pair("rank 0 alone", a.alone, b.alone),
             _pair("device-seconds", a.device_s, b.device_s, ""),
             _pair("tokens/s", a.tokens / a.wall, b.tokens / b.wall, "") if a.tokens and b.tokens else None]
    lines = ["speed       " + ", ".join(p for p in parts if p)]
    common = [k for k in a.phases if k in b.phases]
    if common:
        lines.append("phases      " + ", ".join(_pair(shown(k), a.phases[k], b.phases[k]) for k in common))
    if a.latency is not None and b.latency is not None:
        lines.append("latency     " + ", ".join(_latency_pairs(a.latency, b.latency)))
    lines += _share_lines("task", a.tasks, b.tasks)
    if len(a.groups) == len(b.groups):  # another dp: group i is no counterpart of group i
        lines += _share_lines("group", a.groups, b.groups)
    elif a.groups and b.groups:
        lines.append(f"groups      {len(a.groups)} -> {len(b.groups)} (not compared group by group)")
    return lines


def checkpoint_row(name: str, wall: float | None, s: Speed | None) -> list[str]:
    """A sweep's checkpoint under :data:`CHECKPOINT_HEAD` (the summary's text table and the report's sweep table)."""
    if s is None:
        return [name, _num(wall), "-", "-", "-", "-", "-"]
    lat = s.latency
    return [name, _num(s.wall), _num(s.requests / s.wall, 2) if s.requests else "-",
            _num(s.tokens / s.wall) if s.tokens else "-", _sec(lat.p50) if lat else "-", _sec(lat.p99) if lat else "-",
            _num(s.alone)]

