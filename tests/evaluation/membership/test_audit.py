"""DP-SGD audited empirically (Jagielski et al. 2020): the ε lower bound from a membership test's counts."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

import leakbench as lb
from leakbench.attacks.membership.reference import loss_scores, target_confidence
from leakbench.defenses import DPSGD
from leakbench.defenses.client import dp_gradient
from leakbench.errors import ConfigError
from leakbench.evaluation.membership.audit import audit_scores, epsilon_lower_bound
from leakbench.evaluation.training.utility import train_model

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


# ----------------------------------------------------------------------------- one training run (Steinke et al.)


def test_one_run_bound_without_delta_is_the_logit_of_the_one_sided_clopper_pearson_bound():
    from leakbench.evaluation.membership.audit import one_run_epsilon, one_run_p_value

    for r, v in ((40, 40), (80, 70), (100, 60), (30, 14)):
        assert math.isclose(one_run_p_value(200, r, v, 1.0), stats.binom.sf(v - 1, r, 1 / (1 + math.exp(-1.0))))
        low = stats.beta.ppf(0.05, v, r - v + 1)  # one-sided 95 % lower bound on the accuracy
        want = max(0.0, math.log(low / (1 - low)))
        assert math.isclose(one_run_epsilon(200, r, v, confidence=0.95), want, abs_tol=1e-6), (r, v)
    # δ only weakens the test: a larger p-value and a smaller bound
    assert one_run_p_value(200, 80, 70, 1.0, 1e-3) > one_run_p_value(200, 80, 70, 1.0, 0.0)
    assert one_run_epsilon(200, 80, 70, delta=1e-3) < one_run_epsilon(200, 80, 70)
    assert one_run_epsilon(200, 80, 40) == 0.0  # chance accuracy proves nothing
    with pytest.raises(ConfigError, match="correct ≤ guesses ≤ canaries"):
        one_run_p_value(10, 20, 5, 1.0)


def _one_run(defense, m: int = 200, seed: int = 0):
    """One run: 200 digits plus each of ``m`` random-label noise canaries with probability ½."""
    from leakbench.evaluation.membership.audit import include_canaries, one_run_audit

    data = lb.load("digits")
    base = data.subset(torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:200])
    images = torch.rand((m, *data.shape), generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 10, (m,), generator=torch.Generator().manual_seed(6))
    included = torch.from_numpy(include_canaries(m, seed=seed))
    train = replace(base, images=torch.cat([base.images, images[included]]),
                    labels=torch.cat([base.labels, labels[included]]))
    model = lb.build("mlp:128", input_shape=train.shape, classes=10, seed=0)
    run = train_model(model, train, defense=defense, epochs=40, batch_size=20, lr=2.0, seed=0)
    scores = loss_scores(target_confidence(model, images, labels))
    return one_run_audit(scores, included, delta=1e-5, claimed=run.epsilon)


def test_one_run_audit_never_exceeds_a_correct_dpsgd_and_catches_a_noiseless_one():
    honest = _one_run(DPSGD(1.0, 10.0, delta=1e-5))
    assert honest.claimed < 1 and honest.epsilon <= honest.claimed and not honest.violated, honest.text()
    broken = _one_run(SilentlyNoiseless(1.0, 10.0, delta=1e-5))
    assert broken.claimed < 1 and broken.violated, broken.text()
