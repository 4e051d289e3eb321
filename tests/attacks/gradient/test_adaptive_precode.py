"""precode-adaptive: the bottleneck's input read off exactly, an objective that is zero at the truth, and a win."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks.gradient.adaptive_precode import BottleneckMatcher, bottleneck_input
from leakbench.attacks.solvers.gradient_matching import GradientMatcher
from leakbench.attacks.solvers.matching_settings import MatchingSettings
from leakbench.errors import ConfigError, UnsupportedThreatModel


@pytest.fixture(scope="module")
def digits():
    data = lb.load("digits")
    model = lb.build("cnn:3-8-1-1,3-8-2-1", input_shape=data.shape, classes=10, act="tanh", seed=0)
    return data, model


def _features(obs, x):
    seen = []
    hook = obs.model.fc.bottleneck.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach()))
    obs.model(x)
    hook.remove()
    return seen[0]


def test_the_bottleneck_input_is_read_off_exactly_at_batch_one(digits):
    data, model = digits
    x, y = data.batch(1, seed=2)
    obs = lb.observe(model, x, y, defense="precode:16", seed=0)
    h = _features(obs, x)
    assert float((bottleneck_input(obs) - h).norm() / h.norm()) < 1e-5
    two = lb.observe(model, *data.batch(2, seed=2), defense="precode:16", seed=0)
    with pytest.raises(ConfigError, match="batch size 1"):
        bottleneck_input(two)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_truth_minimises_the_adaptive_objective_for_any_eps(digits, batch):
    data, model = digits
    x, y = data.batch(batch, seed=4)
    settings = MatchingSettings(features=0.0, factorise="off")
    for seed in (0, 1):  # two ε draws
        obs = lb.observe(model, x, y, defense="precode:16", seed=seed)
        with torch.enable_grad():
            truth = float(BottleneckMatcher(obs, settings).objective(x, y)[1].detach())
            other = float(BottleneckMatcher(obs, settings).objective(torch.rand_like(x), y)[1].detach())
            plain = float(GradientMatcher(obs, settings).objective(x, y)[1].detach())
        assert truth < 1e-5 < 1e-2 < min(other, plain)


def test_it_refuses_another_defense_and_a_batch_beyond_the_feature_width(digits):
    data, model = digits
    obs = lb.observe(model, *data.batch(2, seed=0), defense="mixup:1", seed=0)
    with pytest.raises(UnsupportedThreatModel, match="precode"):
        lb.attack("precode-adaptive", obs, preset="quick", iterations=2)
    mlp = lb.build("mlp:4", input_shape=data.shape, classes=10, seed=0)
    wide = lb.observe(mlp, *data.batch(6, seed=0), defense="precode:8", seed=0)
    with pytest.raises(UnsupportedThreatModel, match="at most 5"):
        lb.attack("precode-adaptive", wide, preset="quick", iterations=2)


def test_precode_adaptive_beats_the_non_adaptive_attack(digits):
    data, model = digits
    x, y = data.batch(1, seed=5)
    obs = lb.observe(model, x, y, labels_known=True, defense="precode:16", seed=0)
    adaptive = lb.attack("precode-adaptive", obs, preset="fast", iterations=60, seed=0)
    plain = lb.attack("inverting-gradients", obs, preset="fast", iterations=60, features=0.0, seed=0)
    a, p = (float(lb.compare(r, x, y)["psnr"]) for r in (adaptive, plain))
    assert a > 25 > p + 10 and adaptive.trace["feature_error"] < 0.05
