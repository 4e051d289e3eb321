"""Membership inference against the margin (provable-attacks paper, Sec. 4) in its high-dimensional setting."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks.membership import MEMBERSHIP_ATTACKS, membership_margin
from leakbench.errors import ConfigError, UnsupportedThreatModel
from leakbench.metrics.membership import membership_scores
from leakbench.models.targets import train_target
from leakbench.threat import observe_weights


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setting():
    # Sec. 5 / Thm. 4.2: n = 20 uniform on the sphere of radius √d, d = 200, width 1000, hidden
    # bias, no output bias (homogeneous), small initialisation, labels independent of x
    d = 200
    train = lb.load("sphere", n=20, d=d, rule="random", seed=0)
    test = lb.load("sphere", n=500, d=d, rule="random", seed=1)
    target = train_target(train, model="twolayer:1000", loss="logistic", lr=0.5, steps=800, loss_tol=0,
                          center=False, init="small")
    x = torch.cat([train.images, test.images]).double()
    labels = torch.cat([train.labels, test.labels])
    members = torch.cat([torch.ones(20), torch.zeros(500)]).bool()
    return target, x, labels, members


def test_high_dimension_auc_and_theory_threshold(setting):
    target, x, labels, members = setting
    margin = float(target.margins().min())
    obs = observe_weights(target, margin=margin)
    signed = membership_margin(obs, x, labels=labels)
    unsigned = membership_margin(obs, x)
    s = membership_scores(signed.scores, members, threshold=signed.threshold)
    assert s.auc >= 0.95 and membership_scores(unsigned.scores, members).auc >= 0.95
    assert s.tpr == 1.0  # every training point reaches the margin by definition of γ
    assert s.accuracy >= 0.95 and s.tpr_at_1 >= 0.5


def test_margin_modes(setting):
    target, x, labels, members = setting
    margin = float(target.margins().min())
    obs = observe_weights(target)
    known = membership_margin(obs, x, labels=labels, margin_value=margin)
    # Cor. 4.4: a set of 5 points holding one member leaks the margin as its largest score
    leaked = membership_margin(obs, x, labels=labels, margin="leaked", leaked=x[[0, 30, 31, 32, 33]],
                               leaked_labels=labels[[0, 30, 31, 32, 33]])
    assert leaked.margin >= known.margin - 1e-12
    assert leaked.margin == pytest.approx(float(known.scores[0]))
    # Cor. 4.5: only a lower bound on the margin
    bounded = membership_margin(obs, x, labels=labels, margin="bounded", bounds=(0.5 * margin, 2 * margin))
    assert bounded.threshold == pytest.approx(0.5 * margin)
    assert membership_scores(bounded.scores, members, threshold=bounded.threshold).tpr == 1.0
    assert "membership-margin" in MEMBERSHIP_ATTACKS


def test_requirements_and_bad_options(setting):
    target, x, labels, _ = setting
    obs = observe_weights(target)
    with pytest.raises(UnsupportedThreatModel, match="margin_value"):
        membership_margin(obs, x)
    grad = lb.observe(target.model, target.inputs, target.y, loss="logistic")
    with pytest.raises(UnsupportedThreatModel, match="'gradient' observation"):
        membership_margin(grad, x, margin_value=1.0)
    with pytest.raises(ConfigError, match="bounds"):
        membership_margin(obs, x, margin="bounded")
    with pytest.raises(ConfigError, match="margin one of"):
        membership_margin(obs, x, margin="guess")
    with pytest.raises(ConfigError, match="shape"):
        membership_margin(obs, x[:, :10], margin_value=1.0)
