"""R-GAP: exact where the per-layer systems are full rank, degraded where they are not."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.errors import ConfigError, UnsupportedThreatModel

PAPER_BIAS = {"conv": False, "linear": True}


@pytest.fixture(scope="module")
def sample():
    data = lb.load("photos", size=16)
    x, y = data.batch(1, seed=2)
    return data, x.double(), y


def run(data, x, y, spec, *, act="tanh", bias=PAPER_BIAS, **options):
    model = lb.build(spec, input_shape=data.shape, classes=data.num_classes, act=act, bias=bias, init="uniform",
                     seed=0, dtype=torch.float64)
    return lb.attack("rgap", lb.observe(model, x, y), **options)


def mse(a, b):
    return float(((a - b) ** 2).mean())


def test_full_rank_cnn2_variant1_is_near_exact(sample):
    data, x, y = sample
    rec = run(data, x, y, "cnn:3-6-1-0")  # CNN2 Variant 1 of Chen & Campbell, Table 1
    assert float((rec.images - x).norm() / x.norm()) < 1e-6
    conv = rec.trace["layers"][0]
    assert conv["rank_deficiency"] == 0 and rec.trace["exact"]


@pytest.mark.parametrize("act,bias", [("leaky-relu", True), ("sigmoid", PAPER_BIAS), ("tanh", False)])
def test_full_rank_two_conv_layers_with_other_activations(sample, act, bias):
    data, x, y = sample
    rec = run(data, x, y, "cnn:3-6-1-0,3-9-1-0", act=act, bias=bias)  # CNN3 Variant 3 shape
    assert float((rec.images - x).norm() / x.norm()) < 1e-5


def test_rank_deficient_cnn_is_visibly_degraded(sample):
    data, x, y = sample
    exact = run(data, x, y, "cnn:3-6-1-0")
    deficient = run(data, x, y, "cnn:4-6-2-0")  # CNN2 Variant 2: rank deficiency < 0
    assert deficient.trace["layers"][0]["rank_deficiency"] < 0 and not deficient.trace["exact"]
    assert mse(deficient.images, x) > 1e-3 > 1e6 * mse(exact.images, x)


def test_solvers_agree_and_pinv_runs_anywhere(sample):
    data, x, y = sample
    a = run(data, x, y, "cnn:4-6-2-0", solver="gelsd")
    b = run(data, x, y, "cnn:4-6-2-0", solver="pinv")
    torch.testing.assert_close(a.images, b.images, rtol=1e-6, atol=1e-6)


def test_default_solver_rank_and_residual_match_an_svd(sample, monkeypatch):
    from leakbench.attacks.gradient import rgap

    data = sample[0]
    x, y = data.batch(1, seed=0)
    x = x.double()
    seen = {}
    solve = rgap.least_squares

    def spy(a, b, **kw):
        seen["a"], seen["b"] = a, b
        return solve(a, b, **kw)

    monkeypatch.setattr(rgap, "least_squares", spy)
    rec = run(data, x, y, "cnn:4-6-2-0")  # rank deficient: gelsy's rank estimate missed here
    conv = rec.trace["layers"][0]
    s = torch.linalg.svdvals(seen["a"])
    assert conv["rank"] == int((s > 1e-10 * s[0]).sum()) < conv["unknowns"]
    assert conv["residual"] < 1e-10  # the true image solves the system, so least squares must too


def test_float32_observation_and_plain_module(sample):
    data, x, y = sample
    model = nn.Sequential(nn.Conv2d(3, 5, 3, bias=False), nn.LeakyReLU(0.2), nn.Flatten(),
                          nn.Linear(5 * 14 * 14, data.num_classes))
    rec = lb.attack("rgap", lb.observe(model, x.float(), y))
    assert rec.images.dtype == torch.float32
    assert float((rec.images - x.float()).norm() / x.norm()) < 1e-3


def test_requirements_and_options(sample):
    data, x, y = sample
    model = lb.build("cnn:3-6-1-0", input_shape=data.shape, classes=data.num_classes, act="tanh", seed=0)
    xb, yb = data.batch(2, seed=0)
    with pytest.raises(UnsupportedThreatModel, match="batch 1"):
        lb.attack("rgap", lb.observe(model, xb, yb))
    pooled = lb.build("convnet-4", input_shape=data.shape, classes=data.num_classes, seed=0, norm=False)
    with pytest.raises(UnsupportedThreatModel, match="MaxPool2d"):
        lb.attack("rgap", lb.observe(pooled, x.float(), y))
    with pytest.raises(ConfigError, match="solver"):
        lb.attack("rgap", lb.observe(model, x.float(), y), solver="magic")
