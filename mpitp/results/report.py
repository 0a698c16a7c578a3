"""``mpitp inspect``: read an mpitp HDF5 results file (see :mod:`mpitp.results.store` for the schema).

Two forms share one entry point, :data:`inspect_command`:

- ``mpitp inspect FILE [--task T] [--requests | --samples | --json | --csv] [--limit N] [--plot out.png]``
- ``mpitp inspect diff A.h5 B.h5 [--atol 1e-6] [--rtol 1e-5] [--bootstrap-iters 10000]`` (with paired tests of B
  against A on the per-document scores: :mod:`mpitp.results.compare`)
- ``mpitp inspect sweep-summary.json [--plot out.png]`` (a sweep's summary: :mod:`mpitp.jobs.sweep`)

Exit status: 0 success; 1 "the answer is no" (``diff`` found differences, ``--json`` on a file whose run has not
finished, ``--samples`` where none were logged); 2 bad input (missing, unreadable or non-mpitp file, bad option
combination, ``--plot`` without matplotlib), always reported as one line on stderr.

Files are only ever opened read-only (:func:`mpitp.results.store.open_h5`, HDF5 file locking off by default), so
inspecting a file that a running evaluation is writing is safe: each open sees one complete snapshot, merged with
the rows of the journal beside it (:func:`mpitp.results.store.load_rows`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass, field

import click

from mpitp.results.texttable import text_table

# numpy and h5py (through mpitp.results.store) are imported inside the functions that use them, so that registering
# this command costs ``mpitp --help`` nothing.

BAD_INPUT_EXIT = 2
CONTEXT = {"help_option_names": ["-h", "--help"]}
# Keys of /tasks/<task>/metrics (and of results_json["results"][task]) that are not metrics.
NON_METRIC_KEYS = {"name", "alias", "sample_len", "samples"}
LM_EVAL_KEYS = ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "config")


class BadInput(click.ClickException):
    """One line on stderr and exit status 2: the input (file or options) cannot be inspected."""

    exit_code = BAD_INPUT_EXIT

    def show(self, file=None) -> None:
        click.echo(f"mpitp: error: {self.format_message()}", err=True, file=file)


class Negative(click.ClickException):
    """Exit status 1 with a one-line note on stderr: the files differ, the run is unfinished, nothing logged.

    An exception rather than ``ctx.exit(1)``: ``mpitp``'s ``main`` runs click with ``standalone_mode=False``,
    where a ``ctx.exit`` code is returned rather than used as the process exit status.
    """

    exit_code = 1

    def show(self, file=None) -> None:
        click.echo(f"mpitp: {self.format_message()}", err=True, file=file)


# ------------------------------------------------------------------------------------------------------ reading


def _py(v):
    """HDF5 attribute value -> plain Python."""
    import numpy as np

    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return [_py(x) for x in v.tolist()]
    return v


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _not_mpitp(path: str, reason: str) -> BadInput:
    return BadInput(f"{path} is not an mpitp results file ({reason})")


def _check_path(path: str) -> None:
    if not os.path.exists(path):
        raise BadInput(f"{path}: no such file")
    if os.path.isdir(path):
        raise _not_mpitp(path, "it is a directory")
    if not os.access(path, os.R_OK):
        raise BadInput(f"{path}: permission denied")


@dataclass
class TaskInfo:
    name: str
    attrs: dict
    metrics: dict
    n_rows: int
    has_samples: bool


@dataclass
class RunFile:
    """Everything but the request rows and samples (read on demand: they can be large)."""

    path: str
    attrs: dict
    tasks: dict[str, TaskInfo]
    stats: dict[str, np.ndarray] | None
    results_json: dict | None = None
    extra_results: dict = field(default_factory=dict)  # results_json entries with no /tasks group (lm-eval groups)

    @property
    def status(self) -> str:
        return str(self.attrs.get("status", "unknown"))

    def task(self, name: str) -> TaskInfo:
        if name not in self.tasks:
            known = ", ".join(self.tasks) or "none"
            raise BadInput(f"{self.path} has no task '{name}' (tasks: {known})")
        return self.tasks[name]


def load(path: str) -> RunFile:
    """Read the summary of ``path``; any failure is a one-line :class:`BadInput`."""
    import numpy as np
    from mpitp.results.store import STATS_FIELDS, open_h5, request_counts

    _check_path(path)
    try:
        with open_h5(path) as f:
            attrs = {k: _py(v) for k, v in f.attrs.items()}
            if "tasks" not in f:
                raise _not_mpitp(path, "no /tasks group")
            if "status" not in attrs:
                raise _not_mpitp(path, "no 'status' attribute")
            import h5py

            if not isinstance(f["tasks"], h5py.Group):
                raise _not_mpitp(path, "/tasks is not a group")
            tasks = {}
            for name, g in f["tasks"].items():
                if not isinstance(g, h5py.Group) or not isinstance(g.get("requests", g), h5py.Group):
                    raise _not_mpitp(path, f"/tasks/{name} is not a task group")
                req = g.get("requests")
                tasks[name] = TaskInfo(
                    name=name,
                    attrs={k: _py(v) for k, v in g.attrs.items()},
                    metrics={k: _py(v) for k, v in g["metrics"].attrs.items()} if "metrics" in g else {},
                    n_rows=int(req["doc_id"].shape[0]) if req is not None and "doc_id" in req else 0,
                    has_samples="samples" in g,
                )
            stats = None
            if "stats" in f:
                st = f["stats"]
                stats = {k: np.asarray(st[k][()]) for k in ("dp_rank", *STATS_FIELDS) if k in st}
        for name, n in request_counts(path).items():  # a running or killed run's rows are partly in its journal
            if name in tasks:
                tasks[name].n_rows = n
            else:
                tasks[name] = TaskInfo(name=name, attrs={}, metrics={}, n_rows=n, has_samples=False)
    except BadInput:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as exc:  # what h5py raises on a damaged or foreign file;
        raise _not_mpitp(path, _one_line(exc)) from None  # a TypeError/AttributeError is a bug of ours: it surfaces
    run = RunFile(path=path, attrs=attrs, tasks=tasks, stats=stats)
    if "results_json" in attrs:
        try:
            if not isinstance(attrs["results_json"], str):
                raise ValueError(f"a {type(attrs['results_json']).__name__}, not a JSON string")
            run.results_json = json.loads(attrs["results_json"])
        except ValueError as exc:
            raise _not_mpitp(path, f"results_json is not valid JSON: {_one_line(exc)}") from None
        res = run.results_json.get("results", {}) if isinstance(run.results_json, dict) else {}
        run.extra_results = {k: v for k, v in res.items() if k not in tasks and isinstance(v, dict)}
    return run


def load_requests(path: str, task: str) -> dict[str, np.ndarray]:
    """The request rows of ``task`` sorted by (doc_id, idx), strings decoded (as :func:`results.read_requests`,
    but a damaged file gives a one-line error)."""
    from mpitp.results.store import read_requests

    try:
        cols = read_requests(path, task)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise _not_mpitp(path, f"requests of task {task}: {_one_line(exc)}") from None
    return cols


def load_samples(path: str, task: str) -> list[str] | None:
    from mpitp.results.store import open_h5

    try:
        with open_h5(path) as f:
            g = f[f"tasks/{task}"]
            if "samples" not in g:
                return None
            return [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in g["samples"][()]]
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise _not_mpitp(path, f"samples of task {task}: {_one_line(exc)}") from None


# ------------------------------------------------------------------------------------------------------ metrics


@dataclass
class MetricRow:
    task: str
    metric: str
    filter: str
    value: object
    stderr: object  # a float, "N/A" or None
    n: int | None


def _number(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _metric_rows(task: str, metrics: dict, n: int | None) -> list[MetricRow]:
    rows = []
    for key, value in metrics.items():
        if key in NON_METRIC_KEYS or "," not in key:
            continue
        metric, _, filt = key.partition(",")
        if metric.endswith("_stderr"):
            continue
        rows.append(MetricRow(task, metric, filt, value, metrics.get(f"{metric}_stderr,{filt}"), n))
    return rows


def _task_n(run: RunFile, t: TaskInfo) -> int | None:
    for v in (t.attrs.get("n_docs"), t.metrics.get("sample_len")):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return int(v)
    ns = (run.results_json or {}).get("n-samples", {}).get(t.name, {})
    v = ns.get("effective", ns.get("original")) if isinstance(ns, dict) else None
    return int(v) if isinstance(v, (int, float)) else None


def metric_rows(run: RunFile, task: str | None = None) -> list[MetricRow]:
    """One row per (task, metric, filter): every task's ``/metrics`` attrs, then lm-eval group aggregates."""
    rows = []
    for name, t in run.tasks.items():
        if task is None or name == task:
            rows += _metric_rows(name, t.metrics, _task_n(run, t))
    if task is None:
        for name, res in run.extra_results.items():
            rows += _metric_rows(name, res, None)
    return rows


# --------------------------------------------------------------------------------------------------- formatting


def _fmt_value(v) -> str:
    x = _number(v)
    if x is None:
        return "" if v is None else str(v)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return f"{x:.4f}" if abs(x) < 1e7 else f"{x:.6g}"


def _stats_totals(run: RunFile) -> dict | None:
    import numpy as np
    from mpitp.results.store import STATS_FIELDS

    if not run.stats or "busy_s" not in run.stats:
        return None
    s = run.stats
    tot = {k: float(np.sum(s[k])) for k in STATS_FIELDS if k in s}
    busy = np.asarray(s["busy_s"], dtype=float)
    tot["groups"] = int(busy.shape[0])
    tot["busy_min"] = float(busy.min()) if busy.size else 0.0
    tot["busy_max"] = float(busy.max()) if busy.size else 0.0
    mean = float(busy.mean()) if busy.size else 0.0
    tot["imbalance"] = tot["busy_max"] / mean if mean > 0 else float("nan")
    return tot


def _layout(attrs: dict) -> str:
    pp = int(attrs.get("pp", 1) or 1)
    stages = f" x pp {pp}" if pp > 1 else ""
    return f"world {attrs.get('world_size', '?')} = dp {attrs.get('dp', '?')}{stages} x tp {attrs.get('tp', '?')}"


def header_lines(run: RunFile) -> list[str]:
    a = run.attrs
    lines = [f"file        {run.path}"]
    status = run.status
    if status == "running":
        rows = sum(t.n_rows for t in run.tasks.values())
        status += f" (no metrics yet; {rows} request rows stored so far)"
    lines.append(f"status      {status}")
    lines.append(f"model       {a.get('model', '?')}   dtype {a.get('dtype', '?')}")
    lines.append(f"layout      {_layout(a)}")
    versions = "  ".join(f"{k.replace('_version', '')} {a[k]}" for k in
                         ("mpitp_version", "lm_eval_version", "torch_version", "transformers_version") if k in a)
    if "created" in a:
        lines.append(f"created     {a['created']}")
    if versions:
        lines.append(f"versions    {versions}")
    wall = _number(a.get("wall_time_s"))
    lines.append(f"wall time   {wall:.1f} s" if wall is not None else "wall time   n/a (run not finished)")
    tot = _stats_totals(run)
    if tot is not None:
        tokens = tot.get("tokens_scored", 0.0) + tot.get("tokens_generated", 0.0)
        if wall and wall > 0:
            lines.append(f"throughput  {tot.get('requests', 0) / wall:.2f} requests/s, {tokens / wall:.1f} tokens/s "
                         f"({tot.get('requests', 0):.0f} requests, {tokens:.0f} tokens)")
        lines.append(f"DP groups   {tot['groups']}: busy {tot['busy_min']:.2f} .. {tot['busy_max']:.2f} s "
                     f"(max/mean {tot['imbalance']:.2f})")
    return lines


def render_summary(run: RunFile, task: str | None) -> str:
    rows = []
    for r in metric_rows(run, task):
        err = _number(r.stderr)
        rows.append([r.task, r.metric, r.filter, _fmt_value(r.value), "±" if err is not None else "",
                     _fmt_value(r.stderr) if r.stderr is not None else "", "" if r.n is None else str(r.n)])
    with_metrics = {r[0] for r in rows}
    for name, t in run.tasks.items():  # tasks with no metrics yet (a running or interrupted run)
        if (task is None or name == task) and name not in with_metrics:
            n = _task_n(run, t)
            rows.append([name, f"({t.n_rows} requests stored)", "", "-", "", "", "" if n is None else str(n)])
    out = "\n".join(header_lines(run)) + "\n\n"
    if rows:
        out += text_table(["task", "metric", "filter", "value", "", "stderr", "n"], rows, right={3, 6})
    else:
        out += "(no tasks)"
    return out


def render_csv(run: RunFile, task: str | None) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["task", "metric", "filter", "value", "stderr", "n"])
    for r in metric_rows(run, task):
        v, e = _number(r.value), _number(r.stderr)
        w.writerow([r.task, r.metric, r.filter, repr(v) if v is not None else r.value,
                    repr(e) if e is not None else "", "" if r.n is None else r.n])
    return buf.getvalue()


def lm_eval_json(run: RunFile, task: str | None) -> tuple[dict, bool]:
    """(lm-eval results dict, complete?). A running file gives what is known so far."""
    if run.results_json is not None:
        res = dict(run.results_json)
        if task is not None:
            for k, v in res.items():
                if k != "config" and isinstance(v, dict):
                    res[k] = {name: x for name, x in v.items() if name == task}
        return res, True
    names = [n for n in run.tasks if task is None or n == task]
    config = {}
    if isinstance(run.attrs.get("config_json"), str):
        try:
            config = json.loads(run.attrs["config_json"])
        except ValueError:
            config = {}
    res = {
        "results": {n: {"alias": n, **run.tasks[n].metrics} for n in names if run.tasks[n].metrics},
        "configs": {},
        "versions": {},
        "n-shot": {n: run.tasks[n].attrs["num_fewshot"] for n in names if "num_fewshot" in run.tasks[n].attrs},
        "higher_is_better": {},
        "n-samples": {n: {"effective": _task_n(run, run.tasks[n])} for n in names
                      if _task_n(run, run.tasks[n]) is not None},
        "config": {"model": run.attrs.get("model"), **config},
    }
    return res, False


def _short(s: str, width: int = 40) -> str:
    s = json.dumps(s, ensure_ascii=False)[1:-1]  # escapes newlines and tabs
    return s if len(s) <= width else s[: width - 1] + "…"


def render_requests(path: str, task: str, limit: int | None) -> str:
    cols = load_requests(path, task)
    n = len(cols["doc_id"])
    shown = n if limit is None else min(n, limit)
    rows = []
    for i in range(shown):
        ll = float(cols["loglikelihood"][i])
        rows.append([str(int(cols["doc_id"][i])), str(int(cols["idx"][i])), str(cols["kind"][i]),
                     "-" if math.isnan(ll) else f"{ll:.6f}", "yes" if bool(cols["is_greedy"][i]) else "no",
                     str(int(cols["n_tokens"][i])), _short(str(cols["generation"][i]))])
    head = f"task {task}: {n} request rows, sorted by (doc_id, idx)"
    if shown < n:
        head += f"; first {shown} shown"
    table = text_table(["doc_id", "idx", "kind", "loglikelihood", "is_greedy", "n_tokens", "generation"], rows,
                       right={0, 1, 3, 5})
    return head + "\n" + table


# ----------------------------------------------------------------------------------------------------- plotting


def _figure_class():
    """matplotlib is an optional extra: import it only for ``--plot``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise BadInput("matplotlib is not installed: install mpitp[plot] for --plot") from None
    return Figure


def plot_run(run: RunFile, out: str, task: str | None = None, Figure=None) -> None:
    """Bar charts of every metric (one panel per metric and filter, one bar per task, stderr as error bars) and
    of the busy seconds of each DP group (the dashed line is the mean: bars far from it mean load imbalance).

    Uses the object-oriented API (:class:`matplotlib.figure.Figure`, no pyplot): no global figure state and no
    interactive backend is touched.
    """
    import numpy as np

    Figure = Figure or _figure_class()
    panels: dict[tuple[str, str], list[MetricRow]] = {}
    for r in metric_rows(run, task):
        if _number(r.value) is not None:
            panels.setdefault((r.metric, r.filter), []).append(r)
    n_panels = len(panels) + 1
    widest = max([len(v) for v in panels.values()] + [len(run.stats["busy_s"]) if run.stats and "busy_s" in
                                                        run.stats else 1])
    ncols = 1 if widest > 12 else min(3, n_panels)  # many tasks (a benchmark's subtasks): full-width panels
    nrows = math.ceil(n_panels / ncols)
    width = max(4.5, min(0.35 * widest + 1.5, 16.0))
    fig = Figure(figsize=(width * ncols, 3.6 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()

    for ax, ((metric, filt), rows) in zip(axes, panels.items()):
        x = np.arange(len(rows))
        vals = np.array([_number(r.value) for r in rows], dtype=float)
        errs = np.array([_number(r.stderr) if _number(r.stderr) is not None else np.nan for r in rows], dtype=float)
        finite = np.isfinite(vals)
        log = bool(finite.all() and (vals > 0).all() and vals.max() / vals.min() > 1e3)
        bars = ax.bar(x, np.where(finite, vals, 0.0), color="C0", log=log)
        ok = np.isfinite(errs) & finite
        if ok.any():
            ax.errorbar(x[ok], vals[ok], yerr=errs[ok], fmt="none", ecolor="black", elinewidth=1, capsize=4)
        ax.bar_label(bars, labels=[f"{v:.3g}" if np.isfinite(v) else "nan" for v in vals], padding=2, fontsize=8)
        rotate = len(rows) > 3
        ax.set_xticks(x, [r.task for r in rows], rotation=45 if rotate else 0, ha="right" if rotate else "center",
                      fontsize=8)
        ax.set_title(metric if filt == "none" else f"{metric} [{filt}]")
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
    fig.suptitle(f"{os.path.basename(run.path)}: {a.get('model', '?')}, {_layout(a)} ({run.status})")
    fig.savefig(out, dpi=120)


# -------------------------------------------------------------------------------------------------------- diff


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
            a, b = _number(ma[k]), _number(mb[k])
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
                what.append(f'generation "{_short(gena, 30)}" vs "{_short(genb, 30)}"')
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
    lines = [f"A  {a.path}  ({a.status}; {a.attrs.get('model', '?')}; {_layout(a.attrs)})",
             f"B  {b.path}  ({b.status}; {b.attrs.get('model', '?')}; {_layout(b.attrs)})", ""]
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
    return "\n".join(lines), differ


def render_statistics(a: RunFile, b: RunFile, tasks: list[str], iters: int, seed: int) -> str:
    """Paired tests of B against A per task and metric (:mod:`mpitp.results.compare`)."""
    from mpitp.results.compare import compare_files, render

    higher = {}
    for run in (a, b):
        for task, h in ((run.results_json or {}).get("higher_is_better") or {}).items():
            higher.setdefault(task, h)
    try:
        comparisons = compare_files(a.path, b.path, tasks, iters=iters, seed=seed, higher=higher)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise BadInput(f"per-document scores: {_one_line(exc)}") from None
    return render(comparisons) or "no tasks to compare"


# --------------------------------------------------------------------------------------------------------- CLI


class _FileArgument(click.Argument):
    """FILE, left out of the usage pieces that click puts between ``inspect`` and a subcommand's name."""

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        return []


class _InspectGroup(click.Group):
    """``inspect FILE [options]`` runs the group's own callback; ``inspect diff A B`` runs the subcommand.

    A plain click group with a positional FILE would read ``diff`` as FILE, so the first argument is looked at
    before parsing: a subcommand name dispatches to it, anything else is parsed as the FILE form.
    """

    allow_extra_args = False
    allow_interspersed_args = True

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] in self.commands:
            click.Command.parse_args(self, ctx, [])  # the FILE form's defaults, then the subcommand
            ctx._protected_args, ctx.args = args[:1], args[1:]
            return ctx.args
        click.Command.parse_args(self, ctx, args)
        ctx._protected_args, ctx.args = [], []
        return []

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "[OPTIONS] FILE")
        formatter.write_usage(ctx.command_path, "diff [OPTIONS] A.h5 B.h5", prefix="   or: ")


def _positive_int(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter(f"must be >= 1, got {value}")
    return value


@click.group(cls=_InspectGroup, name="inspect", invoke_without_command=True, context_settings=CONTEXT)
@click.argument("file", cls=_FileArgument, required=False, metavar="FILE")
@click.option("--task", default=None, help="Only this task (needed for --requests and --samples).")
@click.option("--requests", "show_requests", is_flag=True, help="List the task's request rows.")
@click.option("--samples", "show_samples", is_flag=True, help="Print the task's logged lm-eval samples (JSON).")
@click.option("--limit", type=int, default=None, callback=_positive_int,
              help="At most N request rows / samples.")
@click.option("--json", "as_json", is_flag=True, help="lm-eval's results JSON (results, configs, versions, ...).")
@click.option("--csv", "as_csv", is_flag=True, help="One CSV row per (task, metric, filter).")
@click.option("--plot", default=None, metavar="OUT.png",
              help="Also write bar charts of the metrics and per-DP-group busy time (needs mpitp[plot]).")
@click.pass_context
def inspect_command(ctx, file, task, show_requests, show_samples, limit, as_json, as_csv, plot):
    """Show an mpitp results file: a metrics table with the run's status, model, layout and throughput.

    \b
    mpitp inspect FILE                         metrics table
    mpitp inspect FILE --json | --csv          lm-eval results JSON / CSV
    mpitp inspect FILE --task T --requests     request rows (--limit N)
    mpitp inspect FILE --task T --samples      logged samples (--limit N)
    mpitp inspect diff A.h5 B.h5               compare two runs (see diff --help)
    mpitp inspect sweep-summary.json --plot P  a sweep: metric vs checkpoint with error bars

    Exit status: 0 ok; 1 --json of an unfinished run, or no samples logged; 2 bad input.
    """
    if ctx.invoked_subcommand is not None:
        return
    if file is None:
        raise click.UsageError("missing FILE (or use: inspect diff A.h5 B.h5)", ctx=ctx)
    modes = [n for n, on in (("--json", as_json), ("--csv", as_csv), ("--requests", show_requests),
                             ("--samples", show_samples)) if on]
    if len(modes) > 1:
        raise BadInput(f"{' and '.join(modes)} cannot be combined")
    if (show_requests or show_samples) and task is None:
        raise BadInput(f"{modes[0]} needs --task T")
    if limit is not None and not (show_requests or show_samples):
        raise BadInput("--limit applies to --requests and --samples only")
    Figure = _figure_class() if plot else None  # fail before any output when matplotlib is missing

    if file.endswith(".json"):  # a sweep summary: metric vs checkpoint
        return _inspect_sweep(file, task, plot, Figure)
    run = load(file)
    if task is not None:
        run.task(task)

    failure = None  # the note of an exit-status-1 answer, raised after any plot is written
    if as_json:
        res, complete = lm_eval_json(run, task)
        click.echo(json.dumps(res, indent=2, default=str))
        if not complete:
            failure = (f"{file}: status is '{run.status}': lm-eval's results are not written yet; printed what "
                       f"is known so far")
    elif as_csv:
        click.echo(render_csv(run, task), nl=False)
        if run.status != "complete":
            click.echo(f"mpitp: {file}: status is '{run.status}': metrics may be missing", err=True)
    elif show_requests:
        click.echo(render_requests(file, task, limit))
    elif show_samples:
        samples = load_samples(file, task)
        if not samples:
            failure = f"{file}: no samples stored for task {task} (the run did not use --log-samples)"
        else:
            shown = samples if limit is None else samples[:limit]
            for s in shown:
                try:
                    click.echo(json.dumps(json.loads(s), indent=2, ensure_ascii=False, default=str))
                except ValueError:
                    click.echo(s)
            if len(shown) < len(samples):
                click.echo(f"mpitp: {len(shown)} of {len(samples)} samples of {task} shown", err=True)
    else:
        click.echo(render_summary(run, task))

    if plot:
        try:
            plot_run(run, plot, task, Figure=Figure)
        except (OSError, ValueError) as exc:  # an unwritable path, an image format matplotlib does not know
            raise BadInput(f"--plot {plot}: {_one_line(exc)}") from None
        click.echo(f"mpitp: wrote {plot}", err=True)
    if failure:
        raise Negative(failure)


def _inspect_sweep(path: str, task: str | None, plot: str | None, Figure) -> None:
    """``mpitp inspect sweep-summary.json [--plot out.png]``: the sweep's table; the plot draws metric vs checkpoint
    with lm-eval's stderr as error bars."""
    from mpitp.jobs.sweep import Row, plot_summary, render_summary

    _check_path(path)
    try:
        with open(path) as f:
            rows = [Row(**r) for r in json.load(f)["checkpoints"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{path} is not a sweep summary ({_one_line(exc)})") from None
    click.echo(render_summary(rows, path))
    if plot:
        try:
            plot_summary(path, plot, Figure, task)
        except (OSError, ValueError) as exc:
            raise BadInput(f"--plot {plot}: {_one_line(exc)}") from None
        click.echo(f"mpitp: wrote {plot}", err=True)


@inspect_command.command("diff", context_settings=CONTEXT)
@click.argument("a", metavar="A.h5")
@click.argument("b", metavar="B.h5")
@click.option("--atol", type=click.FloatRange(min=0), default=1e-6, show_default=True,
              help="Absolute tolerance for loglikelihoods and metrics.")
@click.option("--rtol", type=click.FloatRange(min=0), default=1e-5, show_default=True,
              help="Relative tolerance (of B's value).")
@click.option("--show", type=click.IntRange(min=0), default=10, show_default=True,
              help="Differing requests listed per task.")
@click.option("--bootstrap-iters", type=click.IntRange(min=0), default=10000, show_default=True,
              help="Paired bootstrap resamples per metric (0: no statistics).")
@click.option("--seed", type=int, default=1234, show_default=True, help="Seed of the bootstrap resampling.")
def diff_command(a, b, atol, rtol, show, bootstrap_iters, seed):
    """Compare two results files: metrics, and each request's loglikelihood, is_greedy and generation, matched by
    (task, doc_id, idx) whatever order the rows were stored in.

    Floats match when |a - b| <= atol + rtol * |b|; generations and is_greedy must be equal; a task or request
    present in one file only is a difference. Exit status 0 when the files agree, 1 when they differ, 2 on bad
    input.

    Then, per task and metric, B - A with paired tests on the per-document scores (paired bootstrap CI and
    p-value; McNemar for 0/1 metrics), so "B is better than A" comes with a confidence. The statistics do not
    change the exit status.
    """
    ra, rb = load(a), load(b)
    diffs, only = diff_runs(ra, rb, atol, rtol)
    text, differ = render_diff(ra, rb, diffs, only, atol, rtol, show)
    click.echo(text)
    if bootstrap_iters:
        click.echo("\n" + render_statistics(ra, rb, [d.task for d in diffs], bootstrap_iters, seed))
    if differ:
        raise Negative(f"{a} and {b} differ")
