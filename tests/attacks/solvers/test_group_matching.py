"""GradInversion's group consistency (Yin et al. 2021): joint runs pulled to their consensus, the best candidate kept."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError


@pytest.fixture(scope="module")
def obs_and_x():
    digits = lb.load("digits", size=8)
    model = lb.build("cnn:4-3-1-1", input_shape=digits.shape, classes=10, act="sigmoid", seed=0)
    x, y = digits.batch(indices=[1000, 1001])
    return lb.observe(model, x, y, labels_known=True), x


def _spread(rec):
    return rec.trace["group_spread"][-1]


def test_the_pull_narrows_the_groups_and_the_best_candidate_is_kept(obs_and_x):
    obs, _ = obs_and_x
    weak = lb.attack("inverting-gradients", obs, preset="quick", restarts=2, group=1e-6, iterations=40, seed=0)
    strong = lb.attack("inverting-gradients", obs, preset="quick", restarts=2, group=10.0, iterations=40, seed=0)
    assert _spread(strong) < 0.5 * _spread(weak)
    for rec in (weak, strong):
        candidates = [*rec.trace["restart_losses"], rec.trace["consensus_match"]]
        assert rec.trace["final_match"] == min(candidates)
        chosen = rec.trace["chosen"]
        assert chosen == ("consensus" if min(candidates) == candidates[-1]
                          else f"group {candidates.index(min(candidates)) + 1}")
        assert rec.trace["groups"] == 2


def test_progress_callback_and_seed(obs_and_x):
    obs, _ = obs_and_x
    seen, shots = [], []
    runs = [lb.attack("gradinversion", obs, preset="quick", iterations=15, seed=5,
                      progress=lambda d, t, v: seen.append((d, t)), callback=lambda s, x: shots.append(s))
            for _ in range(2)]
    assert torch.equal(runs[0].images, runs[1].images)
    assert seen[-1] == (15, 15) and shots and runs[0].trace["bn_prior"].startswith("off")


def test_bn_prior_used_when_granted():
    digits = lb.load("digits", size=16)
    model = lb.build("convnet-4", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits.batch(indices=[1000, 1001])
    obs = lb.observe(model, x, y, labels_known=True, train=True, bn_stats=True)
    rec = lb.attack("gradinversion", obs, preset="quick", iterations=3)
    assert rec.trace["bn_prior"] == 0.01 and rec.images.shape == x.shape


@pytest.mark.parametrize("options, message", [
    ({"group": 0.1, "restarts": 1}, "restarts ≥ 2"), ({"group": -1.0}, "group ≥ 0"),
    ({"group": 0.1, "restarts": 2, "optimizer": "lbfgs"}, "adam or sgd"), ({"group_every": 0}, "group_every"),
    ({"group_from": 1.0}, "group_from"),
])
def test_bad_options_fail_with_one_line(obs_and_x, options, message):
    obs, _ = obs_and_x
    with pytest.raises(ConfigError, match=message):
        lb.attack("inverting-gradients", obs, preset="quick", **options)


def test_registered_mean_aligns_images_of_one_label_only():
    from leakbench.attacks.solvers.group_matching import registered_mean

    gen = torch.Generator().manual_seed(0)
    a = torch.rand(4, 1, 3, 3, generator=gen)
    labels = torch.tensor([2, 5, 2, 7])
    swapped = a[[2, 1, 0, 3]]                       # the two images of label 2 trade slots
    assert torch.equal(registered_mean([a, swapped], labels), a)
    assert torch.equal(registered_mean([swapped, a], labels, reference=1), a)
    crossed = a[[0, 3, 2, 1]]                       # labels 5 and 7 differ: their slots are never exchanged
    assert torch.allclose(registered_mean([a, crossed], labels), (a + crossed) / 2)
