"""fc-inversion: Lemma 3.1 is exact for one sample, and says what it recovers for batches."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.errors import UnsupportedThreatModel


@pytest.fixture(scope="module")
def sample():
    data = lb.load("photos", size=16)
    x, y = data.batch(1, seed=0)
    return data, x.double(), y


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("act", ["tanh", "relu", "sigmoid"])
def test_batch_one_with_bias_is_exact(sample, act):
    data, x, y = sample
    model = lb.build("mlp:64-32", input_shape=data.shape, classes=data.num_classes, act=act, seed=1,
                     dtype=torch.float64)
    rec = lb.attack("fc-inversion", lb.observe(model, x, y))
    assert rel(rec.images, x) < 1e-6
    assert rec.trace["exact"] and rec.trace["method"].startswith("bias")
    assert rec.labels.tolist() == y.tolist()  # iDLG on the bias gradient


@pytest.mark.parametrize("spec,act", [("mlp:64-32", "tanh"), ("mlp:40", "leaky-relu"), ("mlp", "identity"),
                                      ("mlp:50", "relu")])
def test_batch_one_without_bias_is_exact(sample, spec, act):
    data, x, y = sample
    model = lb.build(spec, input_shape=data.shape, classes=data.num_classes, act=act, bias=False, seed=2,
                     dtype=torch.float64)
    rec = lb.attack("fc-inversion", lb.observe(model, x, y))
    assert rec.trace["method"].startswith("upstream")
    assert rel(rec.images, x) < 1e-6


def test_all_rows_least_squares_agrees(sample):
    data, x, y = sample
    model = lb.build("mlp:30", input_shape=data.shape, classes=data.num_classes, seed=0, dtype=torch.float64)
    rec = lb.attack("fc-inversion", lb.observe(model, x, y), rows="all")
    assert rel(rec.images, x) < 1e-10


def test_batches_give_affine_combinations_not_samples():
    data = lb.load("photos", size=16)
    x, y = data.batch(4, seed=1)
    x = x.double()
    model = lb.build("mlp:200", input_shape=data.shape, classes=data.num_classes, seed=0, dtype=torch.float64)
    rec = lb.attack("fc-inversion", lb.observe(model, x, y))
    assert not rec.trace["exact"] and "combination" in rec.trace["recovered"]
    assert rec.confidence.tolist() == [0.0] * 4
    flat = x.reshape(4, -1)
    for row in rec.images.reshape(4, -1):
        # row = Σ_m w_m x_m with Σ_m w_m = 1: solve with the sum constraint appended
        a = torch.cat([flat.T, torch.ones(1, 4, dtype=flat.dtype)])
        b = torch.cat([row, torch.ones(1, dtype=row.dtype)])
        w = torch.linalg.lstsq(a, b[:, None]).solution[:, 0]
        assert float((a @ w - b).norm() / b.norm()) < 1e-8
        assert float(w.abs().max()) < 1 - 1e-3 or float((w.abs() > 1e-6).sum()) > 1  # a mixture, not one sample


def test_requirements_explain_before_work(sample):
    data, x, y = sample
    cnn = lb.build("cnn:3-4-1-0", input_shape=data.shape, classes=data.num_classes, seed=0)
    with pytest.raises(UnsupportedThreatModel, match="rgap"):
        lb.attack("fc-inversion", lb.observe(cnn, x.float(), y))
    xb, yb = data.batch(2, seed=0)
    nobias = lb.build("mlp:20", input_shape=data.shape, classes=data.num_classes, bias=False, seed=0)
    with pytest.raises(UnsupportedThreatModel, match="batch 1"):
        lb.attack("fc-inversion", lb.observe(nobias, xb, yb))
    # eq. 5 (no bias) needs δ of one step; eq. 4 (bias) stays exact over local steps (test_fedavg.py)
    with pytest.raises(UnsupportedThreatModel, match="local steps"):
        lb.attack("fc-inversion", lb.observe(nobias, x.float(), y, local_steps=3))


def test_any_sequential_module_works(sample):
    data, x, y = sample
    model = nn.Sequential(nn.Flatten(), nn.Linear(768, 16), nn.Tanh(), nn.Linear(16, data.num_classes)).double()
    rec = lb.attack("fc-inversion", lb.observe(model, x, y))
    assert rel(rec.images, x) < 1e-6
