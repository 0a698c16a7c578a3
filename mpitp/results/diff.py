"""``mpitp inspect diff A.h5 B.h5``: two runs compared request by request and metric by metric.

Requests are matched by (task, doc_id, idx, repeat) whatever order they were stored in; floats match when
``|a - b| <= atol + rtol * |b|``; generations and is_greedy must be equal. :func:`render_statistics` adds paired
tests of B against A on the per-document scores (:mod:`mpitp.results.compare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mpitp.results.reader import BadInput, RunFile, as_number, load_requests, one_line
from mpitp.results.render import layout_line, short_text, stats_totals
from mpitp.results.speed import compare_lines, speed
from mpitp.results.texttable import text_table

if TYPE_CHECKING:
    from collections.abc import Callable

    from mpitp.results.docscores import DocScores


@dataclass
class TaskDiff:
    task: str
    compared: int = 0
    max_dll: float = 0.0
    mismatches: list[str] = field(default_factory=list)  # differing or missing requests
    metric_diffs: list[str] = field(default_factory=list)
    note: str = ""


def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    import numpy as np

    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return bool(np.isclose(a, b, atol=atol, rtol=rtol, equal_nan=True))


def _diff_metrics(ma: dict, mb: dict, atol: float, rtol: float) -> list[str]:
    out = []
    for k in list(ma) + [k for k in mb if k not in ma]:
        if k not in mb:
            out.append(f"metric {k}: only in A ({ma[k]!r})")
        elif k not in ma:
            out.append(f"metric {k}: only in B ({mb[k]!r})")
        else:
            a, b = as_number(ma[k]), as_number(mb[k])
            same = _close(a, b, atol, rtol) if a is not None and b is not None else ma[k] == mb[k]
            if not same:
                out.append(f"metric {k}: {ma[k]!r} vs {mb[k]!r}")
    return out


def _rows_by_key(cols: dict) -> dict[tuple[int, int, int], list[tuple]]:
    out: dict[tuple[int, int, int], list[tuple]] = {}
    rep = cols.get("repeat")
    for i in range(len(cols["doc_id"])):
        ll = float(cols["loglikelihood"][i])
        key = (int(cols["doc_id"][i]), int(cols["idx"][i]), int(rep[i]) if rep is not None else 0)
        out.setdefault(key, []).append(
            (ll, bool(cols["is_greedy"][i]), str(cols["generation"][i])))
    for v in out.values():  # duplicates of one key (should not happen): compare them in a canonical order
        v.sort(key=lambda r: (math.isnan(r[0]), r[0] if not math.isnan(r[0]) else 0.0, r[1], r[2]))
    return out


def _diff_requests(td: TaskDiff, ca: dict, cb: dict, atol: float, rtol: float) -> None:
    ra, rb = _rows_by_key(ca), _rows_by_key(cb)
    for key in sorted(set(ra) | set(rb)):
        la, lb = ra.get(key, []), rb.get(key, [])
        where = f"doc_id={key[0]} idx={key[1]}" + (f" repeat={key[2]}" if key[2] else "")
        for (lla, ga, gena), (llb, gb, genb) in zip(la, lb):
            td.compared += 1
            what = []
            if not (math.isnan(lla) or math.isnan(llb)):
                td.max_dll = max(td.max_dll, abs(lla - llb))
            if not _close(lla, llb, atol, rtol):
                what.append(f"loglikelihood {lla!r} vs {llb!r} (|d| {abs(lla - llb):.3g})")
            if ga != gb:
                what.append(f"is_greedy {ga} vs {gb}")
            if gena != genb:
                what.append(f'generation "{short_text(gena, 30)}" vs "{short_text(genb, 30)}"')
            if what:
                td.mismatches.append(f"{where}: " + "; ".join(what))
        if len(la) > len(lb):
            td.mismatches.append(f"{where}: only in A" + (f" ({len(la) - len(lb)} rows)" if len(la) - len(lb) > 1
                                                           else ""))
        elif len(lb) > len(la):
            td.mismatches.append(f"{where}: only in B" + (f" ({len(lb) - len(la)} rows)" if len(lb) - len(la) > 1
                                                           else ""))


def diff_runs(a: RunFile, b: RunFile, atol: float, rtol: float) -> tuple[list[TaskDiff], list[tuple[str, str]]]:
    """Per-task differences of two runs and the tasks present in only one of them, as (task, "A" or "B")."""
    only = [(t, "A") for t in a.tasks if t not in b.tasks] + [(t, "B") for t in b.tasks if t not in a.tasks]
    out = []
    for name in [t for t in a.tasks if t in b.tasks]:
        td = TaskDiff(name)
        td.metric_diffs = _diff_metrics(a.tasks[name].metrics, b.tasks[name].metrics, atol, rtol)
        _diff_requests(td, load_requests(a.path, name), load_requests(b.path, name), atol, rtol)
        out.append(td)
    return out, only


def render_diff(a: RunFile, b: RunFile, diffs: list[TaskDiff], only: list[tuple[str, str]], atol: float, rtol: float,
                show: int) -> tuple[str, bool]:
    lines = [f"A  {a.path}  ({a.status}; {a.attrs.get('model', '?')}; {layout_line(a.attrs)})",
             f"B  {b.path}  ({b.status}; {b.attrs.get('model', '?')}; {layout_line(b.attrs)})", ""]
    rows = [[d.task, str(d.compared), f"{d.max_dll:.3g}", str(len(d.mismatches)),
             "same" if not d.metric_diffs else f"{len(d.metric_diffs)} differ"] for d in diffs]
    rows += [[t, "-", "-", "-", f"only in {side}"] for t, side in only]
    lines.append(text_table(["task", "requests", "max |d ll|", "mismatches", "metrics"], rows, right={1, 2, 3}))
    details = []
    for d in diffs:
        for m in d.metric_diffs:
            details.append(f"  {d.task}: {m}")
        for m in d.mismatches[:show]:
            details.append(f"  {d.task} {m}")
        if len(d.mismatches) > show:
            details.append(f"  {d.task}: ... and {len(d.mismatches) - show} more differing requests")
    details += [f"  task {t}: only in {side}" for t, side in only]
    n_req = sum(len(d.mismatches) for d in diffs)
    n_met = sum(len(d.metric_diffs) for d in diffs)
    differ = bool(n_req or n_met or only)
    if details:
        lines += ["", "differences:"] + details
    lines.append("")
    tol = f"atol={atol:g} rtol={rtol:g}"
    if differ:
        lines.append(f"DIFFERENT beyond {tol}: {n_req} request(s), {n_met} metric(s), {len(only)} task(s)")
    else:
        lines.append(f"same within {tol}: {sum(d.compared for d in diffs)} requests in {len(diffs)} task(s)")
    if a.status != b.status:
        lines.append(f"note: A is {a.status}, B is {b.status}")
    lines += compare_lines(speed(a, stats_totals(a)), speed(b, stats_totals(b)))
    return "\n".join(lines), differ


def paired_comparisons(a: RunFile, b: RunFile, tasks: list[str], iters: int, seed: int,
                       scores: Callable[[str, str], DocScores | None] | None = None) -> list:
    """Paired tests of B against A per task and metric (:mod:`mpitp.results.compare`), lm-eval's higher_is_better
    of either file naming the better direction. ``scores``: see :func:`~mpitp.results.compare.compare_files`
    (``mpitp report`` compares every pair of its runs from one read of each file)."""
    from mpitp.results.compare import compare_files
    from mpitp.results.docscores import read

    higher = {}
    for run in (a, b):
        for task, h in ((run.results_json or {}).get("higher_is_better") or {}).items():
            higher.setdefault(task, h)
    try:
        return compare_files(a.path, b.path, tasks, iters=iters, seed=seed, higher=higher, scores=scores or read)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise BadInput(f"per-document scores: {one_line(exc)}") from None


def statistics_text(comparisons: list) -> str:
    """What ``mpitp inspect diff`` prints of :func:`paired_comparisons` (and ``mpitp report`` shows, the same text)."""
    from mpitp.results.compare import render

    return render(comparisons) or "no tasks to compare"


def render_statistics(a: RunFile, b: RunFile, tasks: list[str], iters: int, seed: int) -> str:
    """Paired tests of B against A per task and metric, as text."""
    return statistics_text(paired_comparisons(a, b, tasks, iters, seed))
