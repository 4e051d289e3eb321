"""Membership metrics: AUC, TPR at low FPR, accuracy at a threshold, against hand-computed values."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from leakbench.errors import ConfigError
from leakbench.metrics.membership import accuracy_at, membership_scores, roc_auc, tpr_at_fpr


def test_perfect_and_reversed_separation():
    scores = torch.tensor([5.0, 4.0, 1.0, 0.5, 0.2])
    members = torch.tensor([True, True, False, False, False])
    assert roc_auc(scores, members) == 1.0
    assert roc_auc(-scores, members) == 0.0
    assert tpr_at_fpr(scores, members, 0.0) == 1.0


def test_auc_counts_ordered_pairs():
    rng = np.random.default_rng(0)
    s, m = rng.normal(size=60), rng.random(60) < 0.4
    pairs = (s[m][:, None] > s[~m][None, :]).mean()
    assert roc_auc(s, m) == pytest.approx(pairs)


def test_tpr_at_fpr_by_hand():
    # members 0.9, 0.6, 0.3; non-members 0.8, 0.2, 0.1, 0.05 (FPR steps of 1/4)
    s = np.array([0.9, 0.6, 0.3, 0.8, 0.2, 0.1, 0.05])
    m = np.array([1, 1, 1, 0, 0, 0, 0], dtype=bool)
    assert tpr_at_fpr(s, m, 0.0) == pytest.approx(1 / 3)  # threshold above 0.8
    assert tpr_at_fpr(s, m, 0.25) == pytest.approx(1.0)  # threshold 0.3 admits only 0.8
    assert accuracy_at(s, m, 0.5) == pytest.approx(5 / 7)
    out = membership_scores(s, m, threshold=0.5)
    assert out.tpr == pytest.approx(2 / 3) and out.fpr == pytest.approx(1 / 4)


def test_bad_input():
    with pytest.raises(ConfigError, match="both members and non-members"):
        roc_auc([1.0, 2.0], [True, True])
    with pytest.raises(ConfigError, match="one membership flag per score"):
        roc_auc([1.0, 2.0, 3.0], [True, False])
    with pytest.raises(ConfigError, match="fpr"):
        tpr_at_fpr([1.0, 2.0], [True, False], 2.0)
