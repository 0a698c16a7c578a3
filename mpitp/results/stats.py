"""Paired significance tests for comparing two runs document by document (pure maths, numpy only).

Two evaluations of the same documents are paired: the question "is B better than A?" is answered on the per-document
differences, not on two independent means (which would throw away the pairing and overstate the noise).

- :func:`paired_bootstrap`: resample documents with replacement, recompute the metric's aggregate on both runs each
  time; gives a percentile confidence interval of B - A and a two-sided p-value (the share of resampled differences at
  least as far from the observed one as the observed one is from zero: the bootstrap distribution shifted to the null,
  as in Berg-Kirkpatrick et al. 2012). Works for any aggregate (mean, perplexities).
- :func:`mcnemar`: for 0/1 scores (accuracy, exact match): only the discordant documents carry information. Exact
  two-sided binomial test when they are few (< :data:`MCNEMAR_EXACT_BELOW`), else the chi-square statistic with
  Edwards' continuity correction; the result names the one used.

scipy is not required: the binomial tail is summed exactly and the chi-square (1 degree of freedom) tail is
``erfc(sqrt(x / 2))``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

MCNEMAR_EXACT_BELOW = 25  # discordant pairs: below this the normal approximation is poor, use the exact binomial


@dataclass(frozen=True)
class McNemar:
    a_only: int  # documents A gets right and B wrong
    b_only: int  # documents B gets right and A wrong
    p_value: float
    method: str  # "exact binomial" or "chi-square, continuity-corrected"
    statistic: float | None = None  # the chi-square statistic when that method is used


@dataclass(frozen=True)
class Bootstrap:
    diff: float  # aggregate(B) - aggregate(A) on the documents as they are
    ci_low: float
    ci_high: float
    p_value: float
    iters: int
    confidence: float


def binom_two_sided_half(k: int, n: int) -> float:
    """Two-sided exact p-value of ``k`` successes in ``n`` trials at p = 1/2 (symmetric: twice the smaller tail)."""
    if n == 0:
        return 1.0
    k = min(k, n - k)
    tail = sum(math.comb(n, i) for i in range(k + 1))  # exact integers
    return min(1.0, 2.0 * (tail / 2**n))  # int / int: correctly rounded whatever n


def chi2_sf_1df(x: float) -> float:
    """Upper tail of the chi-square distribution with one degree of freedom."""
    return math.erfc(math.sqrt(max(0.0, x) / 2.0))


def mcnemar(a_correct: ArrayLike, b_correct: ArrayLike) -> McNemar:
    """McNemar's test on paired 0/1 outcomes (truthy = correct)."""
    a = np.asarray(a_correct, dtype=bool)
    b = np.asarray(b_correct, dtype=bool)
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes of different lengths: {a.shape[0]} and {b.shape[0]}")
    return mcnemar_counts(int(np.sum(a & ~b)), int(np.sum(~a & b)))


def mcnemar_counts(a_only: int, b_only: int) -> McNemar:
    n = a_only + b_only
    if n < MCNEMAR_EXACT_BELOW:
        return McNemar(a_only, b_only, binom_two_sided_half(a_only, n), "exact binomial")
    stat = (abs(a_only - b_only) - 1.0) ** 2 / n
    return McNemar(a_only, b_only, chi2_sf_1df(stat), "chi-square, continuity-corrected", stat)


def paired_bootstrap(a: ArrayLike, b: ArrayLike, aggregate: Callable[[np.ndarray], float] | None = None,
                     iters: int = 10000, confidence: float = 0.95, seed: int = 1234) -> Bootstrap:
    """Paired bootstrap of ``aggregate(B) - aggregate(A)`` over documents.

    ``a`` and ``b`` are per-document scores in the same document order: 1-d (one number per document) or 2-d (one
    row per document, e.g. ``(loglikelihood, weight)`` for perplexities); ``aggregate`` maps such an array to the
    metric (default: the mean of a 1-d array).

    The p-value is the percentile interval's test (twice the smaller share of resampled differences on one side of
    0), so the sentence never pairs a 95% interval that excludes 0 with p >= 0.05. The test that recentred the
    resamples on 0 did, on skewed aggregates: perplexity, ``exp`` of a mean, worse on all 6 documents of a sweep's
    lambada gave p = 0.38 beside the interval [+9.0e17, +5.0e25].
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired scores of different shapes: {a.shape} and {b.shape}")
    n = a.shape[0]
    if n == 0:
        raise ValueError("no documents to compare")
    agg = aggregate or (lambda x: float(np.mean(x, axis=0)))
    observed = agg(b) - agg(a)
    rng = np.random.default_rng(seed)
    diffs = np.empty(iters)
    if aggregate is None and a.ndim == 1:  # the common case, vectorised in blocks
        d = b - a
        done = 0
        block = max(1, min(iters, 2_000_000 // max(1, n)))
        while done < iters:
            m = min(block, iters - done)
            idx = rng.integers(0, n, size=(m, n))
            diffs[done:done + m] = d[idx].mean(axis=1)
            done += m
    else:
        for i in range(iters):
            idx = rng.integers(0, n, size=n)
            diffs[i] = agg(b[idx]) - agg(a[idx])
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(diffs, [alpha, 1.0 - alpha])
    if observed == 0.0 and np.all(diffs == 0.0):
        p = 1.0
    else:  # two-sided, from how much of the bootstrap distribution lies beyond 0: the interval's own test
        p = 2.0 * (min(int(np.sum(diffs <= 0.0)), int(np.sum(diffs >= 0.0))) + 1.0) / (iters + 1.0)
    return Bootstrap(float(observed), float(lo), float(hi), min(1.0, p), iters, confidence)


# ------------------------------------------------------------------------------------------- lm-eval aggregates


def _weighted_perplexity(x: np.ndarray) -> float:
    return float(math.exp(-np.sum(x[:, 0]) / np.sum(x[:, 1])))


def _bits_per_byte(x: np.ndarray) -> float:
    return float(-np.sum(x[:, 0]) / np.sum(x[:, 1]) / math.log(2))


def _perplexity(x: np.ndarray) -> float:
    return float(math.exp(-np.mean(x)))


AGGREGATES: dict[str, Callable[[np.ndarray], float]] = {
    "mean": lambda x: float(np.mean(x)),
    "weighted_perplexity": _weighted_perplexity,
    "bits_per_byte": _bits_per_byte,
    "perplexity": _perplexity,
}
"""lm-eval's aggregation names (``lm_eval.api.metrics``) re-expressed on arrays: per-document values of a
``weighted_perplexity``/``bits_per_byte`` metric are ``(loglikelihood, words or bytes)`` pairs."""


def is_binary(x: ArrayLike) -> bool:
    x = np.asarray(x, dtype=float)
    return x.ndim == 1 and bool(np.all((x == 0.0) | (x == 1.0)))


def significance_sentence(metric: str, diff: float, p: float, higher_is_better: bool | None, level: float = 0.05,
                          ci: tuple[float, float] | None = None, confidence: float = 0.95) -> str:
    """"B is better than A ..." in words, with the confidence the test gives."""
    if diff == 0.0:
        return f"{metric}: no difference"
    ci_text = f", {confidence:.0%} CI [{ci[0]:+.4g}, {ci[1]:+.4g}]" if ci else ""
    if higher_is_better is None:
        better = f"B is {'higher' if diff > 0 else 'lower'} than A"
    else:
        better = "B is better than A" if (diff > 0) == higher_is_better else "B is worse than A"
    if p < level:
        return f"{metric}: {better} by {diff:+.4g} (p = {p:.3g}{ci_text}: significant at {level:g})"
    return f"{metric}: {better} by {diff:+.4g}, but not significantly (p = {p:.3g}{ci_text})"
