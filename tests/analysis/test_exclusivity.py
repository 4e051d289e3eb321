"""Exclusivity analysis (Pan et al. 2022): ExAN counts and Theorem 2's gradient-invariant space."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.analysis import ExclusivityReport, exclusivity
from leakbench.errors import ConfigError, UnsupportedThreatModel


def small_net(d0=12, d1=5, width=30, classes=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d0, d1), nn.ReLU(), nn.Linear(d1, width), nn.ReLU(),
                         nn.Linear(width, classes)).double()


def test_exan_counts_match_a_direct_count():
    data = lb.load("digits", size=16)
    x, y = data.batch(6, seed=0)
    model = lb.build("mlp:300-200", input_shape=data.shape, classes=10, seed=0)
    report = exclusivity(model, x, y)
    assert isinstance(report, ExclusivityReport) and report.widths == [256, 300, 200]
    h = x.reshape(6, -1)
    for k, layer in enumerate([model.fc1, model.fc2]):
        h = torch.relu(layer(h))
        active = h > 0
        for m in range(6):
            assert report.exans[m][k] == int((active[m] & (active.sum(0) == 1)).sum())
    for m, counts in enumerate(report.exans):
        assert report.reconstructable[m] == (counts[-1] >= 2 and counts[0] >= 1)
    assert not report.theorem2_applies and report.theorem2_dim == 0 and report.paper_dim == 0


@pytest.mark.parametrize("M,seed", [(8, 0), (10, 1), (4, 2)])
def test_theorem2_dimension_matches_a_brute_force_null_space(M, seed):
    d0, d1 = 12, 5
    model = small_net(d0, d1, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(M, d0, generator=g, dtype=torch.float64)
    y = torch.arange(M) % 4
    report = exclusivity(model, x, y)
    # brute force: the linear map Δ ↦ (W_0 Δ, A Δᵀ) on vec(Δ), Δ of shape d0 × M, and its nullity
    w0 = model[0].weight.detach()
    z1 = model[0](x).detach().requires_grad_(True)
    loss = nn.functional.cross_entropy(model[2:](torch.relu(z1)), y, reduction="sum")
    (alphas,) = torch.autograd.grad(loss, z1)  # M × d1
    maps = []
    for idx in range(d0 * M):
        delta = torch.zeros(d0, M, dtype=torch.float64).reshape(-1)
        delta[idx] = 1
        delta = delta.reshape(d0, M)
        maps.append(torch.cat([(w0 @ delta).reshape(-1), (alphas.T @ delta.T).reshape(-1)]))
    big = torch.stack(maps, dim=1)
    nullity = d0 * M - int(torch.linalg.matrix_rank(big))
    assert report.theorem2_dim == nullity
    assert report.paper_dim == M * (d0 - d1) and report.theorem2_applies
    if nullity:
        assert report.theorem2_dim < report.paper_dim  # the paper's figure ignores A Δᵀ = 0


def test_largest_perturbation_keeps_every_gradient_and_the_box():
    d0, d1, M = 12, 3, 8
    model = small_net(d0, d1, seed=4)
    x = torch.rand(M, d0, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.6 + 0.2
    y = torch.arange(M) % 4
    report = exclusivity(model, x, y)
    assert report.theorem2_dim > 0 and report.max_perturbation > 0.1
    moved = x + report.perturbation
    assert float(moved.min()) >= -1e-9 and float(moved.max()) <= 1 + 1e-9
    a, b = lb.observe(model, x, y), lb.observe(model, moved, y)
    for ga, gb in zip(a.shared, b.shared):
        torch.testing.assert_close(ga, gb, rtol=1e-9, atol=1e-12)
    assert report.max_perturbation_mean_sq == pytest.approx(float(report.perturbation.pow(2).sum()) / M)
    assert "perturbation" not in report.to_dict()


def test_bad_inputs():
    with pytest.raises(UnsupportedThreatModel, match="ReLU"):
        exclusivity(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)), torch.rand(2, 4))
    with pytest.raises(ConfigError, match="box"):
        exclusivity(small_net(), torch.rand(2, 12, dtype=torch.float64), box=(1, 0))
    with pytest.raises(ConfigError, match="label"):
        exclusivity(small_net(), torch.rand(2, 12, dtype=torch.float64), torch.tensor([0, 1, 2]))
