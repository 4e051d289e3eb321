"""The intervals of the evaluation against independent computations (scipy, scikit-learn, a brute force)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sp
from sklearn.metrics import roc_auc_score

from leakbench.evaluation.verdicts.stats import (MIN_N, auc_interval, binomial, bootstrap_mean, measurable_fpr,
                                                 paired, paired_bootstrap, paired_t, t_mean)


def test_bootstrap_mean_covers_the_mean_and_narrows_with_n():
    rng = np.random.default_rng(3)
    small = bootstrap_mean(rng.normal(1.0, 0.5, 8))
    large = bootstrap_mean(rng.normal(1.0, 0.5, 400))
    assert small.low < small.mean < small.high and large.low < large.mean < large.high
    assert large.high - large.low < (small.high - small.low) / 3
    # the percentile interval of the mean ≈ mean ± 1.96 s/√n for a large normal sample
    v = rng.normal(0.0, 1.0, 400)
    ci = bootstrap_mean(v)
    half = 1.96 * v.std(ddof=1) / math.sqrt(v.size)
    assert math.isclose(ci.high - ci.mean, half, rel_tol=0.15) and math.isclose(ci.mean - ci.low, half, rel_tol=0.15)


def test_bootstrap_coverage_is_near_nominal():
    rng = np.random.default_rng(0)
    covered = 0
    for i in range(200):
        ci = bootstrap_mean(rng.normal(0.0, 1.0, 20), resamples=1000, seed=i)
        covered += ci.low <= 0.0 <= ci.high
    assert 0.88 <= covered / 200 <= 0.99


def test_constant_values_and_small_n():
    ci = bootstrap_mean([0.3, 0.3, 0.3])
    assert (ci.mean, ci.low, ci.high, ci.n) == (0.3, 0.3, 0.3, 3) and not ci.above(0.3) and not ci.below(0.3)
    one = bootstrap_mean([0.5, float("nan")])
    assert one.n == 1 and not one.known and not one.above(0.0)
    assert bootstrap_mean([]).n == 0
    # below MIN_N units nothing is decided, however far from zero
    assert not bootstrap_mean([5.0, 5.1][: MIN_N - 1]).above(0.0)


def test_t_interval_matches_scipy():
    v = [0.31, 0.28, 0.40, 0.35]
    ci = t_mean(v)
    low, high = sp.t.interval(0.95, len(v) - 1, loc=np.mean(v), scale=sp.sem(v))
    assert math.isclose(ci.low, low) and math.isclose(ci.high, high) and ci.method == "t"


def test_paired_intervals_use_shared_units_only():
    a = {(0, 0): 0.5, (0, 1): 0.6, (1, 0): 0.7, (9, 9): 0.1}
    b = {(0, 0): 0.4, (0, 1): 0.4, (1, 0): 0.6, (1, 1): 5.0}
    assert paired(a, b) == pytest.approx({(0, 0): 0.1, (0, 1): 0.2, (1, 0): 0.1})
    t = paired_t(a, b)
    assert t.n == 3 and math.isclose(t.mean, 0.4 / 3)
    low, high = sp.t.interval(0.95, 2, loc=0.4 / 3, scale=sp.sem([0.1, 0.2, 0.1]))
    assert math.isclose(t.low, low) and math.isclose(t.high, high)
    assert paired_bootstrap(a, b).n == 3


def test_binomial_is_clopper_pearson():
    ci = binomial(10, 20)
    ref = sp.binomtest(10, 20).proportion_ci(method="exact")
    assert (ci.mean, ci.low, ci.high) == (0.5, ref.low, ref.high)
    # the textbook value: 0 of 10 → upper 1 − 0.025^(1/10)
    assert math.isclose(binomial(0, 10).high, 1 - 0.025 ** 0.1)


def test_auc_interval_agrees_with_scikit_learn():
    rng = np.random.default_rng(1)
    scores = np.r_[rng.normal(1, 1, 60), rng.normal(0, 1, 80)]
    members = np.r_[np.ones(60, bool), np.zeros(80, bool)]
    scores[:5] = scores[-5:]  # ties count one half
    ci = auc_interval(scores, members)
    assert math.isclose(ci.mean, roc_auc_score(members, scores))
    assert ci.low < ci.mean < ci.high and ci.n == 140
    with pytest.raises(ValueError, match="both present"):
        auc_interval([0.1, 0.2], [True, True])


def test_fpr_floor_needs_ten_over_fpr_nonmembers():
    assert measurable_fpr(0.01, 1000) and not measurable_fpr(0.01, 999)
    assert not measurable_fpr(0.001, 20) and measurable_fpr(0.001, 10_000)
