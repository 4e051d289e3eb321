"""GIFD (Fang et al. 2023): the ℓ1-ball projection, the generator's stages, the feature-domain search."""
from __future__ import annotations

import pytest
import torch
from scipy.optimize import brentq
from torch import nn

import leakbench as lb
from leakbench.attacks.gradient.gifd import project_l1_ball
from leakbench.errors import ConfigError
from leakbench.models.prior import ConvDecoder, generator_stages

SHAPE = (1, 8, 8)


class SequentialGenerator(nn.Sequential):
    """A user's generator in stages: codes (n, latent) ↦ a hidden layer ↦ images (n, 1, 8, 8)."""

    def __init__(self, latent: int = 4, out_shape=SHAPE) -> None:
        super().__init__(nn.Sequential(nn.Linear(latent, 32), nn.Tanh()),
                         nn.Sequential(nn.Linear(32, 64), nn.Sigmoid(), nn.Unflatten(1, tuple(out_shape))))


class Monolith(nn.Module):
    """A generator that does not say its stages."""

    def __init__(self, latent: int = 4, out_shape=SHAPE) -> None:
        super().__init__()
        self.fc = nn.Linear(latent, 64)

    def forward(self, z):
        return torch.sigmoid(self.fc(z)).reshape(len(z), *SHAPE)


def test_projection_is_the_closest_point_of_the_ball():
    """Against an independent computation: the soft threshold θ solving Σ max(|v| − θ, 0) = r by root finding."""
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(6, 50, generator=gen, dtype=torch.float64) * torch.tensor([1, 2, 3, 0.1, 5, 1.0])[:, None]
    radius = torch.tensor([1.0, 5.0, 2.5, 100.0, 0.3, 10.0], dtype=torch.float64)
    w = project_l1_ball(v, radius)
    for row, r, out in zip(v, radius, w):
        if float(row.abs().sum()) <= float(r):
            assert torch.equal(out, row)            # inside the ball: unchanged
            continue
        theta = brentq(lambda t, row=row, r=r: float((row.abs() - t).clamp(min=0).sum()) - float(r), 0.0,
                       float(row.abs().max()))
        expected = torch.sign(row) * (row.abs() - theta).clamp(min=0)
        assert torch.allclose(out, expected, atol=1e-10)
        assert float(out.abs().sum()) == pytest.approx(float(r), rel=1e-9)


def test_stages_compose_to_the_generator():
    decoder = ConvDecoder(5, (1, 10, 7), width=4)
    z = torch.randn(3, 5)
    h = z
    for stage in generator_stages(decoder):
        h = stage(h)
    assert torch.equal(h, decoder(z)) and len(generator_stages(decoder)) == 4
    seq = SequentialGenerator()
    assert len(generator_stages(seq)) == 2
    with pytest.raises(ConfigError, match="generator in stages"):
        generator_stages(Monolith())


@pytest.mark.parametrize("options, message", [
    ({"generator_steps": 5}, "unknown option 'generator_steps'"),
    ({"radius": 0.0}, "radius > 0"),
    ({"feature_steps": 0}, "feature_steps"),
    ({"last_stage": -1}, "last_stage"),
])
def test_bad_options_fail_with_one_line(observe_digits, options, message):
    _, obs = observe_digits(1)
    with pytest.raises(ConfigError, match=message):
        lb.attack("gifd", obs, preset="quick", **options)


def test_too_deep_a_last_stage_names_the_generator(observe_digits, cached):
    _, obs = observe_digits(1)
    with pytest.raises(ConfigError, match="last_stage ≤ 3"):
        lb.attack("gifd", obs, preset="quick", latent_steps=2, last_stage=4, **cached)


def test_feature_search_improves_the_match_and_keeps_the_best_stage(observe_digits, cached):
    _, obs = observe_digits(2)
    seen = []
    rec = lb.attack("gifd", obs, preset="quick", latent_steps=30, feature_steps=15, seed=1,
                    progress=lambda d, t, v: seen.append((d, t)), **cached)
    matches = rec.trace["feature_matches"]
    assert len(matches) == 3 and seen[-1] == (30 + 3 * 15, 30 + 3 * 15)
    best = min([rec.trace["latent_match"], *matches])
    assert rec.trace["final_match"] == pytest.approx(best)
    stage = rec.trace["stage"]
    assert stage == ("latent" if best == rec.trace["latent_match"] else f"feature {matches.index(best) + 1}")
    assert rec.trace["final_match"] < rec.trace["grey_match"]
    assert rec.images.shape == (2, *SHAPE) and float(rec.images.min()) >= 0 and float(rec.images.max()) <= 1


def test_deterministic_for_a_seed(observe_digits, cached):
    _, obs = observe_digits(2)
    short = dict(latent_steps=4, feature_steps=2)
    runs = [lb.attack("gifd", obs, preset="quick", seed=3, **short, **cached) for _ in range(2)]
    assert torch.equal(runs[0].images, runs[1].images)


def test_a_user_generator_in_stages(observe_digits, tmp_path):
    torch.manual_seed(0)
    weights = tmp_path / "gen.pt"
    torch.save(SequentialGenerator().state_dict(), weights)
    _, obs = observe_digits(1)
    rec = lb.attack("gifd", obs, preset="quick", generator=f"{__name__}:SequentialGenerator",
                    generator_file=str(weights), latent=4, latent_steps=5, feature_steps=5)
    assert len(rec.trace["feature_matches"]) == 1                 # two stages: one feature space
    with pytest.raises(ConfigError, match="generator in stages"):
        lb.attack("gifd", obs, preset="quick", generator=f"{__name__}:Monolith", latent=4, latent_steps=2)
