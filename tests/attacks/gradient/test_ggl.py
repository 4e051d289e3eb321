"""GGL (Li et al. 2022): the KL prior, the defense transform T, the CMA-ES and Adam latent searches."""
from __future__ import annotations

import pytest
import torch
from torch.distributions import Normal, kl_divergence

import leakbench as lb
from leakbench.attacks import create
from leakbench.attacks.gradient.ggl import kl_prior, sparse_support
from leakbench.attacks.solvers.matching_settings import MatchingSettings
from leakbench.errors import ConfigError, UnsupportedThreatModel


def test_kl_prior_against_torch_distributions():
    z = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1.7 + 0.4
    mean, std = z.mean(-1), z.std(-1, unbiased=False)
    expected = kl_divergence(Normal(mean, std), Normal(torch.zeros_like(mean), torch.ones_like(std)))
    assert torch.allclose(kl_prior(z), expected, atol=1e-8)
    assert float(kl_prior(torch.randn(1, 4096, generator=torch.Generator().manual_seed(1))).abs()) < 1e-3


@pytest.mark.parametrize("defense, masked", [("prune:0.9", True), ("none", False), ("noise:0.01", False)])
def test_the_transform_follows_the_observation(digits, defense, masked):
    """Under pruning the original batch matches the masked simulated gradient exactly, and only with the mask."""
    model = lb.build("cnn:4-3-1-1", input_shape=digits.shape, classes=10, act="sigmoid", seed=0)
    x, y = digits.batch(indices=[1000, 1001])
    obs = lb.observe(model, x, y, labels_known=True, defense=defense, seed=0)
    attack = create("ggl")
    matcher = attack.matcher(obs, MatchingSettings())
    assert attack._adapted["masked"] is masked and (sparse_support(obs) >= 0.8) is masked
    with torch.enable_grad():
        distance = float(matcher.objective(x, y)[1].detach())
    if masked:
        assert distance < 1e-5
        plain = lb.attacks.solvers.gradient_matching.GradientMatcher(obs, MatchingSettings())
        with torch.enable_grad():
            assert float(plain.objective(x, y)[1].detach()) > 0.05    # unmasked, the pruned zeros do not match
    never = create("ggl", adapt="none")
    never.matcher(obs, MatchingSettings())
    assert never._adapted["masked"] is False


def test_cma_search_beats_grey_counts_its_evaluations_and_is_seeded(observe_digits, cached):
    _, obs = observe_digits(2)
    seen = []
    runs = [lb.attack("ggl", obs, preset="quick", evaluations=120, seed=2, progress=lambda d, t, v: seen.append((d, t)),
                      **cached) for _ in range(2)]
    rec = runs[0]
    lam = rec.trace["population"]
    assert lam == 4 + int(3 * torch.log(torch.tensor(2.0 * cached["latent"])))
    assert seen[-1][0] == seen[-1][1] == (120 // lam) * lam
    assert rec.trace["final_match"] < rec.trace["grey_match"]
    # the best code over the generations, by the search's objective (its match is re-evaluated alone, so it need not
    # be below the first generation's match)
    assert rec.trace["objective_best"] <= min(rec.trace["latent_objective"])
    assert torch.equal(runs[0].images, runs[1].images)
    assert rec.images.shape == (2, 1, 8, 8) and float(rec.images.min()) >= 0 and float(rec.images.max()) <= 1


def test_adam_variant(observe_digits, cached):
    _, obs = observe_digits(1)
    rec = lb.attack("ggl", obs, preset="adam", latent_steps=40, seed=0, **cached)
    assert "population" not in rec.trace and rec.trace["final_match"] < rec.trace["grey_match"]


@pytest.mark.parametrize("options, message", [
    ({"optimizer": "bfgs"}, "optimizer in"), ({"adapt": "always"}, "adapt in"), ({"evaluations": 1}, "evaluations"),
    ({"population": 1}, "population"), ({"sigma": -1.0}, "sigma > 0"), ({"kl": -0.1}, "kl ≥ 0"),
])
def test_bad_options_fail_with_one_line(observe_digits, options, message):
    _, obs = observe_digits(1)
    with pytest.raises(ConfigError, match=message):
        lb.attack("ggl", obs, preset="quick", **options)


def test_too_large_a_search_is_refused_with_the_way_out(observe_digits):
    _, obs = observe_digits(2)
    with pytest.raises(UnsupportedThreatModel, match="optimizer='adam'"):
        lb.attack("ggl", obs, latent=1100)
