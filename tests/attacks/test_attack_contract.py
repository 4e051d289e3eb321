"""The attack contract: names, options, presets, requirements, Reconstruction, seeds and restarts."""
from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

import leakbench as lb
from leakbench.attacks import ATTACKS, create
from leakbench.attacks.solvers.matching_settings import MatchingSettings, initial_images
from leakbench.attacks.solvers.objectives import GradientDistance
from leakbench.errors import ConfigError, UnsupportedThreatModel
from leakbench.losses import get_loss

IG = "inverting-gradients"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def batch():
    x, y = lb.load("digits").batch(2, seed=0)
    return x, y


@pytest.fixture(scope="module")
def obs(batch):
    x, y = batch
    model = lb.build("mlp:16", input_shape=x.shape[1:], classes=10, seed=0)
    return lb.observe(model, x, y, labels_known=True)


@pytest.fixture(scope="module")
def vector_obs():
    data = lb.load("sphere")
    model = lb.build("mlp:8", input_shape=data.shape, classes=2, seed=0)
    x, y = data.batch(2, seed=0)
    return lb.observe(model, x, y, labels_known=True)


def _match_of(obs, images, labels):
    """1 − cos between the observed gradient and the gradient at ``images`` (computed here)."""
    model = obs.model
    params = [p for p in model.parameters() if p.requires_grad]
    loss = get_loss(obs.loss)(model(images), labels)
    grads = torch.autograd.grad(loss, params)
    return float(GradientDistance(obs.shared, kind="cosine")(list(grads)))


# --------------------------------------------------------------------------- names, options, presets


def test_unknown_attack_lists_the_registered_names(obs):
    with pytest.raises(ConfigError) as info:
        lb.attack("inverting-gradient", obs)
    msg = str(info.value)
    assert "unknown attack 'inverting-gradient'" in msg and f"Did you mean '{IG}'?" in msg
    assert msg.endswith("Known attacks: " + ", ".join(ATTACKS.names()))
    assert {"dlg", IG} <= set(ATTACKS.names())


def test_unknown_option_lists_the_options(obs):
    with pytest.raises(ConfigError) as info:
        lb.attack(IG, obs, iteration=5)
    msg = str(info.value)
    assert f"unknown option 'iteration' for attack '{IG}'" in msg
    fields = sorted(f.name for f in dataclasses.fields(MatchingSettings))
    assert msg.endswith("known options: " + ", ".join(fields))


@pytest.mark.parametrize("name", ["dlg", IG])
def test_unknown_preset_lists_the_presets(name, obs):
    cls = ATTACKS.get(name)
    with pytest.raises(ConfigError) as info:
        lb.attack(name, obs, preset="fastest")
    msg = str(info.value)
    assert f"unknown preset 'fastest' for attack '{name}'" in msg
    assert msg.endswith("known presets: " + ", ".join(["default", *sorted(cls.presets)]))


def test_presets_and_overrides():
    a = create(IG, preset="quick")
    assert a.preset == "quick" and a.options.iterations == ATTACKS.get(IG).presets["quick"]["iterations"]
    b = create(IG, preset="quick", iterations=7, tv=0.0)
    assert b.options.iterations == 7 and b.options.tv == 0.0 and b.options.distance == "cosine"
    c = create(IG)
    assert c.preset == "default" and c.options == MatchingSettings(**ATTACKS.get(IG).presets["default"])
    d = create("dlg", preset="idlg")
    assert d.options.soft_labels is False and create("dlg").options.soft_labels is True


def test_string_options_are_coerced_to_the_declared_types():
    a = create(IG, iterations="5", signed="false", tv="0.25", box="Yes", restarts="2", distance="l2")
    o = a.options
    assert o.iterations == 5 and type(o.iterations) is int
    assert o.signed is False and o.box is True
    assert o.tv == 0.25 and type(o.tv) is float
    assert o.restarts == 2 and o.distance == "l2"
    for text, value in (("1", True), ("0", False), ("on", True), ("off", False), ("TRUE", True), ("no", False)):
        assert create(IG, signed=text).options.signed is value


@pytest.mark.parametrize("options,match", [
    ({"iterations": "five"}, "expected int for option 'iterations' of attack 'inverting-gradients', got 'five'"),
    ({"iterations": "2.5"}, "expected int for option 'iterations'"),
    ({"signed": "maybe"}, "expected bool for option 'signed'"),
    ({"lr": "fast"}, "expected float for option 'lr'"),
])
def test_bad_option_strings(options, match):
    with pytest.raises(ConfigError, match=match):
        create(IG, **options)


@pytest.mark.parametrize("options,match", [
    ({"iterations": 0}, "iterations ≥ 1"),
    ({"restarts": 0}, "restarts ≥ 1"),
    ({"lr": -1.0}, "lr > 0"),
    ({"tv": -0.1}, "tv, bn ≥ 0"),
    ({"distance": "l1"}, "expected distance in"),
    ({"optimizer": "rmsprop"}, "expected optimizer in"),
    ({"step_unit": "pixels"}, "expected step_unit in"),
    ({"init_std": 0.0}, "init_std > 0"),
    ({"optimizer": "lbfgs", "batched_restarts": True, "restarts": 2}, "batched_restarts works with adam or sgd"),
])
def test_option_values_are_validated_before_running(options, match):
    with pytest.raises(ConfigError, match=match):
        create(IG, **options)


def test_attack_needs_an_observation(batch):
    with pytest.raises(ConfigError, match="expected an Observation"):
        lb.attack(IG, batch[0])


# --------------------------------------------------------------------------- requirements


def test_tv_on_vector_data_is_unsupported_with_the_reason(vector_obs):
    calls = []
    with pytest.raises(UnsupportedThreatModel) as info:
        lb.attack(IG, vector_obs, iterations=3, callback=lambda s, x: calls.append(s))
    msg = str(info.value)
    assert f"attack '{IG}' cannot run on this observation" in msg
    assert "the TV prior needs image inputs C×H×W; set tv=0 for vector data" in msg
    assert calls == []  # refused before any work
    assert create(IG).requirements(vector_obs) and not create(IG, tv=0.0).requirements(vector_obs)
    rec = lb.attack(IG, vector_obs, iterations=3, tv=0)
    assert rec.images.shape == (2, 10)


@pytest.mark.parametrize("name", ["dlg", IG])
def test_weights_observation_is_unsupported(name, obs):
    weights = dataclasses.replace(obs, kind="weights")
    with pytest.raises(UnsupportedThreatModel, match="needs a shared gradient or update, not trained weights"):
        lb.attack(name, weights, iterations=2)


# --------------------------------------------------------------------------- Reconstruction


@pytest.mark.parametrize("name,preset", [(IG, "quick"), ("dlg", "quick")])
def test_reconstruction_fields(name, preset, obs, batch):
    x, y = batch
    steps = []
    start = time.perf_counter()
    rec = lb.attack(name, obs, preset=preset, iterations=4, trace_every=2,
                    callback=lambda s, imgs: steps.append((s, tuple(imgs.shape))))
    elapsed = time.perf_counter() - start
    assert isinstance(rec, lb.Reconstruction)
    assert rec.images.shape == x.shape and rec.images.dtype == x.dtype and rec.batch_size == 2
    assert bool(torch.isfinite(rec.images).all())
    assert rec.attack == name
    assert rec.options["preset"] == preset and rec.options["iterations"] == 4 and rec.options["trace_every"] == 2
    assert set(rec.options) == {"preset", *(f.name for f in dataclasses.fields(MatchingSettings))}
    assert isinstance(rec.trace["seconds"], float) and 0 < rec.trace["seconds"] <= elapsed
    assert math.isfinite(rec.trace["final_match"]) and rec.trace["final_match"] >= 0
    assert steps and all(shape == tuple(x.shape) for _, shape in steps)
    if name == IG:  # labels granted → returned as they are; images in the data box
        assert torch.equal(rec.labels, y)
        assert float(rec.images.min()) >= 0.0 and float(rec.images.max()) <= 1.0
    else:  # DLG optimises soft labels: one class index per slot
        assert rec.labels.shape == (2,) and rec.labels.dtype == torch.long


def test_labels_are_recovered_when_not_granted():
    x, y = lb.load("digits").batch(1, seed=4)
    model = lb.build("lenet", input_shape=x.shape[1:], classes=10, seed=0)
    rec = lb.attack(IG, lb.observe(model, x, y), iterations=2)
    assert torch.equal(rec.labels, y)


def test_progress_reports_reach_the_total(obs):
    seen = []
    lb.attack(IG, obs, iterations=4, restarts=2, trace_every=1, progress=lambda d, t, l: seen.append((d, t, l)))
    assert seen[-1][0] == seen[-1][1] == 8
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    assert all(math.isfinite(loss) for _, _, loss in seen)


# --------------------------------------------------------------------------- seeds and restarts


@pytest.mark.parametrize("name", [IG, "dlg"])
def test_same_seed_same_reconstruction_different_seed_different(name, obs):
    a = lb.attack(name, obs, iterations=5, seed=3)
    b = lb.attack(name, obs, iterations=5, seed=3)
    c = lb.attack(name, obs, iterations=5, seed=4)
    assert torch.equal(a.images, b.images) and a.trace["final_match"] == b.trace["final_match"]
    assert not torch.allclose(a.images, c.images)


def test_restarts_keep_the_best_final_match(obs):
    rec = lb.attack(IG, obs, iterations=5, restarts=3, seed=1)
    losses = rec.trace["restart_losses"]
    assert len(losses) == 3 and rec.trace["restarts"] == 3
    assert len(set(losses)) == 3  # the restarts really start from different images
    assert rec.trace["final_match"] == min(losses)
    # the returned images are the best restart's: their gradient match, computed here, is the minimum
    assert _match_of(obs, rec.images, rec.labels) == pytest.approx(min(losses), rel=1e-4, abs=1e-6)
    # and the first restart is the single-restart run with the same seed
    single = lb.attack(IG, obs, iterations=5, restarts=1, seed=1)
    assert single.trace["final_match"] == pytest.approx(losses[0], rel=1e-6)


def test_batched_restarts_select_like_sequential(obs):
    seq = lb.attack(IG, obs, iterations=5, restarts=3, seed=1)
    bat = lb.attack(IG, obs, iterations=5, restarts=3, seed=1, batched_restarts=True)
    assert bat.trace.get("batched") is True and bat.options["batched_restarts"] is True
    losses = bat.trace["restart_losses"]
    assert len(losses) == 3 and bat.trace["final_match"] == min(losses)
    assert _match_of(obs, bat.images, bat.labels) == pytest.approx(min(losses), rel=1e-4, abs=1e-6)
    for rec in (seq, bat):
        assert tuple(rec.images.shape) == (obs.batch_size, *obs.input_shape)
        assert bool(torch.isfinite(rec.images).all())
        assert float(rec.images.min()) >= 0.0 and float(rec.images.max()) <= 1.0
    # same starts and an element-wise optimiser: the same restarts, so the same one is kept
    assert losses == pytest.approx(seq.trace["restart_losses"], rel=1e-4, abs=1e-6)
    assert losses.index(min(losses)) == seq.trace["restart_losses"].index(min(seq.trace["restart_losses"]))
    assert torch.allclose(bat.images, seq.images, atol=1e-4)


@pytest.mark.parametrize("unit, expected", [("data", 0.1), ("normalised", 0.1 / 4)])
def test_step_unit_scales_the_first_signed_step(obs, unit, expected):
    """Signed Adam's first step moves every pixel by exactly lr (Adam on ±1 has a unit first step);
    in normalised units lr is multiplied by σ = a quarter of the data box ([0, 1] here)."""
    seen = []
    lb.attack(IG, obs, iterations=1, tv=0.0, box=False, lr=0.1, step_unit=unit, schedule="none",
              callback=lambda step, images: seen.append(images.clone()))
    start = initial_images(seen[0].shape, "gaussian", obs.data_range, generator=torch.Generator().manual_seed(0),
                           device="cpu", dtype=seen[0].dtype)
    moved = (seen[0] - start).abs()
    assert torch.allclose(moved[moved > 0], torch.full_like(moved[moved > 0], expected), rtol=1e-4)
    assert float((moved > 0).float().mean()) > 0.5


def test_init_std_is_in_normalised_units():
    gen = torch.Generator().manual_seed(0)
    x = initial_images((4000,), "gaussian", (0.0, 8.0), generator=gen, device="cpu", dtype=torch.float64, std=0.5)
    assert abs(float(x.mean()) - 4.0) < 0.05 and abs(float(x.std()) - 0.5 * 8.0 / 4) < 0.05
