"""A sweep's summary: one :class:`Row` per checkpoint, written as ``sweep-summary.json`` beside the results files
with a paired test of each checkpoint against the previous one, printed as a table, plotted as metric vs checkpoint.

Written by a sweep or a watch (:mod:`mpitp.jobs.sweep`) and read again by ``mpitp inspect``: rendering lives with the
results, so the inspecting side does not import the running side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mpitp.escape import shown
from mpitp.results.safefile import write_replace

if TYPE_CHECKING:
    from collections.abc import Callable

    from matplotlib.figure import Figure

SUMMARY_NAME = "sweep-summary.json"
SUMMARY_GLOB = "sweep-summary*.json"  # every sweep's summary in a folder (:func:`summary_path`)


def natural_key(s: str) -> list[int | str]:
    """Sort key that orders numbers in names by value: step-2 before step-10. The order a sweep evaluates a glob in,
    and the order the report lays a model family's files out in, so it lives here, below both."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


@dataclass
class Row:
    model: str
    name: str
    output: str
    status: str  # "complete", "skipped (complete)", "failed"
    error: str = ""
    wall_s: float = 0.0
    metrics: dict = field(default_factory=dict)  # task -> {metric key: value}


def is_metric(key: str) -> bool:
    """A metric's key (``acc,none``): not its stderr, nor what lm-eval keeps beside the metrics (``sample_len``)."""
    from mpitp.results.reader import NON_METRIC_KEYS

    metric, sep, _ = key.partition(",")
    return bool(sep) and metric not in NON_METRIC_KEYS and not metric.endswith("_stderr")


def summary_path(rows: list[Row]) -> str:
    """``sweep-summary.json`` in the folder of the results files (the one holding them all: ``{name}/r.h5`` puts
    each in a folder of its own; the summary went into the first checkpoint's, and the others' speed was left out);
    ``sweep-summary-<tag>.json`` when the files are named by a pattern with more than the checkpoint's name
    (``{name}-arc.h5``: tag ``arc``; each row's ``name`` is its file's ``{name}``), so that two sweeps (or watches)
    writing into one folder with different patterns keep a summary each (the second replaced the first's)."""
    folder = os.path.commonpath([os.path.dirname(os.path.abspath(r.output)) for r in rows]) if rows else "."
    patterns = {os.path.relpath(os.path.abspath(r.output), folder).replace(r.name, "{name}", 1) for r in rows}
    if len(patterns) != 1 or patterns == {"{name}.h5"}:
        return os.path.join(folder, SUMMARY_NAME)
    tag = re.sub(r"[^A-Za-z0-9._-]+", "_", patterns.pop().removesuffix(".h5").replace("{name}", "")).strip("-_.")
    return os.path.join(folder, f"sweep-summary-{tag}.json" if tag else SUMMARY_NAME)


def _comparisons(rows: list[Row], iters: int = 2000) -> list[dict]:
    """Paired tests of each evaluated checkpoint against the previous evaluated one."""
    from mpitp.results.compare import compare_files

    done = [r for r in rows if r.status != "failed" and os.path.exists(r.output)]
    out = []
    for prev, cur in zip(done, done[1:]):
        tasks = sorted(set(prev.metrics) & set(cur.metrics))
        try:
            comps = compare_files(prev.output, cur.output, tasks, iters=iters)
        except (OSError, KeyError, ValueError) as exc:
            out.append(dict(a=prev.name, b=cur.name, error=str(exc)))
            continue
        for tc in comps:
            for m in tc.metrics:
                p = m.mcnemar.p_value if m.mcnemar else m.boot.p_value
                out.append(dict(a=prev.name, b=cur.name, task=m.task, metric=m.key, diff=m.boot.diff,
                                ci=[m.boot.ci_low, m.boot.ci_high], p_value=p,
                                test=f"McNemar ({m.mcnemar.method})" if m.mcnemar else "paired bootstrap",
                                sentence=m.sentence()))
    return out


def write_summary(path: str, rows: list[Row], wall_s: float, **extra: object) -> None:
    """``extra``: what the kind of sweep adds (an adapter sweep: its base model and how often it was loaded).

    Each checkpoint's ``output`` is written absolute: ``--output 'res/{name}.h5'`` is relative to the launch's
    directory, and ``mpitp inspect``/``mpitp report`` read the summary from anywhere (a relative path resolved
    against their own directory named no file, and the speed per checkpoint was left out)."""
    doc = dict(wall_time_s=wall_s, **extra,
               checkpoints=[dict(dataclasses.asdict(r), output=os.path.abspath(r.output)) for r in rows],
               comparisons=_comparisons(rows))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_replace(path, json.dumps(doc, indent=2, default=str).encode())  # never through a planted link


def read_summary(path: str) -> object:
    """The JSON of the sweep summary at ``path``, read as untrusted input: a regular file only (a FIFO there would
    block the open forever) and JSON bounded in size and depth (:func:`mpitp.results.untrusted.load_json`); any
    failure is a one-line :class:`~mpitp.results.untrusted.BadInput`."""
    from mpitp.results.untrusted import BadInput, load_json, read_regular

    data = read_regular(path, "the sweep summary")
    try:
        return load_json(data, "its JSON")
    except BadInput as exc:
        raise BadInput(f"{path}: not a sweep summary ({exc})") from None


def render_summary(rows: list[Row], path: str) -> str:
    from mpitp.results.texttable import text_table

    keys = []
    for r in rows:
        for task, m in r.metrics.items():
            for k in m:
                if is_metric(k) and (task, k) not in keys:
                    keys.append((task, k))
    keys = keys[:6]  # the table stays readable; the JSON summary has them all
    table = []
    for r in rows:
        vals = [f"{r.metrics.get(t, {}).get(k, float('nan')):.4f}" if r.metrics else "-" for t, k in keys]
        table.append([r.name, r.status if r.status != "failed" else "FAILED", f"{r.wall_s:.1f}", *vals])
    head = ["checkpoint", "status", "wall s", *[f"{t} {k.split(',')[0]}" for t, k in keys]]
    lines = ["", f"sweep: {sum(r.status != 'failed' for r in rows)}/{len(rows)} checkpoints ok",
             text_table(head, table, right=set(range(2, len(head))))]
    for r in rows:
        if r.status == "failed":
            lines.append(f"  {r.name}: {r.error}")
    lines += _speed_lines(rows, path)
    try:
        doc = read_summary(path)
        comps = doc.get("comparisons", []) if isinstance(doc, dict) else []
    except (OSError, ValueError):  # BadInput included: the table stands without the tests
        comps = []
    if comps:
        lines += ["", "each checkpoint against the previous one (paired tests on per-document scores):"]
        lines += [f"  {c['b']} vs {c['a']}: {c['sentence']}" for c in comps if "sentence" in c]
    lines.append(f"summary: {path}")
    return "\n".join(lines)


def _beside(output: str, path: str) -> bool:
    """Whether ``output`` lies in the summary's folder or below it (:func:`summary_path`)."""
    folder = os.path.dirname(os.path.abspath(path))
    return os.path.commonpath([os.path.dirname(os.path.abspath(output)), folder]) == folder


def _speed_lines(rows: list[Row], path: str) -> list[str]:
    """Each checkpoint's speed (:func:`mpitp.results.speed.checkpoint_row`), read from its results file when that
    lies in the summary's folder or below it (a sweep writes them there; a summary from elsewhere names no other file
    mpitp opens), through the checked reader; none of them readable: no lines."""
    from mpitp.results.reader import load
    from mpitp.results.render import stats_totals
    from mpitp.results.speed import CHECKPOINT_HEAD, checkpoint_row, speed
    from mpitp.results.texttable import text_table

    table, found = [], False
    for r in rows:
        s = None
        if r.status != "failed" and _beside(r.output, path) and os.path.isfile(r.output):
            try:
                run = load(r.output)
                s = speed(run, stats_totals(run))
            except ValueError:  # BadInput: not an mpitp file (any more); the row stays without its speed
                s = None
        found = found or s is not None
        table.append(checkpoint_row(r.name, r.wall_s, s))
    if not found:
        return []
    return ["", "speed per checkpoint (from each results file):",
            text_table(CHECKPOINT_HEAD, table, right=set(range(1, len(CHECKPOINT_HEAD))))]


def plot_summary(path: str, out: str, Figure: Callable[..., Figure], task: str | None = None) -> int:
    """Metric vs checkpoint (one panel per task and metric, lm-eval's stderr as error bars) from a sweep summary.
    Returns the number of panels drawn."""
    import math

    rows = [r for r in read_summary(path)["checkpoints"] if r.get("metrics")]
    keys: list[tuple[str, str]] = []
    for r in rows:
        for t, m in r["metrics"].items():
            for k in m:
                if is_metric(k) and (t, k) not in keys and (task is None or t == task):
                    keys.append((t, k))
    if not keys:
        raise ValueError(f"{path}: no metrics of evaluated checkpoints to plot")
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(5 * ncols, 3.6 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (t, k) in zip(axes, keys):
        metric, _, filt = k.partition(",")
        xs, ys, es, names = [], [], [], []
        for i, r in enumerate(rows):
            v = r["metrics"].get(t, {}).get(k)
            if isinstance(v, (int, float)):
                e = r["metrics"][t].get(f"{metric}_stderr,{filt}")
                xs.append(i)
                ys.append(float(v))
                es.append(float(e) if isinstance(e, (int, float)) else float("nan"))
                names.append(r["name"])
        ax.errorbar(xs, ys, yerr=[0.0 if math.isnan(e) else e for e in es], marker="o", capsize=4)
        wide = len(xs) > 4
        ax.set_xticks(xs, [shown(n) for n in names], rotation=45 if wide else 0, ha="right" if wide else "center",
                      fontsize=8)
        ax.set_title(shown(f"{t}: {metric}" + ("" if filt == "none" else f" [{filt}]")), fontsize=9)
    for extra in axes[len(keys):]:
        extra.set_axis_off()
    fig.suptitle(shown(f"sweep: {os.path.dirname(os.path.abspath(path))}"))  # names from the file, escaped
    fig.savefig(out, dpi=120)
    return len(keys)
