"""mpitp.results.stats: McNemar and the paired bootstrap against textbook values (pure maths, no MPI)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from mpitp.results import stats


def test_exact_mcnemar_hand_computed():
    # 1 vs 9 discordant pairs: P(X <= 1 | n=10, p=1/2) = (C(10,0) + C(10,1)) / 2^10 = 11/1024; two-sided 22/1024.
    r = stats.mcnemar_counts(1, 9)
    assert r.method == "exact binomial" and r.statistic is None
    assert r.p_value == float(Fraction(22, 1024))
    assert stats.mcnemar_counts(9, 1).p_value == r.p_value  # symmetric
    assert stats.mcnemar_counts(5, 5).p_value == 1.0
    assert stats.mcnemar_counts(0, 0).p_value == 1.0
    # 0 vs 6: 2 / 64, the smallest n where one-sided all-or-nothing reaches p < 0.05 two-sided
    assert stats.mcnemar_counts(0, 6).p_value == 2 / 64


def test_chi_square_tail_at_textbook_critical_values():
    # chi-square (1 df) critical values from any statistics table
    assert stats.chi2_sf_1df(3.841458820694124) == pytest.approx(0.05, abs=1e-12)
    assert stats.chi2_sf_1df(6.634896601021214) == pytest.approx(0.01, abs=1e-12)
    assert stats.chi2_sf_1df(10.827566170662733) == pytest.approx(0.001, abs=1e-12)
    assert stats.chi2_sf_1df(0.0) == 1.0


def test_mcnemar_chi_square_wikipedia_example():
    # Wikipedia "McNemar's test" example: b = 121, c = 59 discordant pairs. With Edwards' continuity correction
    # the statistic is (|121 - 59| - 1)^2 / 180 = 3721 / 180 = 20.672, p = 5.45e-6 (chi-square, 1 df).
    r = stats.mcnemar_counts(121, 59)
    assert r.method == "chi-square, continuity-corrected"
    assert r.statistic == pytest.approx(3721 / 180, rel=1e-12)
    assert r.p_value == pytest.approx(5.4514e-6, rel=1e-3)


def test_mcnemar_from_outcomes_and_threshold():
    a = [1] * 30 + [0] * 20 + [1] * 5 + [0] * 3  # 5 docs A only, 3 docs B only
    b = [1] * 30 + [0] * 20 + [0] * 5 + [1] * 3
    r = stats.mcnemar(a, b)
    assert (r.a_only, r.b_only) == (5, 3) and r.method == "exact binomial"
    assert r.p_value == pytest.approx(2 * (1 + 8 + 28 + 56) / 256)  # P(X <= 3 | 8) * 2 = 186/256
    below, at = stats.MCNEMAR_EXACT_BELOW - 1, stats.MCNEMAR_EXACT_BELOW
    assert stats.mcnemar_counts(below, 0).method == "exact binomial"
    assert stats.mcnemar_counts(at, 0).method.startswith("chi-square")


def test_against_scipy_when_available():
    sp = pytest.importorskip("scipy.stats")
    for k, n in [(0, 1), (2, 7), (3, 15), (10, 24), (12, 24)]:
        assert stats.binom_two_sided_half(k, n) == pytest.approx(sp.binomtest(k, n, 0.5).pvalue, rel=1e-12)
    for x in (0.1, 1.0, 4.2, 20.0):
        assert stats.chi2_sf_1df(x) == pytest.approx(sp.chi2.sf(x, 1), rel=1e-10)


def test_bootstrap_identical_runs():
    a = np.array([1.0, 0.0, 1.0, 1.0, 0.0])
    r = stats.paired_bootstrap(a, a.copy(), iters=500)
    assert r.diff == 0.0 and r.ci_low == 0.0 and r.ci_high == 0.0 and r.p_value == 1.0


def test_bootstrap_matches_normal_theory_on_large_sample():
    rng = np.random.default_rng(0)
    n = 4000
    a = (rng.random(n) < 0.60).astype(float)
    b = a.copy()
    flip = rng.random(n) < 0.10  # B differs on ~10% of documents, better on ~2/3 of those
    b[flip] = (rng.random(int(flip.sum())) < 2 / 3).astype(float)
    r = stats.paired_bootstrap(a, b, iters=4000, seed=1)
    d = b - a
    half = 1.959964 * d.std(ddof=0) / math.sqrt(n)
    assert r.diff == pytest.approx(d.mean())
    assert r.ci_low == pytest.approx(d.mean() - half, abs=0.15 * half)
    assert r.ci_high == pytest.approx(d.mean() + half, abs=0.15 * half)
    z = d.mean() / (d.std(ddof=0) / math.sqrt(n))
    assert r.p_value == pytest.approx(math.erfc(abs(z) / math.sqrt(2)), abs=0.02)  # the normal-theory p-value


def test_bootstrap_p_value_agrees_with_mcnemar_in_the_large_sample_limit():
    a = np.array([1] * 300 + [0] * 300 + [1] * 40 + [0] * 60, dtype=float)
    b = np.array([1] * 300 + [0] * 300 + [0] * 40 + [1] * 60, dtype=float)
    boot = stats.paired_bootstrap(a, b, iters=20000, seed=3)
    mc = stats.mcnemar(a, b)
    assert mc.method.startswith("chi-square") and mc.p_value == pytest.approx(0.0576, abs=2e-3)
    assert boot.p_value == pytest.approx(mc.p_value, abs=0.02)
    assert boot.ci_low <= 0 <= boot.ci_high  # not significant at 0.05: the 95% CI reaches zero


def test_aggregates_equal_lm_eval_functions():
    from lm_eval.api import metrics as m

    rng = np.random.default_rng(5)
    pairs = [(-float(rng.uniform(10, 200)), int(rng.integers(5, 80))) for _ in range(17)]
    x = np.asarray(pairs, dtype=float)
    assert stats.AGGREGATES["weighted_perplexity"](x) == pytest.approx(m.weighted_perplexity(pairs), rel=1e-12)
    assert stats.AGGREGATES["bits_per_byte"](x) == pytest.approx(m.bits_per_byte(pairs), rel=1e-12)
    lls = list(-rng.uniform(0, 3, size=9))
    assert stats.AGGREGATES["perplexity"](np.asarray(lls)) == pytest.approx(m.perplexity(lls), rel=1e-12)


def test_bootstrap_with_a_ratio_aggregate():
    rng = np.random.default_rng(2)
    a = np.column_stack([-rng.uniform(50, 100, 40), rng.integers(20, 40, 40)])
    b = a.copy()
    b[:, 0] *= 0.9  # B's log-likelihoods are 10% better on every document: lower bits per byte
    r = stats.paired_bootstrap(a, b, stats.AGGREGATES["bits_per_byte"], iters=500)
    assert r.diff < 0 and r.ci_high < 0 and r.p_value < 0.01
    s = stats.significance_sentence("bits_per_byte", r.diff, r.p_value, False, ci=(r.ci_low, r.ci_high))
    assert s.startswith("bits_per_byte: B is better than A by -") and "significant at 0.05" in s


def test_sentence_wording():
    assert "B is better than A by +0.02" in stats.significance_sentence("acc", 0.02, 0.001, True)
    assert "not significantly (p = 0.3" in stats.significance_sentence("acc", 0.02, 0.3, True)
    assert "B is worse than A" in stats.significance_sentence("acc", -0.02, 0.01, True)
    assert stats.significance_sentence("acc", 0.0, 1.0, True) == "acc: no difference"


def test_non_finite_per_document_scores_get_no_verdict():
    """A file whose per-document acc is NaN (results files are untrusted) read "B is worse than A by +nan (p = 0.0001,
    ...: significant at 0.05)" in ``inspect diff`` and the report: such a metric gets a note, not a test."""
    import numpy as np

    from mpitp.results.compare import compare_scores
    from mpitp.results.docscores import DocScores

    ids = np.arange(5)
    a = DocScores(ids, {"acc,none": np.array([1.0, 0, 1, 0, 1]), "acc_norm,none": np.array([1.0, 1, 0, 0, 1])})
    for bad in (np.nan, np.inf):
        b = DocScores(ids, {"acc,none": np.full(5, bad), "acc_norm,none": np.array([1.0, 1, 0, 0, 1])})
        for x, y in ((a, b), (b, a)):
            tc = compare_scores("t", x, y, iters=100)
            assert [m.key for m in tc.metrics] == ["acc_norm,none"]
            assert tc.note == "acc: per-document values are not all finite numbers"


def test_bootstrap_p_value_agrees_with_its_interval_on_a_skewed_aggregate():
    """Perplexity (exp of minus the mean log-likelihood) of a checkpoint worse on every one of 6 documents (a sweep's
    lambada_openai, step-2 then step-10): the 95% interval lay far above 0 and the recentred test said p = 0.38,
    "not significantly". The p-value is the interval's own test now: below 0.05 exactly when it excludes 0."""
    a = np.array([-11.70679873, -22.48308563, -34.60487986, -31.90104842, -13.51483327, -21.67016649])
    b = np.array([-42.23267937, -38.89848995, -73.05000973, -40.62003422, -45.17737627, -51.83385181])
    r = stats.paired_bootstrap(a, b, stats.AGGREGATES["perplexity"], iters=2000)
    assert r.diff > 0 and r.ci_low > 0
    assert r.p_value < 0.01
    s = stats.significance_sentence("perplexity", r.diff, r.p_value, False, ci=(r.ci_low, r.ci_high))
    assert s.startswith("perplexity: B is worse than A by +") and "significant at 0.05" in s
    rng = np.random.default_rng(7)
    for seed in range(20):  # noise with no difference and a clear one alike: interval and p-value agree
        x = rng.normal(size=30)
        y = x + rng.normal(loc=0.3 * (seed % 3), size=30)
        r = stats.paired_bootstrap(np.exp(x), np.exp(y), iters=2000, seed=seed)
        assert (r.p_value < 0.05) == (r.ci_low > 0 or r.ci_high < 0) or abs(r.p_value - 0.05) < 0.002, r
