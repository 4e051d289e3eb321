"""ats-adaptive: the preimage search finds the signs, the objective is zero at the original, and it wins."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks.gradient.adaptive_ats import TransformedMatcher, hybrid_preimages, preimages, sign_combinations
from leakbench.attacks.solvers.gradient_matching import GradientMatcher
from leakbench.attacks.solvers.matching_settings import MatchingSettings
from leakbench.defenses import parse
from leakbench.defenses.ats import draw_hybrid, draw_signs, hybrid_transform, parse_policy, transform
from leakbench.errors import UnsupportedThreatModel


@pytest.fixture(scope="module")
def digits():
    data = lb.load("digits")
    model = lb.build("cnn:3-8-1-1,3-8-2-1", input_shape=data.shape, classes=10, act="tanh", seed=0)
    return data, model


def test_sign_combinations_are_all_vectors():
    s = sign_combinations(3)
    assert s.shape == (8, 3) and len({tuple(r) for r in s.tolist()}) == 8


def test_the_preimage_search_finds_the_signs_of_a_known_transform(digits):
    data, _ = digits
    x, _ = data.batch(3, seed=1)
    indices = parse_policy("43-18-18")
    signs = draw_signs(3, indices, torch.Generator().manual_seed(2))
    found, chosen, values = preimages(transform(x, indices, signs), indices, steps=300, lr=0.05, tv=0.01)
    assert values.shape == (3, 8)
    assert torch.equal(chosen[:, 0], signs[:, 0])  # the translation's direction
    assert float((transform(found, indices, chosen) - transform(x, indices, signs)).abs().mean()) < 0.05


def test_the_preimage_search_finds_each_images_policy_in_a_hybrid(digits):
    """Digits transformed by a hybrid of a 45 % horizontal and a 15 % vertical shift: the fit tells them apart."""
    data, _ = digits
    x, _ = data.batch(8, seed=4)
    policies = parse("ats:3-1-7/43-18-18").policies
    choice, signs = draw_hybrid(8, policies, torch.Generator().manual_seed(5))
    encoded = hybrid_transform(x, policies, choice, signs)
    found, chosen, chosen_signs, values = hybrid_preimages(encoded, policies, steps=300, lr=0.05, tv=0.01)
    assert values.shape == (8, 8 + 8)                       # 2^3 sign triples of each policy
    assert (chosen == choice).float().mean() >= 0.75
    refit = hybrid_transform(found, policies, chosen, chosen_signs)
    assert float((refit - encoded).abs().mean()) < 0.05


def test_the_original_minimises_the_adaptive_objective_under_a_hybrid(digits):
    data, model = digits
    x, y = data.batch(4, seed=3)
    obs = lb.observe(model, x, y, labels_known=True, defense="ats:3-1-7/43-18-18", seed=0)
    policies = parse("ats:3-1-7/43-18-18").policies
    choice, signs = draw_hybrid(4, policies, torch.Generator().manual_seed(0))   # observe's draw from its seed
    settings = MatchingSettings(features=0.0, factorise="off")
    matcher = TransformedMatcher(obs, settings, policies[0], signs, policies=policies, choice=choice)
    with torch.enable_grad():
        assert float(matcher.objective(x, y)[1].detach()) < 1e-6
    rec = lb.attack("ats-adaptive", obs, preset="quick", iterations=20, invert_steps=20)
    assert rec.images.shape == x.shape and len(rec.trace["policies"]) == 4


def test_the_original_minimises_the_adaptive_objective_only(digits):
    data, model = digits
    x, y = data.batch(2, seed=3)
    obs = lb.observe(model, x, y, labels_known=True, defense="ats:3-1-7", seed=0)
    indices = parse_policy("3-1-7")
    signs = draw_signs(2, indices, torch.Generator().manual_seed(0))  # observe's first draw from its seed
    settings = MatchingSettings(features=0.0, factorise="off")
    with torch.enable_grad():
        adaptive = float(TransformedMatcher(obs, settings, indices, signs).objective(x, y)[1].detach())
        plain = float(GradientMatcher(obs, settings).objective(x, y)[1].detach())
    assert adaptive < 1e-6 < 1e-2 < plain


def test_it_refuses_a_vector_model_and_another_defense(digits):
    data, model = digits
    obs = lb.observe(model, *data.batch(2, seed=0), defense="topk:0.1", seed=0)
    with pytest.raises(UnsupportedThreatModel, match="ats"):
        lb.attack("ats-adaptive", obs, preset="quick", iterations=2)


@pytest.mark.slow  # two matching attacks: `make test-slow`
def test_ats_adaptive_beats_the_non_adaptive_attack(digits):
    data, model = digits
    x, y = data.batch(1, seed=5)
    obs = lb.observe(model, x, y, labels_known=True, defense="ats:3-1-7", seed=1)
    adaptive = lb.attack("ats-adaptive", obs, preset="fast", iterations=60, seed=0)
    plain = lb.attack("inverting-gradients", obs, preset="fast", iterations=60, features=0.0, seed=0)
    a, p = (float(lb.compare(r, x, y)["psnr"]) for r in (adaptive, plain))
    assert a > p + 2
