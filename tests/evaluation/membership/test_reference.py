"""Reference-model membership on a strongly private target: DP-SGD with ε ≤ 1 leaves TPR at 1 % FPR at chance."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom, fisher_exact

import leakbench as lb
from leakbench.evaluation.membership.reference import (Recipe, run_membership_attacks, target_on_half,
                                                       train_reference_models)
from leakbench.evaluation.verdicts.stats import auc_interval

pytestmark = pytest.mark.usefixtures("one_thread")


def test_strong_dpsgd_leaves_tpr_at_one_percent_fpr_within_the_interval_of_chance():
    """1 200 members and 1 200 non-members (1 % FPR measurable: ≥ 1 000), DP-SGD C = 1, σ = 4: Opacus ε ≈ 0.68.

    Chance: an attack that knows nothing has TPR = FPR, so at 1 % FPR the members above the threshold are
    Binomial(1 200, 0.01): the measured count must not exceed that interval's upper end (Bonferroni over the three
    attacks; a count below it is no leakage).  The threshold is set on the same 1 200 non-members, so TPR is also
    compared with the non-members' own rate at that threshold (Fisher's exact test)."""
    pool = lb.load("sphere", n=2400, d=32)
    recipe = Recipe("mlp:64", model_options={"act": "relu"}, defense="dpsgd:1,4", epochs=4, batch_size=120,
                    lr=0.5)
    target, members, run = target_on_half(recipe, pool, seed=0)
    assert run.epsilon is not None and run.epsilon <= 1.0, run.epsilon
    refs = train_reference_models(recipe, pool, count=2, seed=0, cache_dir=False)
    scores = run_membership_attacks(target, pool, refs, {"loss": ("membership-loss", {}),
                                                         "lira": ("membership-lira", {"online": False}),
                                                         "rmia": ("membership-rmia", {})})
    m = members.numpy()
    level = 1 - 0.05 / len(scores)
    for name, s in scores.items():
        neg = np.sort(s[~m])[::-1]
        assert neg.size >= 1000
        cut = neg[int(0.01 * neg.size)]  # at most 1 % of the non-members lie above it
        k_in, k_out = int((s[m] > cut).sum()), int((s[~m] > cut).sum())
        assert k_out <= 0.01 * neg.size
        assert fisher_exact([[k_in, m.sum() - k_in], [k_out, neg.size - k_out]])[1] > 1 - level, (name, k_in, k_out)
        _, high = binom.interval(level, int(m.sum()), 0.01)  # what chance reaches at 1 % FPR with these members
        assert k_in <= high, (name, k_in, high)
        # and no attack beats what ε-DP allows any test: AUC ≤ e^ε / (1 + e^ε)
        assert auc_interval(s, m).mean <= 1 / (1 + math.exp(-run.epsilon)), name
