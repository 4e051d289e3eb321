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


@pytest.mark.parametrize("spec,act", [
    pytest.param("cnn:3-6-1-0", "tanh", marks=pytest.mark.slow),              # CNN2 V1: full rank, tall
    ("cnn:4-6-2-0", "tanh"),                      # CNN2 V2: rank deficient, wide, dependent rows
    pytest.param("cnn:4-6-2-0,3-3-2-0", "tanh", marks=pytest.mark.slow),      # CNN3 V2: two rank-deficient layers
    ("cnn:3-1-1-0,3-6-1-0", "leaky-relu"),        # CNN3 V4: a one-channel layer, rank-deficient input layer
    pytest.param("cnn:3-6-1-0,3-9-1-0", "relu", marks=pytest.mark.slow),      # ReLU: only active rows
])
def test_gram_solver_equals_the_svd_path(sample, spec, act):
    """The default solver (pivoted Cholesky of the sparse Gram) gives gelsd's reconstruction and ranks."""
    data, x, y = sample
    ref = run(data, x, y, spec, act=act, solver="gelsd")
    new = run(data, x, y, spec, act=act)
    torch.testing.assert_close(new.images, ref.images, rtol=1e-9, atol=1e-9 * float(ref.images.abs().max()))
    for a, b in zip(new.trace["layers"], ref.trace["layers"]):
        assert a.get("rank") == b.get("rank") and a.get("solver", "gram") == "gram"
    if spec != "cnn:3-6-1-0":
        assert any(layer.get("rank_deficiency", 0) < 0 for layer in new.trace["layers"])


def test_gram_solver_is_the_minimum_norm_solution_of_random_rank_deficient_systems():
    """Against numpy's SVD pseudo-inverse: tall and wide, consistent and not, rank-deficient sparse systems."""
    import numpy as np
    import scipy.sparse as sp

    from leakbench.attacks.gradient.rgap import least_squares

    rng = np.random.default_rng(0)
    for m, n, r in ((300, 120, 100), (80, 200, 60), (150, 150, 150)):
        low = sp.random(m, r, density=0.1, random_state=rng) @ sp.random(r, n, density=0.2, random_state=rng)
        a = sp.csr_matrix(low + sp.csr_matrix((m, n)))
        rank = np.linalg.matrix_rank(a.toarray())
        b = rng.standard_normal(m)  # generally inconsistent
        found = least_squares(a, torch.from_numpy(b))
        expected = np.linalg.pinv(a.toarray(), rcond=1e-10) @ b
        assert found.solver == "gram" and found.rank == rank
        np.testing.assert_allclose(found.solution.numpy(), expected, rtol=1e-8, atol=1e-10 * np.abs(expected).max())


def test_gram_solver_hands_unclear_ranks_to_gelsd():
    """A singular value between the rank tolerance and its safety gap: the SVD solver decides."""
    import numpy as np

    from leakbench.attacks.gradient.rgap import least_squares

    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.standard_normal((60, 40)))
    v, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    s = np.ones(40)
    s[-1] = 1e-6  # σ²/σ₁² = 1e-12: above dpstrf's tolerance (~4e-15), inside the 1e4 gap
    a = torch.from_numpy((u * s) @ v.T)
    b = torch.from_numpy(rng.standard_normal(60))
    found = least_squares(a, b)
    ref = torch.linalg.lstsq(a, b[:, None], rcond=1e-10, driver="gelsd")
    assert found.solver.startswith("gelsd") and found.rank == int(ref.rank) == 40
    torch.testing.assert_close(found.solution, ref.solution[:, 0])


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
