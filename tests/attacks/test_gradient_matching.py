"""Quality of the gradient-matching attacks at test budgets (DLG, Inverting Gradients)."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("seed", [0, 1])
def test_dlg_recovers_digit_on_sigmoid_lenet(seed):
    """DLG (soft labels, L-BFGS on L2) on the sigmoid LeNet at 16×16: MSE < 1e-4 and the right label."""
    ds = lb.load("digits", size=16)
    x, y = ds.batch(1, seed=seed)
    model = lb.build("lenet", input_shape=ds.shape, classes=10, seed=seed)
    obs = lb.observe(model, x, y)
    rec = lb.attack("dlg", obs, iterations=60, seed=seed)
    score = lb.compare(rec, x, y)
    assert score["mse"] < 1e-4
    assert score["label_acc"] == 1.0


def test_idlg_preset_uses_recovered_label():
    ds = lb.load("digits", size=16)
    x, y = ds.batch(1, seed=3)
    obs = lb.observe(lb.build("lenet", input_shape=ds.shape, classes=10, seed=3), x, y)
    rec = lb.attack("dlg", obs, preset="idlg", iterations=60)
    assert rec.labels.tolist() == y.tolist()
    assert lb.compare(rec, x, y)["mse"] < 1e-4


def test_inverting_gradients_reaches_20db_on_photo():
    """Inverting Gradients on a small ConvNet with a 32×32 photo reaches ≥ 20 dB PSNR at the quick budget."""
    ds = lb.load("photos", size=32)
    x, y = ds.batch(1, seed=0)
    model = lb.build("convnet-16", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval()
    obs = lb.observe(model, x, y)
    rec = lb.attack("inverting-gradients", obs, preset="quick")
    score = lb.compare(rec, x, y)
    assert score["psnr"] >= 20.0
    assert score["label_acc"] == 1.0
    assert rec.images.min() >= 0 and rec.images.max() <= 1  # box constraint


def test_inverting_gradients_degrades_with_batch_size():
    """The same budget rebuilds one image better than each of four (the known batch-size effect)."""
    ds = lb.load("photos", size=32)
    model = lb.build("convnet-8", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval()
    scores = []
    for batch in (1, 4):
        x, y = ds.batch(batch, seed=0)
        rec = lb.attack("inverting-gradients", lb.observe(model, x, y, labels_known=True), preset="quick",
                        iterations=120)
        scores.append(lb.compare(rec, x, y)["psnr"])
    assert scores[0] > scores[1]


def test_update_observation_is_inverted_by_simulating_local_steps():
    """FedAvg-style update (3 local steps): matching the simulated update rebuilds the digit."""
    ds = lb.load("digits", size=16)
    x, y = ds.batch(1, seed=0)
    model = lb.build("lenet", input_shape=ds.shape, classes=10, seed=0)
    obs = lb.observe(model, x, y, local_steps=3, local_lr=0.01, labels_known=True)
    rec = lb.attack("dlg", obs, preset="idlg", iterations=60)
    assert lb.compare(rec, x, y)["mse"] < 1e-3
