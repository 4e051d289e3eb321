"""Liu et al. (2024)'s attack: feature term, deep image prior, comparison with Inverting Gradients."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks.gradient.liu2024 import feature_loss
from leakbench.models.malicious import random_head


@pytest.fixture(scope="module")
def photos():
    return lb.load("photos", size=16)


def _setup(photos, *, defense=None, seed=0):
    """ConvNet-8 (BN, training mode, statistics granted as in Liu et al. Sec. 5.1) + the random head."""
    model = lb.build("convnet-8", input_shape=photos.shape, classes=photos.num_classes, seed=seed)
    shipped = random_head(model, width=40_000, seed=seed)
    x, y = photos.batch(4, seed=seed)
    obs = lb.observe(shipped, x, y, labels_known=True, train=True, bn_stats=True, defense=defense)
    return x, obs


def test_feature_loss_is_zero_at_the_recovered_features_up_to_order_sign_and_scale():
    gen = torch.Generator().manual_seed(0)
    z = torch.nn.functional.normalize(torch.randn(4, 20, generator=gen), dim=1)
    shuffled = -3.0 * z[[2, 0, 3, 1]]
    assert float(feature_loss(shuffled, z, form="cosine")) < 1e-6
    assert float(feature_loss(shuffled, z, form="projection")) < 1e-6
    other = torch.randn(4, 20, generator=gen)
    assert float(feature_loss(other, z, form="cosine")) > 0.3
    assert 0 < float(feature_loss(other, z, form="projection")) <= 1


def test_feature_loss_gradient_pulls_towards_the_features():
    gen = torch.Generator().manual_seed(1)
    z = torch.nn.functional.normalize(torch.randn(3, 10, generator=gen), dim=1)
    f = (z + 0.5 * torch.randn(3, 10, generator=gen)).requires_grad_(True)
    opt = torch.optim.SGD([f], lr=0.5)
    first = float(feature_loss(f, z, form="cosine").detach())
    for _ in range(100):
        opt.zero_grad()
        feature_loss(f, z, form="cosine").backward()
        opt.step()
    assert float(feature_loss(f, z, form="cosine")) < first / 10


def test_short_run_returns_box_images_and_trace(photos):
    x, obs = _setup(photos)
    rec = lb.attack("liu2024", obs, preset="quick", iterations=10)
    assert rec.images.shape == x.shape
    assert float(rec.images.min()) >= 0 and float(rec.images.max()) <= 1
    assert rec.trace["features"].shape[0] == 4 and rec.trace["feature_form"] == "cosine"
    assert rec.labels.tolist() == obs.labels.tolist()
    assert len(rec.trace["loss"]) >= 1


def test_runs_without_the_random_block_when_the_feature_term_is_off(photos):
    model = lb.build("cnn:3-4-2-1", input_shape=photos.shape, classes=photos.num_classes, seed=0)
    x, y = photos.batch(2, seed=0)
    obs = lb.observe(model, x, y, labels_known=True)
    with pytest.raises(lb.UnsupportedThreatModel, match="feature=0"):
        lb.attack("liu2024", obs, preset="quick", iterations=5)
    rec = lb.attack("liu2024", obs, preset="quick", iterations=5, feature=0.0)
    assert rec.images.shape == x.shape and rec.trace["bn_prior"].startswith("off")
    pixels = lb.attack("liu2024", obs, preset="quick", iterations=5, feature=0.0, generator=False, lr=0.1)
    assert pixels.images.shape == x.shape


def test_bad_options():
    with pytest.raises(lb.ConfigError, match="feature_form"):
        lb.attacks.create("liu2024", feature_form="l2")
    with pytest.raises(lb.ConfigError, match="weights"):
        lb.attacks.create("liu2024", weights="l1")


def _rmse(rec, x):
    return lb.compare(rec, x)["rmse"]


@pytest.mark.slow
@pytest.mark.xfail(reason="measured at 300 iterations on 16 px photos: liu2024 beats inverting-gradients for seed 1 "
                          "(RMSE 0.361 vs 0.376) but not for seed 0 (0.358 vs 0.352); at 100 iterations on CIFAR "
                          "32 px it wins at every batch size (benchmarks/bench_feature_attacks.py)",
                   strict=False)
def test_beats_inverting_gradients_at_batch_4_on_a_small_cnn(photos):
    x, obs = _setup(photos)
    budget = 300
    ig = lb.attack("inverting-gradients", obs, preset="quick", iterations=budget)
    ours = lb.attack("liu2024", obs, preset="quick", iterations=budget)
    assert _rmse(ours, x) < _rmse(ig, x)


@pytest.mark.slow
@pytest.mark.xfail(reason="measured under clip:4, seeds 0/1: RMSE 0.367/0.346 with the feature term, 0.332/0.328 "
                          "without; the tensor step's feature error (≈0.2 on nearly collinear random-CNN features) "
                          "makes the term pull away from the batch at α_f = 0.1",
                   strict=False)
def test_feature_term_helps_under_clipping(photos):
    defense = "clip:4" if "clip" in lb.DEFENSES.names() else None
    x, obs = _setup(photos, defense=defense)
    budget = 300
    with_f = lb.attack("liu2024", obs, preset="quick", iterations=budget)
    without = lb.attack("liu2024", obs, preset="quick", iterations=budget, feature=0.0)
    assert _rmse(with_f, x) < _rmse(without, x)
