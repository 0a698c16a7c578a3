"""The Sweep view of the ``mpitp report`` page: one chart per (task, metric) over checkpoints, from a sweep summary
or from results files of one model family, with the paired tests between neighbouring checkpoints.

Which runs form a family is one stated rule (:func:`family`), nothing else is guessed; the charts are inline SVG
points computed here, so the page asks no host for a plotting library."""

from __future__ import annotations

import re

from mpitp.results.reader import BadInput, RunFile, metric_rows
from mpitp.results.render import fmt_value, stats_totals
from mpitp.results.report_model import SweepPanel, SweepSpeed, finite
from mpitp.results.speed import checkpoint_row, speed
from mpitp.results.sweepsummary import is_metric, natural_key, read_summary
from mpitp.results.untrusted import load_json

Z95 = 1.96  # the sweep plot's bars: value ± 1.96 · stderr, a 95% confidence interval under the normal approximation
# a model path's last part that names a checkpoint (see family()): step-100, checkpoint_2000, global_step5, 300
CHECKPOINT = re.compile(r"(?i)^(?:(?:checkpoint|ckpt|step|global_step|iter|iteration|epoch)[-_]?)?\d+$")


def sweep_tests(path: str, prefix: str = "") -> list[str]:
    """The paired tests between neighbouring checkpoints that the sweep wrote into its summary, one line each, each
    after ``prefix`` (the summary's name, when the page shows several)."""
    doc = read_summary(path)
    comparisons = doc.get("comparisons", []) if isinstance(doc, dict) else []
    out = []
    for c in comparisons if isinstance(comparisons, list) else []:
        if isinstance(c, dict):
            line = c.get("sentence") or (f"{c.get('b')} against {c.get('a')}: {c['error']}" if "error" in c else "")
            if line:
                out.append(f"{prefix}{c.get('b', '?')} vs {c.get('a', '?')}: {line}")
    return out


def sweep_panels(path: str, prefix: str = "", width: int = 520, height: int = 220) -> list[SweepPanel]:
    """One panel per (task, metric) of a sweep summary, points scaled into an SVG box (one point per checkpoint),
    titled after ``prefix`` (the summary's name, when the page shows several)."""
    try:
        rows = [r for r in read_summary(path)["checkpoints"] if isinstance(r, dict) and r.get("metrics")]
        checkpoints = [(str(r.get("name", "?")), dict(r["metrics"])) for r in rows]
    except BadInput:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{path}: not a sweep summary ({exc})") from None
    return panels(checkpoints, prefix, width, height)


def panels(checkpoints: list[tuple[str, dict]], prefix: str, width: int = 520, height: int = 220) -> list[SweepPanel]:
    """One panel per (task, metric) over ``checkpoints`` (name, {task: {metric key: value}}, in sweep order), each
    point with its 95% confidence interval: value ± 1.96 · stderr (lm-eval's stderr of the metric; neither a sweep
    summary nor a results file holds a per-checkpoint bootstrap interval), no bar where there is no stderr."""
    found: dict[tuple[str, str], SweepPanel] = {}
    for name, metrics in checkpoints:
        for task, m in metrics.items():
            for key, v in (m.items() if isinstance(m, dict) else ()):
                metric, _, filt = key.partition(",")
                if not is_metric(key) or finite(v) is None:
                    continue
                err = finite(m.get(f"{metric}_stderr,{filt}")) or 0.0
                found.setdefault((task, key), SweepPanel(f"{prefix}{task}: {key}", [])).points.append(
                    (name, float(v), err))
    for p in found.values():
        lo = min(v - Z95 * e for _, v, e in p.points)
        hi = max(v + Z95 * e for _, v, e in p.points)
        span = (hi - lo) or 1.0
        n = len(p.points)
        for i, (name, v, e) in enumerate(p.points):
            x = 50 + (width - 100) * (i / (n - 1) if n > 1 else 0.5)  # room for the names under the first/last

            def y(val: float) -> float:
                return height - 30 - (height - 50) * (val - lo) / span

            ci = f"95% CI [{fmt_value(v - Z95 * e)}, {fmt_value(v + Z95 * e)}]" if e else "no stderr"
            p.svg_points.append(dict(x=round(x, 1), y=round(y(v), 1), y0=_inside(y(v - Z95 * e), height),
                                     y1=_inside(y(v + Z95 * e), height), name=name, value=fmt_value(v),
                                     stderr=fmt_value(e), ci=ci))
        p.y_labels = [dict(y=round(height - 30, 1), text=fmt_value(lo)), dict(y=20.0, text=fmt_value(hi))]
    return list(found.values())


def _inside(y: float, height: int) -> float:
    """A bar's end kept inside the plot box (its axis runs from y=20 to ``height`` - 30): the scale holds every
    interval, so this only guards against rounding, but a bar drawn over the checkpoint names is never possible."""
    return round(min(max(y, 20.0), height - 30.0), 1)


def _revision(run: RunFile) -> str:
    try:
        rev = load_json(run.attrs.get("config_json") or "{}", "config_json").get("revision")
    except (ValueError, AttributeError):
        return ""
    return rev if isinstance(rev, str) else ""


def family(run: RunFile) -> tuple[str, str] | None:
    """(family, checkpoint name) of a run, or None. The rule: the model's last path part is checkpoint-like
    (:data:`CHECKPOINT`: ``step-100``, ``checkpoint_2000``, ``global_step5``, ``300``) and the family is the path
    before it; else the run names a ``--revision`` and the family is the model. Nothing else is guessed."""
    model = str(run.attrs.get("model", "")).rstrip("/")
    base, _, last = model.rpartition("/")
    if base and CHECKPOINT.match(last):
        return base, last
    rev = _revision(run)
    return (model, rev) if rev and model else None


def families(runs: list[RunFile]) -> list[tuple[str, list[int]]]:
    """Families of at least two runs (by :func:`family`), each's runs ordered naturally by checkpoint name
    (``step-2`` before ``step-10``, :func:`mpitp.results.sweepsummary.natural_key`: a sweep's glob order)."""
    groups: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        f = family(run)
        if f:
            groups.setdefault(f[0], []).append(i)
    return [(name, sorted(idx, key=lambda i: natural_key(family(runs[i])[1])))
            for name, idx in groups.items() if len(idx) > 1]


def family_order(runs: list[RunFile]) -> list[int]:
    """The runs' order on the page: as given, except that a family's runs stand together in checkpoint order where
    its first run was (so a family's neighbours are neighbouring runs, R3 and R4, compared in the Diff view)."""
    fams = {i: idx for _, idx in families(runs) for i in idx}
    out: list[int] = []
    for i in range(len(runs)):
        if i not in out:
            out += fams.get(i, [i])
    return out


def metrics_of(run: RunFile) -> dict:
    """{task: {"acc,none": value, "acc_stderr,none": stderr}} of a results file, the shape of a sweep summary's."""
    out: dict = {}
    for r in metric_rows(run):
        out.setdefault(r.task, {})[f"{r.metric},{r.filter}"] = r.value
        out[r.task][f"{r.metric}_stderr,{r.filter}"] = r.stderr
    return out


def speed_table(title: str, checkpoints: list[tuple[str, float | None, RunFile | None]]) -> SweepSpeed | None:
    """A sweep's speed per checkpoint (name, the summary's wall seconds, its results file when read), rows as the
    text summary prints them (:func:`mpitp.results.speed.checkpoint_row`); None when no checkpoint has a file."""
    rows, found = [], False
    for name, wall, run in checkpoints:
        s = speed(run, stats_totals(run)) if run is not None else None
        found = found or s is not None
        rows.append(checkpoint_row(name, wall, s))
    return SweepSpeed(title, rows) if found else None


def summary_speed(path: str, runs: list[RunFile]) -> list[SweepSpeed]:
    """The speed of a sweep summary's checkpoints whose results files are among ``runs`` (the files the report was
    given: it opens no path the summary names)."""
    import os

    by_path = {os.path.realpath(r.path): r for r in runs}
    try:
        rows = [r for r in read_summary(path)["checkpoints"] if isinstance(r, dict)]
    except (KeyError, TypeError, ValueError):  # BadInput included: the charts said so already
        return []
    table = speed_table(f"sweep {path}", [
        (str(r.get("name", "?")), finite(r.get("wall_s")),
         by_path.get(os.path.realpath(r["output"])) if isinstance(r.get("output"), str) else None) for r in rows])
    return [table] if table else []


def family_speed(runs: list[RunFile]) -> list[SweepSpeed]:
    """Each model family's speed per checkpoint (:func:`families`, in checkpoint order)."""
    tables = [speed_table(name, [(family(runs[i])[1], None, runs[i]) for i in idx]) for name, idx in families(runs)]
    return [t for t in tables if t is not None]


def family_sweeps(runs: list[RunFile], comps: dict[tuple[int, int], list]) -> tuple[list[SweepPanel], list[str]]:
    """The charts of each family of ``runs`` (:func:`families`, in checkpoint order) and the paired tests between its
    neighbouring checkpoints, taken from ``comps`` (the Diff view's, by run index: computed once for both views)."""
    sweeps: list[SweepPanel] = []
    tests: list[str] = []
    for name, idx in families(runs):
        names = [family(runs[i])[1] for i in idx]
        sweeps += panels([(n, metrics_of(runs[i])) for n, i in zip(names, idx)], f"{name}: ")
        for (i, a), (j, b) in zip(zip(idx, names), zip(idx[1:], names[1:])):
            for tc in comps.get((i, j), []):
                tests += [f"{b} vs {a}: {m.sentence()}" for m in tc.metrics]
                tests += [f"{b} vs {a}: {tc.task}: {tc.note}"] if tc.note else []
    return sweeps, tests
