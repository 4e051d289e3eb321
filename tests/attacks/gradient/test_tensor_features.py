"""Tensor method (Wang et al. 2023; Liu et al. 2024 App. B): unit-norm features of a random two-layer block."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.optimize import linear_sum_assignment

import leakbench as lb
from leakbench.attacks.gradient.tensor_features import block_input, hermite_coefficients, hermite_orders
from leakbench.metrics import feature_error
from leakbench.models.malicious import RandomFeatureHead, find_module, random_head


def _two_layer_obs(d, batch, m, *, act="relu", seed=0, classes=1, positive=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d, generator=gen)
    x = x.abs() if positive else x
    x = x / x.norm(dim=1, keepdim=True)
    model = lb.build(f"twolayer:{m}", input_shape=(d,), classes=classes, act=act, init="gaussian", bias=False,
                     seed=seed)
    if classes == 1:
        y = torch.randn(batch, 1, generator=gen).sign()
        return x, lb.observe(model, x, y, loss="mse")
    y = torch.randint(0, classes, (batch,), generator=gen)
    return x, lb.observe(model, x, y, loss="ce")


def _matched(features, x):
    """|cos| after the best matching, and the RMS error after fixing each sign."""
    cos = features.double() @ x.double().T
    rows, cols = linear_sum_assignment(-cos.abs().numpy())
    f, t = features.double()[rows], x.double()[cols]
    f = f * torch.sign((f * t).sum(1, keepdim=True))
    return cos.abs()[rows, cols], float((f - t).norm(dim=1).pow(2).mean().sqrt())


@pytest.mark.parametrize("d,batch,m,act,classes", [(20, 2, 20_000, "relu", 1), (50, 4, 200_000, "relu", 1),
                                                    (30, 4, 200_000, "tanh", 1), (30, 3, 100_000, "relu", 10)])
def test_recovers_unit_norm_inputs_of_a_two_layer_net(d, batch, m, act, classes):
    x, obs = _two_layer_obs(d, batch, m, act=act, classes=classes)
    rec = lb.attack("tensor-features", obs)
    feats = rec.trace["features"]
    assert feats.shape == (batch, d) and rec.images.shape == (batch, d)
    assert torch.allclose(feats.norm(dim=1), torch.ones(batch), atol=1e-5)
    cos, _ = _matched(feats, x)
    assert float(cos.min()) >= 0.95, cos


@pytest.mark.parametrize("d,batch,m,classes,seed", [(20, 3, 50_000, 1, 0), (30, 4, 200_000, 1, 1),
                                                     (30, 3, 100_000, 10, 2)])
def test_relu_features_come_with_their_signs_from_the_first_moment(d, batch, m, classes, seed):
    """Gaussian inputs have either sign; the first Hermite moment tells each feature from its mirror."""
    x, obs = _two_layer_obs(d, batch, m, classes=classes, seed=seed)
    rec = lb.attack("tensor-features", obs, seed=seed)
    assert rec.trace["feature_signs"] == "first moment"
    cos = rec.trace["features"].double() @ x.double().T
    rows, cols = linear_sum_assignment(-cos.abs().numpy())
    assert float(cos[rows, cols].min()) > 0.9, cos[rows, cols]          # signed cosines: every sign right


def test_tanh_features_fall_back_to_a_positive_sum():
    """tanh has no first-order sign vote; the positive-sum convention is the true sign of non-negative features:
    every recovered feature then points the way of its input (signed cosine, not |cos|)."""
    x, obs = _two_layer_obs(30, 3, 50_000, act="tanh", positive=True)
    rec = lb.attack("tensor-features", obs, preset="quick")
    assert rec.trace["feature_signs"] == "positive sum"
    cos = rec.trace["features"].double() @ x.double().T
    rows, cols = linear_sum_assignment(-cos.abs().numpy())
    assert float(cos[rows, cols].min()) > 0.8, cos[rows, cols]


def _error(d, b, m, seed):
    x, obs = _two_layer_obs(d, b, m, seed=seed)
    return _matched(lb.attack("tensor-features", obs, preset="quick", seed=seed).trace["features"], x)[1]


def test_error_grows_with_batch_and_shrinks_with_width():
    """Three corners of the grid below (one seed): B 1 → 4 at m = 160k, m 160k → 10k at B = 4."""
    small, big, narrow = _error(30, 1, 160_000, 0), _error(30, 4, 160_000, 0), _error(30, 4, 10_000, 0)
    assert small < big < narrow
    assert narrow > 3 * big  # 16× fewer neurons: sqrt(16) = 4× the error predicted


@pytest.mark.slow
def test_error_grows_with_batch_and_shrinks_with_width_as_b_sqrt_d_over_m():
    """Mean error over 2 seeds on a grid B ∈ {1, 2, 4} × m ∈ {10k, 40k, 160k}, d = 30."""
    d, batches, widths = 30, (1, 2, 4), (10_000, 40_000, 160_000)
    err = {}
    for b in batches:
        for m in widths:
            runs = [_error(d, b, m, seed) for seed in range(2)]
            err[b, m] = sum(runs) / len(runs)
    for b in batches:  # shrinks with m
        assert err[b, widths[0]] > err[b, widths[1]] > err[b, widths[2]], err
    for m in widths:   # grows with B
        assert err[batches[0], m] < err[batches[-1], m], err
    # the constant of the B·sqrt(d/m) rate stays bounded across the grid
    ratios = [err[b, m] / (b * math.sqrt(d / m)) for b in batches for m in widths]
    assert 0.5 < min(ratios) and max(ratios) < 8, ratios
    # and one-sample error halves (within a wide margin) for every 4× width, the sqrt(1/m) rate
    slope = math.log(err[1, widths[2]] / err[1, widths[0]]) / math.log(widths[2] / widths[0])
    assert -0.9 < slope < -0.3, slope


def test_recovers_penultimate_features_inside_a_deeper_model():
    """An MLP feature extractor + Liu et al.'s partly random head: the recovered span holds the true
    features far better than another batch's features do (features of random nets are much alike)."""
    ds = lb.load("photos", size=16)
    model = lb.build("mlp:48", input_shape=ds.shape, classes=ds.num_classes, act="tanh", seed=0)
    shipped = random_head(model, width=40_000, seed=0)
    head = find_module(shipped, RandomFeatureHead)
    x, y = ds.batch(4, seed=2)
    other, _ = ds.batch(4, seed=12)
    obs = lb.observe(shipped, x, y)
    rec = lb.attack("tensor-features", obs, inversion_iterations=20)
    z = block_input(obs.model, find_module(obs.model, RandomFeatureHead), x).detach()
    z_other = block_input(shipped, head, other).detach()
    assert rec.trace["features"].shape == (4, 48)
    err = feature_error(rec.trace["features"], z)
    assert err < 0.2 and err < 0.5 * feature_error(z_other, z)
    cos, _ = _matched(rec.trace["features"], torch.nn.functional.normalize(z, dim=1))
    assert float(cos.mean()) > 0.95
    assert rec.images.shape == x.shape and float(rec.images.min()) >= 0 and float(rec.images.max()) <= 1


def test_hermite_orders_follow_the_activation():
    assert hermite_orders(torch.relu) == (2, 4)
    assert hermite_orders(torch.tanh) == (3, 3)
    assert hermite_orders(torch.sigmoid) == (3, 3)
    assert hermite_orders(torch.nn.functional.softplus) == (2, 4)  # softplus(z) − z/2 is even
    assert hermite_orders(lambda z: torch.exp(z / 2)) == (2, 3)
    assert hermite_orders(lambda z: z) is None
    mu = hermite_coefficients(torch.relu)
    assert mu[2] == pytest.approx(1 / math.sqrt(2 * math.pi), rel=1e-4)   # E[relu''] = φ(0)
    assert mu[4] == pytest.approx(-1 / math.sqrt(2 * math.pi), rel=1e-3)  # E[relu''''] = φ''(0)


def test_requirements_explain_why_not():
    x = torch.rand(2, 10)
    y = torch.tensor([0, 1])
    uniform = lb.build("twolayer:200", input_shape=(10,), classes=2, bias=False, seed=0)  # pytorch init: uniform
    reasons = lb.attacks.create("tensor-features").requirements(lb.observe(uniform, x, y))
    assert any("Gaussian" in r for r in reasons)
    linear = lb.build("twolayer:200", input_shape=(10,), classes=2, bias=False, act="identity", init="gaussian")
    assert any("activation" in r for r in lb.attacks.create("tensor-features").requirements(lb.observe(linear, x, y)))
    biased = lb.build("twolayer:200", input_shape=(10,), classes=2, init="gaussian", seed=0)
    with torch.no_grad():
        biased.first.bias.fill_(0.1)
    assert any("bias" in r for r in lb.attacks.create("tensor-features").requirements(lb.observe(biased, x, y)))
    plain = lb.build("mlp:20", input_shape=(10,), classes=2, seed=0)
    with pytest.raises(lb.UnsupportedThreatModel, match="random_head"):
        lb.attack("tensor-features", lb.observe(plain, x, y))


def _hermite_brute(w: torch.Tensor, order: int) -> torch.Tensor:
    """Multivariate probabilists' Hermite tensor of ``w`` (n,) by its definition, orders 3 and 4."""
    n = w.numel()
    eye = torch.eye(n, dtype=w.dtype)
    if order == 3:
        t = torch.einsum("i,j,k->ijk", w, w, w)
        return t - (torch.einsum("i,jk->ijk", w, eye) + torch.einsum("j,ik->ijk", w, eye)
                    + torch.einsum("k,ij->ijk", w, eye))
    t = torch.einsum("i,j,k,l->ijkl", w, w, w, w)
    pairs = ["ij,k,l->ijkl", "ik,j,l->ijkl", "il,j,k->ijkl", "jk,i,l->ijkl", "jl,i,k->ijkl", "kl,i,j->ijkl"]
    for p in pairs:
        t = t - torch.einsum(p, eye, w, w)
    return t + (torch.einsum("ij,kl->ijkl", eye, eye) + torch.einsum("ik,jl->ijkl", eye, eye)
                + torch.einsum("il,jk->ijkl", eye, eye))


def test_projected_moments_match_the_hermite_definition():
    from leakbench.attacks.solvers.tensor_moments import _fourth_moment_along, _third_moment

    gen = torch.Generator().manual_seed(0)
    u = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    g = torch.randn(7, generator=gen, dtype=torch.float64)
    b = torch.nn.functional.normalize(torch.randn(3, generator=gen, dtype=torch.float64), dim=0)
    third = sum(gj * _hermite_brute(uj, 3) for gj, uj in zip(g, u)) / 7
    fourth = sum(gj * _hermite_brute(uj, 4) for gj, uj in zip(g, u)) / 7
    assert torch.allclose(_third_moment(g, u), third, atol=1e-12)
    assert torch.allclose(_fourth_moment_along(g, u, b), torch.einsum("ijkl,l->ijk", fourth, b), atol=1e-12)
