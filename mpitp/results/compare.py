"""Is B better than A? Paired tests per task and metric on two results files' per-document scores.

Used by ``mpitp inspect diff`` and the sweep summary. The scores come from ``/tasks/<task>/doc_scores`` (every file
written since it existed) or, for older files, from ``--log-samples`` records (:mod:`mpitp.results.docscores`); a
task with neither is reported as such, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mpitp.results import stats
from mpitp.results.docscores import DocScores, read


@dataclass
class MetricComparison:
    task: str
    key: str  # lm-eval metric key, "acc,none"
    n: int  # paired documents
    a: float
    b: float
    boot: stats.Bootstrap
    mcnemar: stats.McNemar | None
    higher_is_better: bool | None

    @property
    def metric(self) -> str:
        return self.key.partition(",")[0]

    @property
    def filter(self) -> str:
        return self.key.partition(",")[2]

    def sentence(self, level: float = 0.05) -> str:
        p = self.mcnemar.p_value if self.mcnemar is not None else self.boot.p_value
        test = (f"McNemar, {self.mcnemar.method}" if self.mcnemar is not None else "paired bootstrap")
        s = stats.significance_sentence(f"{self.task} {self.metric}" + (f" [{self.filter}]"
                                        if self.filter != "none" else ""),
                                        self.boot.diff, p, self.higher_is_better, level,
                                        (self.boot.ci_low, self.boot.ci_high), self.boot.confidence)
        return f"{s} [{test}; n={self.n}]"


@dataclass
class TaskComparison:
    task: str
    metrics: list[MetricComparison]
    note: str = ""  # why a task has no statistics


def _aggregate(name: str):
    return stats.AGGREGATES.get(name)


def compare_scores(task: str, sa: DocScores, sb: DocScores, iters: int = 10000, seed: int = 1234,
                   higher: dict | None = None) -> TaskComparison:
    common, ia, ib = np.intersect1d(sa.doc_id, sb.doc_id, return_indices=True)
    if common.size == 0:
        return TaskComparison(task, [], "no documents in common")
    out = []
    notes = []
    for key in [k for k in sa.values if k in sb.values]:
        ca, cb = sa.values[key], sb.values[key]
        if ca.dtype == object or cb.dtype == object or ca.shape[1:] != cb.shape[1:]:
            notes.append(f"{key.partition(',')[0]}: per-document values are not numbers")
            continue
        agg_name = sa.aggregation.get(key) or sb.aggregation.get(key) or ("mean" if ca.ndim == 1 else "")
        agg = _aggregate(agg_name)
        if agg is None:
            notes.append(f"{key.partition(',')[0]}: aggregation {agg_name or '?'} not supported")
            continue
        xa, xb = ca[ia], cb[ib]
        if not (np.all(np.isfinite(xa)) and np.all(np.isfinite(xb))):  # NaN read "B is worse by +nan (p = 0.0001)"
            notes.append(f"{key.partition(',')[0]}: per-document values are not all finite numbers")
            continue
        boot = stats.paired_bootstrap(xa, xb, None if agg_name == "mean" and xa.ndim == 1 else agg, iters=iters,
                                      seed=seed)
        mc = stats.mcnemar(xa, xb) if stats.is_binary(xa) and stats.is_binary(xb) else None
        hib = sa.higher_is_better.get(key, sb.higher_is_better.get(key))
        if hib is None and higher:
            hib = higher.get(key.partition(",")[0])
        out.append(MetricComparison(task, key, int(common.size), agg(xa), agg(xb), boot, mc, hib))
    return TaskComparison(task, out, "; ".join(notes))


def compare_files(path_a: str, path_b: str, tasks: list[str], iters: int = 10000, seed: int = 1234,
                  higher: dict | None = None,
                  scores: Callable[[str, str], DocScores | None] = read) -> list[TaskComparison]:
    """One :class:`TaskComparison` per task of ``tasks`` (present in both files). ``scores(path, task)`` reads a
    task's per-document scores; ``mpitp report`` passes the ones it already read (one read per file and task, however
    many pairs it compares)."""
    out = []
    for task in tasks:
        sa, sb = scores(path_a, task), scores(path_b, task)
        if sa is None or sb is None:
            which = " and ".join(x for x, s in (("A", sa), ("B", sb)) if s is None)
            out.append(TaskComparison(task, [], f"no per-document scores in {which} (a run writes them when it "
                                                "finishes; a file from before doc_scores existed has them only "
                                                "with --log-samples)"))
            continue
        out.append(compare_scores(task, sa, sb, iters, seed, (higher or {}).get(task)))
    return out


def _fmt(x: float) -> str:
    return f"{x:.4f}" if abs(x) < 1e5 else f"{x:.4g}"


def render(comparisons: list[TaskComparison], level: float = 0.05) -> str:
    from mpitp.results.texttable import text_table

    rows, sentences, notes = [], [], []
    for tc in comparisons:
        for m in tc.metrics:
            mc = (f"{m.mcnemar.p_value:.3g} ({'exact' if m.mcnemar.statistic is None else 'chi2'}, "
                  f"{m.mcnemar.a_only}/{m.mcnemar.b_only})" if m.mcnemar else "-")
            rows.append([m.task, m.metric, m.filter, _fmt(m.a), _fmt(m.b), f"{m.boot.diff:+.4f}",
                         f"[{m.boot.ci_low:+.4f}, {m.boot.ci_high:+.4f}]", f"{m.boot.p_value:.3g}", mc, str(m.n)])
            sentences.append("  " + m.sentence(level))
        if tc.note:
            notes.append(f"  {tc.task}: {tc.note}")
    lines = []
    if rows:
        iters = next(m.boot.iters for tc in comparisons for m in tc.metrics)
        lines.append(text_table(["task", "metric", "filter", "A", "B", "B - A", "95% CI (bootstrap)", "p boot",
                                 "p McNemar (A-only/B-only)", "docs"], rows, right={3, 4, 5, 7, 9}))
        lines += ["", f"paired tests on per-document scores ({iters} bootstrap resamples of the documents; McNemar "
                      f"exact binomial below {stats.MCNEMAR_EXACT_BELOW} discordant documents, else chi-square "
                      "with continuity correction):"] + sentences
    if notes:
        lines += ["", "no statistics:"] + notes
    return "\n".join(lines)
