"""GIAS (Jeon et al. 2021) and the library's learned image prior (models/prior.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.models.prior import _key, ConvDecoder, PriorConfig, learned_generator, public_images, user_generator

SHAPE = (1, 8, 8)
TINY = PriorConfig(latent=4, width=4, steps=20, batch=16, seed=0)   # conftest's TINY_PRIOR


class TinyGenerator(nn.Module):
    """A user's generator: codes (n, latent) ↦ images (n, *out_shape) in (0, 1)."""

    def __init__(self, latent: int, out_shape=(1, 8, 8)) -> None:
        super().__init__()
        self.out_shape = tuple(out_shape)
        self.fc = nn.Linear(latent, out_shape[0] * out_shape[1] * out_shape[2])

    def forward(self, z):
        return torch.sigmoid(self.fc(z)).reshape(len(z), *self.out_shape)


class Broken(nn.Module):
    """A generator that raises on every code."""

    def forward(self, z):
        raise RuntimeError("no")


class WrongShape(nn.Module):
    """A generator whose images are not the attacked shape."""

    def forward(self, z):
        return torch.zeros(len(z), 1, 4, 4)


def test_registered_with_presets():
    assert "gias" in lb.attacks.names()
    attack = lb.attacks.create("gias", preset="quick")
    assert attack.options.restarts == 1
    with pytest.raises(ConfigError, match="unknown preset"):
        lb.attacks.create("gias", preset="nope")


@pytest.mark.parametrize("options, message", [
    ({"generator": "not a class"}, "option generator"),
    ({"generator_file": "w.pt"}, "generator_file goes with"),
    ({"latent": 0}, "option latent"),
    ({"restarts": 0}, "option restarts"),
    ({"latent_lr": -1.0}, "option latent_lr"),
    ({"anchor": -0.1}, "option anchor"),
    ({"distance": "manhattan"}, "option distance"),
    ({"public": "mnist"}, "option public"),
    ({"colour": 1}, "unknown option"),
])
def test_bad_options_fail_with_one_line(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        lb.attacks.create("gias", **options)
    assert "\n" not in str(info.value)


def test_public_digits_are_the_reserved_range(digits):
    public = public_images("digits", SHAPE)
    assert public.shape == (1000, *SHAPE)
    assert torch.equal(public, digits.images[:1000])
    with pytest.raises(ConfigError, match="no such folder"):
        public_images("/no/such/folder", SHAPE)


def test_cache_round_trip_loads_the_same_weights(tmp_path):
    first, info = learned_generator(SHAPE, config=TINY, cache_dir=tmp_path)
    assert info["trained"] and (tmp_path / f"vae-{info['key']}.pt").is_file()
    again, info2 = learned_generator(SHAPE, config=TINY, cache_dir=tmp_path)
    assert not info2["trained"] and info2["key"] == info["key"]
    for (n, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    saved = torch.load(tmp_path / f"vae-{info['key']}.pt", weights_only=True)  # tensors only
    assert set(saved) == {"decoder", "loss"}
    images = public_images("digits", SHAPE)
    for change in ({"seed": 1}, {"steps": 21}, {"latent": 5}, {"width": 5}):
        assert _key(images, SHAPE, PriorConfig(**{**TINY.__dict__, **change})) != info["key"], change
    assert _key(images[1:], SHAPE, TINY) != info["key"]


def test_vae_training_is_seeded():
    a, _ = learned_generator(SHAPE, config=TINY, cache=False)
    b, _ = learned_generator(SHAPE, config=TINY, cache=False)
    assert torch.equal(a.out.weight, b.out.weight)
    with torch.no_grad():
        out = a(torch.randn(3, TINY.latent))
    assert out.shape == (3, *SHAPE) and float(out.min()) > 0 and float(out.max()) < 1


def test_decoder_any_size():
    assert ConvDecoder(3, (3, 10, 7))(torch.zeros(2, 3)).shape == (2, 3, 10, 7)


def test_deterministic_for_a_seed(observe_digits, cached):
    _, obs = observe_digits(2)
    short = dict(latent_steps=4, generator_steps=2)  # determinism needs few steps
    runs = [lb.attack("gias", obs, preset="quick", seed=3, **short, **cached) for _ in range(2)]
    assert torch.equal(runs[0].images, runs[1].images)
    other = lb.attack("gias", obs, preset="quick", seed=4, **short, **cached)
    assert not torch.equal(runs[0].images, other.images)


def test_objective_decreases_and_progress_is_reported(observe_digits, cached):
    _, obs = observe_digits(2)
    seen = []
    rec = lb.attack("gias", obs, preset="quick", latent_steps=40, generator_steps=20, progress=lambda d, t, v: seen.append((d, t)),
                    **cached)
    assert seen[-1] == (60, 60) and len(seen) == 60
    latent, tuned = rec.trace["latent_loss"], rec.trace["generator_loss"]
    assert rec.trace["final_match"] < latent[0] and tuned[-1] < tuned[0]
    assert rec.trace["final_match"] <= rec.trace["latent_match"] + 1e-12
    assert rec.images.shape == (2, *SHAPE) and float(rec.images.min()) >= 0 and float(rec.images.max()) <= 1
    assert rec.trace["generator_info"]["trained"] is False   # the module's cached generator


def test_labels_recovered_when_not_granted(observe_digits, cached):
    x, obs = observe_digits(1, labels_known=False)
    rec = lb.attack("gias", obs, preset="quick", latent_steps=5, generator_steps=0, **cached)
    assert rec.labels is not None and rec.labels.shape == (1,)
    assert rec.trace["stage"] == "latent" and "generator_match" not in rec.trace


@pytest.mark.slow
def test_beats_grey_on_an_untrained_net_at_batch_one(observe_digits):
    """B = 1, an untrained net: the gradient pins the image and the prior holds it near digits."""
    wins = 0
    for seed in range(3):
        x, obs = observe_digits(1, seed=seed)
        rec = lb.attack("gias", obs, seed=seed, latent_steps=150, generator_steps=100, restarts=2, cache=False,
                        prior_steps=400)
        grey = lb.compare(torch.full_like(x, float(x.mean())), x, obs.labels)["psnr"]
        wins += lb.compare(rec.images, x, obs.labels)["psnr"] > grey + 2
        assert rec.trace["final_match"] < rec.trace["grey_match"]
    assert wins >= 2


def test_user_generator_class(observe_digits, tmp_path):
    weights = tmp_path / "gen.pt"
    torch.manual_seed(0)
    torch.save(TinyGenerator(6).state_dict(), weights)
    gen = user_generator(f"{__name__}:TinyGenerator", SHAPE, latent=6, weights=weights)
    assert torch.equal(gen.fc.weight, torch.load(weights, weights_only=True)["fc.weight"])
    _, obs = observe_digits(2)
    rec = lb.attack("gias", obs, preset="quick", generator=f"{__name__}:TinyGenerator", generator_file=str(weights),
                    latent=6, latent_steps=10, generator_steps=5)
    assert rec.images.shape == (2, *SHAPE)
    assert rec.trace["generator_info"]["generator"].endswith(":TinyGenerator")


def test_user_generator_errors(digits, tmp_path):
    with pytest.raises(ConfigError, match="to map codes"):
        user_generator(f"{__name__}:WrongShape", SHAPE, latent=6)
    with pytest.raises(ConfigError, match="fails on codes"):
        user_generator(f"{__name__}:Broken", SHAPE, latent=6)
    with pytest.raises(ConfigError, match="no such file"):
        user_generator(f"{__name__}:TinyGenerator", SHAPE, latent=6, weights=tmp_path / "missing.pt")
    torch.save(TinyGenerator(3).state_dict(), tmp_path / "small.pt")
    with pytest.raises(ConfigError, match="loading generator weights"):
        user_generator(f"{__name__}:TinyGenerator", SHAPE, latent=6, weights=tmp_path / "small.pt")


@pytest.mark.parametrize("value", [0, 33, 1.5, True])
def test_bad_consensus_fails_with_one_line(value):
    with pytest.raises(ConfigError, match="option consensus") as info:
        lb.attacks.create("gias", consensus=value)
    assert "\n" not in str(info.value)


def test_consensus_is_the_registered_mean_of_independent_runs(observe_digits, cached, monkeypatch):
    """consensus=3: three whole runs on one random stream (the first is the consensus=1 result), their mean the
    result; its squared error is at most the runs' average (the mean's, by convexity), and progress counts 3 runs."""
    from leakbench.attacks.solvers import generative

    x, obs = observe_digits(3)
    short = dict(latent_steps=6, generator_steps=3)
    single = lb.attack("gias", obs, preset="quick", seed=5, **short, **cached)
    assert torch.equal(single.images, lb.attack("gias", obs, preset="quick", seed=5, consensus=1, **short,
                                                **cached).images)
    seen, runs, original = [], [], generative.registered_mean

    def spy(images, labels, *, reference=0):
        runs.extend(images)
        return original(images, labels, reference=reference)

    monkeypatch.setattr(generative, "registered_mean", spy)
    rec = lb.attack("gias", obs, preset="quick", seed=5, consensus=3, progress=lambda d, t, v: seen.append((d, t)),
                    **short, **cached)
    assert len(runs) == 3 and torch.equal(runs[0], single.images)
    assert not torch.equal(runs[0], runs[1])
    assert rec.trace["consensus"] == 3 and len(rec.trace["run_matches"]) == 3
    assert rec.trace["run_matches"][0] == single.trace["final_match"]
    assert torch.allclose(rec.images, torch.stack(runs).mean(0))     # labels distinct: nothing to register
    errors = [float((r - x).pow(2).sum()) for r in runs]
    assert float((rec.images - x).pow(2).sum()) <= sum(errors) / 3 + 1e-9
    assert seen[-1] == (27, 27) and len(seen) == 27
