"""What the ``mpitp report`` page shows, as plain dataclasses: the gathering (:mod:`mpitp.results.report` and its
``report_*`` helpers) fills them, the rendering (:mod:`mpitp.results.report_html`) only reads them, so neither needs
the other's code.

The bounds the page states are here too, beside the fields that carry them (``diff_bound``, ``diff_iters``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mpitp.results.reader import as_number

DIFF_ITERS = 10000  # bootstrap resamples of the paired tests, as ``mpitp inspect diff``'s default
PAIR_BOUND = 12  # runs: up to this many every pair's paired tests are on the page (66 pairs), past it neighbours'


def finite(v: object) -> float | None:
    """``v`` as a float when it is a finite number, else None (a NaN or a string is no point on a chart)."""
    x = as_number(v)
    return x if x is not None and math.isfinite(x) else None


@dataclass
class RunView:
    label: str
    path: str
    model: str
    fingerprint: str
    layout: str
    created: str
    wall_time: str  # the run's wall time; empty while it has not finished
    status: str
    versions: str
    speed: str = ""  # tokens/s, rank 0 alone, device-seconds, latency (mpitp.results.speed.summary_text); empty while
    # it has not finished
    speed_latency: str = ""  # every request's latency quantiles (files with speed_json; empty for older ones)
    speed_tasks: list[list[str]] = field(default_factory=list)  # rows under mpitp.results.speed.TASK_HEAD
    speed_groups: list[str] = field(default_factory=list)  # one line per DP group (mpitp.results.speed.group_text)


@dataclass
class Cell:
    value: float | None
    stderr: float | None
    text: str
    best: bool = False
    err_text: str = ""  # the stderr as inspect prints it


@dataclass
class LeaderRow:
    task: str
    metric: str
    filter: str
    cells: list[Cell]
    parent: str = ""  # the lm-eval group this task belongs to (its row is folded under the group's)
    depth: int = 0
    has_children: bool = False


@dataclass
class SweepPanel:
    """One metric against checkpoint: (name, value, stderr) per checkpoint, as inline SVG."""

    title: str
    points: list[tuple[str, float, float]]
    svg_points: list[dict] = field(default_factory=list)
    y_labels: list[dict] = field(default_factory=list)  # the axis' lowest and highest value, where they are drawn


@dataclass
class SweepSpeed:
    """A sweep's speed per checkpoint: rows under :data:`mpitp.results.speed.CHECKPOINT_HEAD`, in sweep order."""

    title: str
    rows: list[list[str]]


@dataclass
class DiffView:
    """The paired tests of run ``b`` against run ``a`` per task, the text ``mpitp inspect diff A B`` prints (the page
    holds each pair once, ``a`` the earlier run)."""

    a: str
    b: str
    text: str


@dataclass
class Report:
    runs: list[RunView]
    leaderboard: list[LeaderRow]
    samples: dict  # task -> {"runs": [labels], "rows": [[doc_id, prompt, target, [score], [ll], [answer]]]}
    left_out: list[str]
    sweeps: list[SweepPanel]
    sweep_tests: list[str] = field(default_factory=list)  # the summary's paired tests between neighbours
    sweep_speed: list[SweepSpeed] = field(default_factory=list)  # each sweep's speed per checkpoint
    diffs: list[DiffView] = field(default_factory=list)  # every pair (a first) up to diff_bound runs, else neighbours
    diff_bound: int = PAIR_BOUND
    diff_iters: int = DIFF_ITERS  # 0: no paired tests (as inspect diff)
