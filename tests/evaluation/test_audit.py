"""DP-SGD audited empirically (Jagielski et al. 2020): the ε lower bound from a membership test's counts."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

import leakbench as lb
from leakbench.attacks.trained.reference import loss_scores, target_confidence
from leakbench.defenses import DPSGD
from leakbench.defenses.client import dp_gradient
from leakbench.errors import ConfigError
from leakbench.evaluation.audit import audit_scores, epsilon_lower_bound
from leakbench.evaluation.utility import train_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bound_from_clopper_pearson_counts():
    eps, tpr, fpr = epsilon_lower_bound(900, 1000, 10, 1000, delta=1e-5)
    tpr_low = stats.binomtest(900, 1000).proportion_ci(0.95, method="exact").low
    fpr_high = stats.binomtest(10, 1000).proportion_ci(0.95, method="exact").high
    assert eps == pytest.approx(math.log((tpr_low - 1e-5) / fpr_high))
    assert tpr.low == pytest.approx(tpr_low) and fpr.high == pytest.approx(fpr_high)
    # the complementary region: few false negatives bound ε as well
    eps2, _, _ = epsilon_lower_bound(995, 1000, 500, 1000)
    fnr_high = stats.binomtest(5, 1000).proportion_ci(0.95, method="exact").high
    tnr_low = stats.binomtest(500, 1000).proportion_ci(0.95, method="exact").low
    assert eps2 == pytest.approx(math.log(tnr_low / fnr_high))
    assert epsilon_lower_bound(50, 100, 50, 100)[0] == 0.0  # chance shows nothing
    with pytest.raises(ConfigError):
        epsilon_lower_bound(1, 0, 1, 10)


def test_audit_scores_chooses_its_threshold_on_held_out_points():
    g = np.random.default_rng(0)
    members = np.r_[np.ones(400, bool), np.zeros(400, bool)]
    scores = np.where(members, g.normal(3, 1, 800), g.normal(0, 1, 800))
    audit = audit_scores(scores, members, claimed=0.5)
    assert audit.members == 200 and audit.nonmembers == 200  # counted on the other half
    assert audit.epsilon > 0.5 and audit.violated and "VIOLATED" in audit.text()
    null = audit_scores(g.normal(size=800), members, claimed=0.5)
    assert null.epsilon < 0.5 and not null.violated


class SilentlyNoiseless(DPSGD):
    """A broken DP-SGD: clips, adds no noise, and its accountant is still told σ."""

    def gradient(self, model, params, x, y, loss_fn, generator):
        return dp_gradient(model, params, x, y, loss_fn, max_norm=self.C, noise_multiplier=0.0, generator=generator)


@pytest.fixture(scope="module")
def canaries():
    """200 digits plus 100 of 200 noise canaries with random labels (the other 100 never trained on)."""
    data = lb.load("digits")
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    base = data.subset(perm[:200])
    g = torch.Generator().manual_seed(1)
    images = torch.rand((200, *data.shape), generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 10, (200,), generator=g)
    member = torch.zeros(200, dtype=torch.bool)
    member[torch.randperm(200, generator=g)[:100]] = True
    train = replace(base, images=torch.cat([base.images, images[member]]),
                    labels=torch.cat([base.labels, labels[member]]))
    return train, images, labels, member


def _audit(canaries, defense):
    train, images, labels, member = canaries
    model = lb.build("mlp:128", input_shape=train.shape, classes=10, seed=0)
    run = train_model(model, train, defense=defense, epochs=40, batch_size=20, lr=2.0, seed=0)
    scores = loss_scores(target_confidence(model, images, labels))
    return audit_scores(scores, member, delta=1e-5, claimed=run.epsilon)


def test_correct_dpsgd_stays_below_its_accountant(canaries):
    audit = _audit(canaries, DPSGD(1.0, 10.0, delta=1e-5))
    assert audit.claimed < 1 and audit.epsilon <= audit.claimed and not audit.violated


def test_noiseless_dpsgd_is_caught(canaries):
    audit = _audit(canaries, SilentlyNoiseless(1.0, 10.0, delta=1e-5))
    assert audit.claimed < 1 and audit.violated, audit.text()
