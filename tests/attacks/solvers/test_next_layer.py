"""The next layer's structure g_i = D_i ⊙ W₂ᵀv_i: directions of SPEAR's factorisation found from nearby patterns."""
import pytest
import torch

from leakbench.attacks.solvers.next_layer import DROPS, next_layer_directions, usable
from leakbench.attacks.solvers.spear_search import deflated_rows, row_inputs


def _layer(batch=24, inputs=48, width=240, classes=5, seed=0):
    """A one-hidden-layer ReLU MLP's first-layer gradient in float64: (L, W, b, W₂, X, G) with ∂L/∂W = Gᵀ X = L R."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, inputs, generator=g, dtype=torch.float64)
    w = torch.randn(width, inputs, generator=g, dtype=torch.float64) / inputs ** 0.5
    b = torch.randn(width, generator=g, dtype=torch.float64) * 0.1
    w2 = torch.randn(classes, width, generator=g, dtype=torch.float64) / width ** 0.5
    y = torch.arange(batch) % classes
    z = x @ w.T + b
    p = (z.clamp_min(0) @ w2.T).softmax(1)
    delta = (p - torch.nn.functional.one_hot(y, classes).double()) / batch
    grads = (z > 0).double() * (delta @ w2)                       # B×m: ∂L/∂z per sample
    u, s, _ = torch.linalg.svd(torch.cat([grads.T @ x, grads.sum(0)[:, None]], 1), full_matrices=False)
    return u[:, :batch] * s[:batch], w, b, w2, x, grads


def _parallel(left, q, grads):
    """For each direction, the sample whose ∂L/∂z column L q is parallel to, and |cos|."""
    lq = left @ q
    cos = (lq / lq.norm(dim=0)).T @ (grads / grads.norm(dim=1, keepdim=True)).T
    best, which = cos.abs().max(1)
    return which, best


def test_every_sample_is_found_exactly_from_a_nearby_input():
    left, w, b, w2, x, grads = _layer()
    near = x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    flipped = ((near @ w.T + b > 0) != (x @ w.T + b > 0)).double().mean()
    assert flipped > 0.01  # the starts' patterns are wrong on some neurons
    q = next_layer_directions(left, w, b, w2, near)
    which, cos = _parallel(left, q, grads)
    assert (cos > 1 - 1e-10).all()                       # nothing but exact directions is returned
    assert set(which.tolist()) == set(range(len(x)))    # and every sample's is among them


def test_starts_far_from_every_sample_return_no_false_direction():
    left, w, b, w2, x, grads = _layer(seed=2)
    noise = torch.randn(64, x.shape[1], generator=torch.Generator().manual_seed(3), dtype=x.dtype) * 3
    q = next_layer_directions(left, w, b, w2, noise)
    if q.shape[1]:
        _, cos = _parallel(left, q, grads)
        assert (cos > 1 - 1e-10).all()


def test_leaving_out_uncertain_neurons_widens_the_basin():
    """From inputs further away (about a fifth of the neurons flipped), first solves on the most certain neurons
    (the default fractions) find more samples than one solve on every neuron."""
    left, w, b, w2, x, grads = _layer(batch=32, width=300, seed=4)
    far = x + 0.5 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    assert ((far @ w.T + b > 0) != (x @ w.T + b > 0)).double().mean() > 0.2
    found = {}
    for name, drops in (("all neurons", (0.0,)), ("certain neurons", DROPS)):
        q = next_layer_directions(left, w, b, w2, far, drops=drops)
        which, cos = _parallel(left, q, grads)
        assert (cos > 1 - 1e-10).all()
        found[name] = len(set(which.tolist()))
    assert found["certain neurons"] > found["all neurons"]


@pytest.mark.parametrize("rows, rank, width, ok", [(1000, 128, 10, True), (200, 96, 10, False), (100, 8, 0, False)])
def test_the_next_layer_is_used_only_where_its_neurons_outnumber_the_unknowns(rows, rank, width, ok):
    assert usable(rows, rank, width) is ok


def test_the_deflated_rows_are_means_of_the_missing_samples_only():
    """Projected off the found samples' ∂L/∂z columns, every row candidate lies in the span of the *missing*
    samples' inputs (to round-off), which the whole gradient's rows do not."""
    left, w, b, w2, x, grads = _layer(batch=24, inputs=64, width=240, seed=5)
    grad_w, grad_b = grads.T @ x, grads.sum(0)
    found = torch.linalg.lstsq(left, grads[:10].T).solution          # the directions of samples 0–9
    live = grad_w.norm(dim=1) > 0                                     # neurons some sample activates
    missing = torch.linalg.svd(x[10:], full_matrices=False)[2]       # orthonormal basis of the missing inputs

    def off_span(rows):
        return ((rows - rows @ missing.T @ missing).norm(dim=1) / rows.norm(dim=1)).max()

    assert off_span(deflated_rows(left, found, grad_w, grad_b, live, 120)) < 1e-9
    assert off_span(row_inputs(grad_w, grad_b, live, 120)) > 1e-2
