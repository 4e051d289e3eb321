"""Peeling certified samples off a ReLU layer's gradient (exclusive rows, Pan et al. 2022, eq. 6)."""
from __future__ import annotations

import torch
from torch import nn

import leakbench as lb
from leakbench.attacks.solvers.peeling import Residual, SampleGradients, candidate_scale, peel_pass


def _setup(batch: int, seed: int):
    data = lb.load("digits", size=28)
    x, y = data.batch(batch, seed=seed)
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0, dtype=torch.float64)
    x = x.double()
    obs = lb.observe(model, x, y)
    rest = nn.Sequential(nn.ReLU(), model.fc).double()
    grads = SampleGradients(rest, model.fc1.weight.detach(), model.fc1.bias.detach(), "ce", batch, 10)
    return model, x.reshape(batch, -1), y, obs, grads


def test_per_sample_gradients_add_up_to_the_observed_bias_gradient():
    _, x, y, obs, grads = _setup(8, seed=1)
    assert torch.allclose(grads(x, y).sum(0), obs.gradients[1], rtol=1e-10, atol=1e-14)


def test_exclusive_rows_are_certified_and_mixtures_refused():
    _, x, y, obs, grads = _setup(32, seed=5)
    res = Residual.start(obs.gradients[0], obs.gradients[1], 4 * torch.finfo(torch.float64).eps, 0.0)
    assert candidate_scale(res, grads, (0.0, 1.0)) == 1.0
    active = (x @ obs.model.fc1.weight.T + obs.model.fc1.bias > 0)          # B×m, from the originals
    shared = (active.sum(0) >= 2).nonzero().flatten()
    found = peel_pass(res, grads, 1.0, (0.0, 1.0), 32)
    assert found > 0
    peeled = torch.stack(res.inputs)
    dist = torch.cdist(peeled, x, compute_mode="donot_use_mm_for_euclid_dist").min(1)
    assert dist.values.max() < 1e-9                                         # every certified sample is exact
    assert (torch.tensor(res.labels) == y[dist.indices]).all()
    # a row two samples share proposes their weighted mean: its own bias gradient refuses it
    row = int(shared[0])
    mean = obs.gradients[0][row] / obs.gradients[1][row]
    assert torch.cdist(mean[None], x).min() > 1e-3
    assert not (torch.cdist(mean[None], peeled).min() < 1e-6)


def test_peeling_to_the_end_leaves_a_zero_residual():
    _, x, y, obs, grads = _setup(16, seed=3)
    res = Residual.start(obs.gradients[0], obs.gradients[1], 4 * torch.finfo(torch.float64).eps, 0.0)
    while res.count < 16 and peel_pass(res, grads, 1.0, (0.0, 1.0), 16 - res.count):
        pass
    assert res.count == 16
    assert res.grad_w.norm() < 1e-10 * obs.gradients[0].norm()
