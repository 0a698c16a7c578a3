"""``mpitp inspect FILE --plot OUT.png``: bar charts of a run's metrics and of each DP group's busy time.

matplotlib is an optional extra (``mpitp[plot]``), imported only here and only when a plot is asked for.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from mpitp.escape import shown
from mpitp.results.reader import BadInput, MetricRow, RunFile, as_number, metric_rows
from mpitp.results.render import layout_line

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    from matplotlib.figure import Figure


def figure_class() -> type[Figure]:
    """matplotlib is an optional extra: import it only for ``--plot``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise BadInput("matplotlib is not installed: install mpitp[plot] for --plot") from None
    return Figure


def error_bars(vals: np.ndarray, errs: np.ndarray, log: bool,
               shown: np.ndarray | None = None) -> tuple[np.ndarray, tuple[float, float] | None]:
    """(yerr, y limits or None) for ``ax.errorbar``: each bar ``value ± stderr`` kept inside the axis. On a log axis
    a lower end at or below zero has no place (matplotlib draws it off the bottom edge): it stops at the axis floor, a
    tenth of the lowest positive value or end, and the limits are set to hold every end and every value in ``shown``
    (the panel's bars). A linear axis already holds them (matplotlib's autoscale counts the error bars): the stderr
    as it is."""
    import numpy as np

    if not log:
        return errs, None
    shown = vals if shown is None else shown
    ends = np.concatenate([shown, vals - errs])
    floor = float(ends[ends > 0].min()) / 10
    lower = np.minimum(errs, vals - floor)
    return np.vstack([lower, errs]), (floor, float(max(shown.max(), (vals + errs).max())) * 2)


def plot_run(run: RunFile, out: str, task: str | None = None, Figure: Callable[..., Figure] | None = None) -> None:
    """Bar charts of every metric (one panel per metric and filter, one bar per task, stderr as error bars) and
    of the busy seconds of each DP group (the dashed line is the mean: bars far from it mean load imbalance).

    Uses the object-oriented API (:class:`matplotlib.figure.Figure`, no pyplot): no global figure state and no
    interactive backend is touched.
    """
    import numpy as np

    Figure = Figure or figure_class()
    panels: dict[tuple[str, str], list[MetricRow]] = {}
    for r in metric_rows(run, task):
        if as_number(r.value) is not None:
            panels.setdefault((r.metric, r.filter), []).append(r)
    n_panels = len(panels) + 1
    widest = max([len(v) for v in panels.values()] + [len(run.stats["busy_s"]) if run.stats and "busy_s" in
                                                        run.stats else 1])
    ncols = 1 if widest > 12 else min(3, n_panels)  # many tasks (a benchmark's subtasks): full-width panels
    nrows = math.ceil(n_panels / ncols)
    width = max(4.5, min(0.35 * widest + 1.5, 16.0))
    fig = Figure(figsize=(width * ncols, 3.6 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()

    drew_errors = False
    for ax, ((metric, filt), rows) in zip(axes, panels.items()):
        x = np.arange(len(rows))
        vals = np.array([as_number(r.value) for r in rows], dtype=float)
        errs = np.array([as_number(r.stderr) if as_number(r.stderr) is not None else np.nan for r in rows], dtype=float)
        finite = np.isfinite(vals)
        log = bool(finite.all() and (vals > 0).all() and vals.max() / vals.min() > 1e3)
        bars = ax.bar(x, np.where(finite, vals, 0.0), color="C0", log=log)
        ok = np.isfinite(errs) & finite
        if ok.any():
            yerr, limits = error_bars(vals[ok], errs[ok], log, vals[finite])
            ax.errorbar(x[ok], vals[ok], yerr=yerr, fmt="none", ecolor="black", elinewidth=1, capsize=4)
            drew_errors = True
            if limits is not None:
                ax.set_ylim(*limits)
        ax.bar_label(bars, labels=[f"{v:.3g}" if np.isfinite(v) else "nan" for v in vals], padding=2, fontsize=8)
        rotate = len(rows) > 3
        ax.set_xticks(x, [shown(r.task) for r in rows], rotation=45 if rotate else 0,
                      ha="right" if rotate else "center", fontsize=8)
        ax.set_title(shown(metric if filt == "none" else f"{metric} [{filt}]"))
        ax.margins(y=0.15)

    ax = axes[len(panels)]
    if run.stats and "busy_s" in run.stats and len(run.stats["busy_s"]):
        busy = np.asarray(run.stats["busy_s"], dtype=float)
        ranks = np.asarray(run.stats.get("dp_rank", np.arange(len(busy))))
        ax.bar(ranks, busy, color="C1")
        mean = float(busy.mean())
        ax.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.2f} s")
        ax.set_xticks(ranks, [str(int(r)) for r in ranks])
        ax.set_xlabel("DP group")
        ax.set_ylabel("busy seconds")
        ratio = busy.max() / mean if mean > 0 else float("nan")
        ax.set_title(f"busy per DP group (max/mean {ratio:.2f})")
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no /stats in this file\n(run not finished)", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
    for extra in axes[n_panels:]:
        extra.set_axis_off()
    a = run.attrs
    # what the error bars are: the report draws 95% intervals, so an unlabelled bar could be read as one
    bars_are = "\nerror bars: +/- 1 standard error (lm-eval's stderr)" if drew_errors else ""
    # names from the file escaped as on the terminal: matplotlib's warning of a glyph it lacks quoted a raw ESC
    fig.suptitle(shown(f"{os.path.basename(run.path)}: {a.get('model', '?')}, {layout_line(a)} ({run.status})")
                 + bars_are)
    fig.savefig(out, dpi=120)
