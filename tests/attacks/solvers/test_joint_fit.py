"""The whole batch fitted to the whole first-layer gradient (Gauss–Newton through δ(X)), and each sample's
precision from the even and odd rows."""
import pytest
import torch
from torch import nn

from leakbench.attacks.solvers.joint_fit import fit_batch, split_precision
from leakbench.attacks.solvers.peeling import SampleGradients


def _setting(batch=12, inputs=30, width=120, classes=4, seed=0):
    """A float64 ReLU MLP, each sample labelled with its own top class and the logits large (a trained model's
    confidently classified samples: ‖δ_i‖ spread over orders of magnitude), the batch's exact gradient, the batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, inputs, generator=g, dtype=torch.float64)
    w = torch.randn(width, inputs, generator=g, dtype=torch.float64) / inputs ** 0.5
    b = torch.randn(width, generator=g, dtype=torch.float64) * 0.1
    rest = nn.Sequential(nn.ReLU(), nn.Linear(width, classes)).double()
    torch.nn.init.normal_(rest[1].weight, generator=g, std=20 / width ** 0.5)
    grads = SampleGradients(rest, w, b, "ce", batch, classes)
    with torch.no_grad():
        y = rest(x @ w.T + b).argmax(1)
    delta = grads(x, y)
    return grads, x, y, delta.T @ x, delta.sum(0)


def test_the_hessian_product_is_the_loss_hessian_in_the_pre_activations():
    grads, x, y, _, _ = _setting(batch=3, inputs=5, width=7)
    u = torch.randn(3, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    product = grads.hessian_product(x, y)(u)
    for i in range(3):   # the independent computation: torch.func.hessian of sample i's own loss term
        def loss(z, i=i):
            return torch.nn.functional.cross_entropy(grads.rest(z[None]), y[i:i + 1]) / 3
        hess = torch.func.hessian(loss)(x[i] @ grads.weight.T + grads.bias)
        assert torch.allclose(product[i], hess @ u[i], rtol=1e-10, atol=1e-14)


def test_gauss_newton_recovers_the_batch_where_fixed_deltas_stall():
    grads, x, y, target_w, target_b = _setting()
    start = x + 1e-5 * torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(2))
    fit = fit_batch(grads, start, y, target_w, target_b, reach=1e-4, inner=400)   # CGLS to convergence
    assert fit.steps >= 2 and fit.residual < 1e-12 * float(target_w.norm())
    assert float((fit.inputs - x).abs().max()) < 1e-9
    # the fixed-Δ alternation it replaces, from the same start, for as many re-solves
    alt = start
    for _ in range(fit.steps):
        alt = torch.linalg.lstsq(grads(alt, y).T, target_w).solution
    assert float((alt - x).abs().max()) > 1e4 * float((fit.inputs - x).abs().max())
    # with the default inner iterations a sample whose δ is 1e-6 converges slowest; the others are exact already
    quick = fit_batch(grads, start, y, target_w, target_b, reach=1e-4)
    strong = grads(x, y).norm(dim=1) > 1e-3
    assert quick.residual < 1e-3 * float((target_w - grads(start, y).T @ start).norm())
    assert float((quick.inputs - x)[strong].abs().max()) < 1e-6


def test_the_best_point_is_kept_and_the_truth_stays_put():
    grads, x, y, target_w, target_b = _setting(seed=3)
    fit = fit_batch(grads, x, y, target_w, target_b, reach=1e-6)
    assert fit.steps <= 1 and float((fit.inputs - x).abs().max()) < 1e-12


def test_split_precision_follows_the_gradients_error():
    grads, x, y, target_w, target_b = _setting(width=400, seed=4)
    noise = torch.randn(target_w.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(5))
    deltas = grads(x, y)
    for level in (1e-10, 1e-8):
        observed = target_w + level * noise
        solved = torch.linalg.lstsq(deltas.T, observed).solution
        error = (solved - x).abs().amax(1)
        spread = split_precision(deltas, observed)
        ratio = (spread / error)[error < 1e-2]          # the samples the gradient pins at all
        assert ratio.numel() >= 6 and float(ratio.min()) > 0.2 and float(ratio.max()) < 20
    assert torch.isinf(split_precision(deltas[:, :20].repeat(1, 1), target_w[:20])).all()   # 10 rows a half < 12


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_start_is_returned_unchanged(bad):
    grads, x, y, target_w, target_b = _setting(seed=6)
    start = x.clone()
    start[0, 0] = bad
    fit = fit_batch(grads, start, y, target_w, target_b, reach=1e-6)
    assert fit.steps == 0
