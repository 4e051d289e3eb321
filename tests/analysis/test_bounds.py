"""Cramér–Rao lower bounds (Liu et al. 2024, App. D–E) against closed forms, an efficient estimator and Table 1."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev

import leakbench as lb
from leakbench.analysis.bounds import BoundResult, cramer_rao, two_layer_scaling
from leakbench.errors import ConfigError


pytestmark = pytest.mark.usefixtures("one_thread")


def _linear(d=3, k=5, seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(d, k, bias=bias).double()


def _closed_form_jacobian(layer: nn.Linear, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """∂ vec(∇θ ‖Wx + b − t‖²)/∂x for one sample, written out: rows (i, j) of ∇W = 2 r xᵀ, then ∇b = 2 r."""
    W = layer.weight.detach()
    k, d = W.shape
    r = W @ x + (layer.bias.detach() if layer.bias is not None else 0) - t
    eye = torch.eye(d, dtype=x.dtype)
    rows_w = 2 * (W[:, None, :] * x[None, :, None] + r[:, None, None] * eye[None, :, :])  # [i, j, k]
    rows = [rows_w.reshape(k * d, d)]
    if layer.bias is not None:
        rows.append(2 * W)
    return torch.cat(rows)


def _closed_form_fisher(layer: nn.Linear, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """JᵀJ for the squared loss ‖Wx + b − t‖² of one sample: ∇W = 2 r xᵀ, ∇b = 2 r with r = Wx + b − t.

    ∂(2 r_i x_j)/∂x_k = 2 (W_ik x_j + r_i δ_jk) and ∂(2 r_i)/∂x_k = 2 W_ik, hence
    JᵀJ = 4 [(‖x‖² + 1) WᵀW + u xᵀ + x uᵀ + ‖r‖² I] with u = Wᵀ r (without bias: ‖x‖² instead of ‖x‖² + 1).
    """
    W = layer.weight.detach()
    r = W @ x + (layer.bias.detach() if layer.bias is not None else 0) - t
    u = W.T @ r
    scale = x @ x + (1.0 if layer.bias is not None else 0.0)
    return 4 * (scale * W.T @ W + torch.outer(u, x) + torch.outer(x, u) + (r @ r) * torch.eye(x.numel(), dtype=x.dtype))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_linear_model_matches_the_closed_form(bias, batch):
    layer = _linear(bias=bias, seed=batch)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, generator=g, dtype=torch.float64)
    t = torch.randn(batch, 5, generator=g, dtype=torch.float64)  # soft targets: the "mse" loss is ‖f(x) − t‖²
    sigma = 0.3
    res = cramer_rao(layer, x, t, sigma=sigma, loss="mse")
    # the loss is a mean over the batch: J = [J_1 … J_B] / B, the samples' columns side by side
    J = torch.cat([_closed_form_jacobian(layer, x[i], t[i]) for i in range(batch)], dim=1) / batch
    fisher = J.T @ J
    for i in range(batch):  # the diagonal blocks agree with the expanded closed form of JᵢᵀJᵢ
        block = fisher[3 * i:3 * i + 3, 3 * i:3 * i + 3]
        assert torch.allclose(block, _closed_form_fisher(layer, x[i], t[i]) / batch ** 2, rtol=1e-10, atol=1e-12)
    tr_inv = float(torch.linalg.inv(fisher).trace())
    tr = float(fisher.trace())
    D = 3 * batch
    assert res.exact == pytest.approx(math.sqrt(sigma ** 2 * tr_inv / batch), rel=1e-9)
    assert res.trace == pytest.approx(math.sqrt(sigma ** 2 * D ** 2 / tr / batch), rel=1e-9)
    assert res.fisher_trace == pytest.approx(tr, rel=1e-9)
    assert res.exact >= res.trace  # Lemma D.2
    assert res.rank == D and res.dim == 3 and res.batch_size == batch
    assert res.observed == 5 * 3 + (5 if bias else 0)
    assert res.exact_rmse == pytest.approx(res.exact / math.sqrt(3))


def _gauss_newton(observe_fn, target, x0, iterations=4):
    x = x0.clone()
    for _ in range(iterations):
        J = jacrev(observe_fn)(x).reshape(target.numel(), -1)
        r = observe_fn(x) - target
        x = x - torch.linalg.solve(J.T @ J, J.T @ r).reshape(x.shape)
    return x


def test_the_maximum_likelihood_estimator_attains_the_bound_on_a_linear_model():
    """For small σ the MLE (Gauss–Newton least squares on the noisy gradient) is efficient: its MSE is the bound."""
    layer = _linear(d=3, k=4, seed=3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, generator=g, dtype=torch.float64)
    t = torch.randn(1, 4, generator=g, dtype=torch.float64)
    params = {n: p.detach() for n, p in layer.named_parameters()}

    def observed(xs):
        gr = grad(lambda p: ((functional_call(layer, p, (xs,)) - t) ** 2).sum(-1).mean())(params)
        return torch.cat([gr[n].reshape(-1) for n in params])

    sigma, trials = 1e-4, 400
    clean = observed(x)
    noisy = clean + sigma * torch.randn((trials, *clean.shape), generator=g, dtype=torch.float64)
    estimates = torch.func.vmap(lambda o: _gauss_newton(observed, o, x))(noisy)
    mse = float(((estimates - x) ** 2).sum((1, 2)).mean())
    bound = cramer_rao(layer, x, t, sigma=sigma, loss="mse")
    # 400 trials of a 3-dim Gaussian error: the empirical MSE is within ~12 % of its mean
    assert mse == pytest.approx(bound.exact ** 2, rel=0.15)
    assert mse > bound.trace ** 2


def _two_layer(m, d=10, seed=0, act="tanh"):
    return lb.build(f"twolayer:{m}", input_shape=(d,), classes=1, init="gaussian", seed=seed, act=act, bias=False)


def _sphere(batch, d=10, seed=0):
    x = torch.randn(batch, d, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=1, keepdim=True), torch.tensor([[1.0], [-1.0], [1.0], [-1.0]])[:batch]


def test_the_bound_is_linear_in_sigma():
    model = _two_layer(32)
    x, y = _sphere(2)
    results = [cramer_rao(model, x, y, sigma=s, loss="mse") for s in (0.01, 0.1, 1.0)]
    for r, s in zip(results, (0.01, 0.1, 1.0)):
        assert r.exact == pytest.approx(results[-1].exact * s, rel=1e-9)
        assert r.trace == pytest.approx(results[-1].trace * s, rel=1e-9)
    assert cramer_rao(model, x, y, sigma=0.0, loss="mse").exact == 0.0


def test_the_bound_shrinks_with_width_like_sqrt_d_over_m():
    """Theorem 3.2: R_L = Ω̃(σ √(d/m)); the trace bound follows the rate, the exact one decreases too."""
    x, y = _sphere(2)
    widths = [16, 64, 256]
    res = [cramer_rao(_two_layer(m), x, y, sigma=0.1, loss="mse", jacobian="fwd") for m in widths]
    exact = [r.exact for r in res]
    trace = [r.trace for r in res]
    assert exact[0] > exact[1] > exact[2] and trace[0] > trace[1] > trace[2]
    slope = np.polyfit(np.log(widths), np.log(trace), 1)[0]
    assert -0.7 < slope < -0.3, slope  # ≈ −1/2
    assert all(e >= t for e, t in zip(exact, trace))


def test_clipping_scales_the_bound_by_norm_over_C():
    """Lemma E.1: clipping to C < ‖G‖ multiplies the bound by about ‖G‖/C; C ≥ ‖G‖ changes nothing."""
    model = _two_layer(64)
    x, y = _sphere(2)
    plain = cramer_rao(model, x, y, sigma=0.1, loss="mse")
    loose = cramer_rao(model, x, y, sigma=0.1, loss="mse", clip=plain.grad_norm * 2)
    assert loose.exact == pytest.approx(plain.exact, rel=1e-9) and loose.clip_scale == 1.0
    tight = cramer_rao(model, x, y, sigma=0.1, loss="mse", clip=plain.grad_norm / 4)
    assert tight.clip_scale == pytest.approx(4.0)
    assert 3.5 < tight.trace / plain.trace < 5 and 3.5 < tight.exact / plain.exact < 6


def test_pruning_removes_rows_and_raises_the_bound():
    """Lemma E.3: the pruned coordinates' rows leave J; the trace bound is the plain one ÷ √(1 − p̂)."""
    model = _two_layer(64)
    x, y = _sphere(2)
    plain = cramer_rao(model, x, y, sigma=0.1, loss="mse")
    exact, trace = [plain.exact], [plain.trace]
    for p in (0.5, 0.9, 0.95, 0.99):
        r = cramer_rao(model, x, y, sigma=0.1, loss="mse", prune=p)
        n = plain.observed
        assert r.observed == n - math.floor(p * n + 1e-9)
        assert r.trace == pytest.approx(plain.trace / math.sqrt(1 - r.pruned_energy), rel=1e-9)
        exact.append(r.exact)
        trace.append(r.trace)
    # nested masks (the kept sets shrink): the bounds never decrease
    assert all(a <= b * (1 + 1e-12) for a, b in zip(exact, exact[1:]))
    assert all(a <= b * (1 + 1e-12) for a, b in zip(trace, trace[1:]))
    # Remark E.4: little change until the first layer is pruned away (p < d/(d+1)), then a jump
    assert exact[2] / exact[0] < 1.1 and exact[4] / exact[0] > 1.5


def test_jacrev_and_jacfwd_agree_and_cnn_models_work():
    data = lb.load("digits")
    model = lb.build("cnn:3-4-1-1,3-4-2-1", input_shape=data.shape, classes=10, act="tanh", seed=0)
    x, y = data.batch(2, seed=0)
    a = cramer_rao(model, x, y, sigma=0.01)
    b = cramer_rao(model, x, y, sigma=0.01, jacobian="fwd")
    assert isinstance(a, BoundResult) and a.rank == b.rank == 128
    assert a.exact == pytest.approx(b.exact, rel=1e-6) and a.trace == pytest.approx(b.trace, rel=1e-9)
    assert next(model.parameters()).dtype == torch.float32  # the bound works on a float64 copy


def test_an_unidentifiable_batch_has_an_infinite_exact_bound():
    layer = _linear(d=6, k=1, seed=0)  # 7 observed numbers cannot pin down 2 × 6 unknowns
    x = torch.randn(2, 6, dtype=torch.float64)
    r = cramer_rao(layer, x, torch.randn(2, 1, dtype=torch.float64), sigma=0.1, loss="mse")
    assert r.exact == math.inf and r.rank < 12 and math.isfinite(r.trace)


def test_table1_scalings():
    none = two_layer_scaling("none", d=100, m=1000, B=4, sigma=0.5)
    assert none.upper == pytest.approx(4 * math.sqrt(0.1)) and none.lower == pytest.approx(0.5 * math.sqrt(0.1))
    for same in ("local", "secagg"):
        s = two_layer_scaling(same, d=100, m=1000, B=4, sigma=0.5)
        assert s.upper == none.upper and s.lower == none.lower
    noise = two_layer_scaling("noise", d=100, m=1000, B=4, sigma=0.5, sigma0=2)
    assert noise.upper == pytest.approx(6 * math.sqrt(0.1)) and noise.lower == none.lower
    clip = two_layer_scaling("clip", d=100, m=1000, B=4, sigma=0.5, C=2, grad_norm=8)
    assert clip.upper == none.upper and clip.lower == pytest.approx(4 * none.lower)
    assert two_layer_scaling("clip", d=100, m=1000, sigma=0.5, C=20, grad_norm=8).lower == pytest.approx(none.lower)
    dp = two_layer_scaling("dpsgd", d=100, m=1000, B=4, sigma=0.5, sigma0=1, C=2, grad_norm=8)
    assert dp.upper == pytest.approx((4 + 4) * math.sqrt(0.1)) and dp.lower == pytest.approx(4 * none.lower)
    for name in ("dropout", "graddrop"):
        s = two_layer_scaling(name, d=100, m=1000, B=4, sigma=0.5, p=0.75)
        assert s.upper == pytest.approx(2 * none.upper) and s.lower == pytest.approx(2 * none.lower)
    prune = two_layer_scaling("prune", d=100, m=1000, sigma=0.5, p=0.75)
    assert prune.upper is None and prune.lower == pytest.approx(2 * none.lower)
    curve = two_layer_scaling("none", d=10, m=np.array([10, 40, 160]), sigma=1.0)
    assert np.allclose(curve.lower, [1.0, 0.5, 0.25])


@pytest.mark.parametrize("call,match", [
    (lambda: two_layer_scaling("shield", d=1, m=1), "expected defense in"),
    (lambda: two_layer_scaling("clip", d=1, m=1), "needs C and grad_norm"),
    (lambda: two_layer_scaling("prune", d=1, m=1, p=1.0), r"expected p in \[0, 1\)"),
    (lambda: cramer_rao(_linear(), torch.zeros(1, 3), torch.zeros(1, 5), sigma=-1), "expected sigma ≥ 0"),
    (lambda: cramer_rao(_linear(), torch.zeros(1, 3), torch.zeros(1, 5), sigma=1, clip=0), "expected clip > 0"),
    (lambda: cramer_rao(_linear(), torch.zeros(1, 3), torch.zeros(1, 5), sigma=1, prune=1.0), "expected prune in"),
    (lambda: cramer_rao(_linear(), torch.zeros(1, 3), torch.zeros(1, 5), sigma=1, jacobian="x"), "expected jacobian"),
    (lambda: cramer_rao(_linear(), torch.zeros(3), torch.zeros(1, 5), sigma=1), "expected a batch x"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ConfigError, match=match):
        call()
