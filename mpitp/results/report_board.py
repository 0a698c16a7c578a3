"""The runs and the leaderboard of the ``mpitp report`` page: one line per run, one row per (task, metric, filter)
with a cell per run, its best value marked and a group's subtasks folded under the group's row.

The values are the text ``mpitp inspect`` prints (:func:`mpitp.results.render.fmt_value`): the two must agree."""

from __future__ import annotations

import hashlib

from mpitp.results.reader import RunFile, metric_rows
from mpitp.results.render import fmt_value, layout_line, stats_totals
from mpitp.results.report_model import Cell, LeaderRow, RunView, finite
from mpitp.results.speed import group_text, speed, summary_text, task_rows


def _wall(v) -> str:
    x = finite(v)
    return f"{x:.1f} s" if x is not None else ""


def run_view(label: str, run: RunFile) -> RunView:
    a = run.attrs
    fp = a.get("fingerprint_json")
    versions = "  ".join(f"{k.replace('_version', '')} {a[k]}" for k in ("mpitp_version", "lm_eval_version") if k in a)
    return RunView(label=label, path=run.path, model=str(a.get("model", "?")),
                   fingerprint=hashlib.sha256(fp.encode()).hexdigest()[:12] if isinstance(fp, str) else "",
                   layout=layout_line(a), created=str(a.get("created", "")), wall_time=_wall(a.get("wall_time_s")),
                   status=run.status, versions=versions, **_speed_fields(run))


def _speed_fields(run: RunFile) -> dict:
    """The run's speed as inspect prints it (:mod:`mpitp.results.speed`'s formatters): the Runs table's cell, and
    the Speed view's latency, per-task rows and per-group lines (empty for an older file or an unfinished run)."""
    s = speed(run, stats_totals(run))
    if s is None:
        return {}
    return dict(speed=summary_text(s), speed_latency=s.latency.text() if s.latency is not None else "",
                speed_tasks=task_rows(s), speed_groups=[f"group {g.name}: {group_text(g)}" for g in s.groups])


def _parents(runs: list[RunFile]) -> dict[str, str]:
    """subtask -> its lm-eval group, from ``group_subtasks`` of the runs' results (the first run that says wins)."""
    out: dict[str, str] = {}
    for run in runs:
        groups = (run.results_json or {}).get("group_subtasks")
        for group, subtasks in (groups.items() if isinstance(groups, dict) else ()):
            for sub in subtasks if isinstance(subtasks, list) else ():
                if isinstance(sub, str) and sub != group:
                    out.setdefault(sub, str(group))
    return out


def _tree_order(rows: list[LeaderRow], parents: dict[str, str]) -> list[LeaderRow]:
    """Each group's row followed by its subtasks' rows (depth first); a cycle in a damaged file is cut."""
    tasks = {r.task for r in rows}
    by_parent: dict[str, list[LeaderRow]] = {}
    for r in rows:
        parent = parents.get(r.task, "")
        r.parent = parent if parent in tasks else ""
        by_parent.setdefault(r.parent, []).append(r)
    out: list[LeaderRow] = []
    seen: set[str] = set()

    def add(parent: str, depth: int) -> None:
        for r in by_parent.get(parent, []):
            r.depth, r.has_children = depth, r.task in by_parent
            out.append(r)
            if r.task not in seen:
                seen.add(r.task)
                add(r.task, depth + 1)

    add("", 0)
    if len(out) != len(rows):  # a cycle (a damaged file): no folding rather than rows that never show
        for r in rows:
            r.parent, r.depth, r.has_children = "", 0, False
        return rows
    return out


def leaderboard(runs: list[RunFile], higher: dict[str, bool]) -> list[LeaderRow]:
    """Tasks x runs; the best value of a row (by lm-eval's higher_is_better, else higher) is marked; a group's
    subtasks follow its row (folded on the page)."""
    table: dict[tuple[str, str, str], list[Cell]] = {}
    for i, run in enumerate(runs):
        for r in metric_rows(run):
            cells = table.setdefault((r.task, r.metric, r.filter), [Cell(None, None, "") for _ in runs])
            # the text ``mpitp inspect`` prints: the leaderboard must show the same
            cells[i] = Cell(finite(r.value), finite(r.stderr), fmt_value(r.value), err_text=fmt_value(r.stderr))
    rows = []
    for (task, metric, filt), cells in table.items():
        vals = [c.value for c in cells if c.value is not None]
        if len(vals) > 1:
            best = (max if higher.get(f"{task}/{metric}", True) else min)(vals)
            for c in cells:
                c.best = c.value == best
        rows.append(LeaderRow(task, metric, filt, cells))
    return _tree_order(rows, _parents(runs))


def higher_is_better(runs: list[RunFile]) -> dict[str, bool]:
    """``task/metric`` -> lm-eval's higher_is_better, from the runs' results (the last run that says wins)."""
    out = {}
    for run in runs:
        for task, m in ((run.results_json or {}).get("higher_is_better") or {}).items():
            for metric, hib in m.items():
                if isinstance(hib, bool):
                    out[f"{task}/{metric}"] = hib
    return out
