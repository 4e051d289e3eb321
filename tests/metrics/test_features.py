"""feature_error: mean norm of the true features' component outside the recovered span."""
from __future__ import annotations

import math

import pytest
import torch

from leakbench.errors import ConfigError
from leakbench.metrics.features import feature_error, span_basis


def test_zero_for_any_basis_of_the_same_span():
    gen = torch.Generator().manual_seed(0)
    true = torch.randn(4, 30, generator=gen, dtype=torch.float64)
    mix = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    assert feature_error(mix @ true, true) < 1e-10
    assert feature_error(-3.0 * true[[2, 0, 3, 1]], true) < 1e-10  # order, sign and scale do not matter


def test_one_for_orthogonal_span_and_exact_angle():
    e = torch.eye(6)
    assert feature_error(e[:2], e[2:5]) == pytest.approx(1.0)
    theta = 0.3
    rec = torch.tensor([[math.cos(theta), math.sin(theta), 0.0]])
    assert feature_error(rec, torch.tensor([[5.0, 0.0, 0.0]])) == pytest.approx(math.sin(theta))


def test_robust_to_similar_features_unlike_cosine():
    """Two nearly equal true features: a span containing both scores 0 even if its vectors differ."""
    a = torch.tensor([1.0, 0.0, 0.0])
    b = torch.tensor([1.0, 0.01, 0.0])
    true = torch.stack([a, b])
    rec = torch.stack([a + b, torch.tensor([0.0, 1.0, 0.0])])
    assert feature_error(rec, true) < 1e-10


def test_grows_with_noise():
    gen = torch.Generator().manual_seed(1)
    true = torch.randn(4, 50, generator=gen)
    errs = [feature_error(true + s * torch.randn(4, 50, generator=gen), true) for s in (0.01, 0.1, 1.0)]
    assert errs[0] < errs[1] < errs[2] <= 1.0


def test_span_basis_rank():
    x = torch.randn(5, 10, generator=torch.Generator().manual_seed(2))
    x[4] = x[0] + x[1]
    basis = span_basis(x)
    assert basis.shape == (10, 4)
    assert torch.allclose(basis.T @ basis, torch.eye(4, dtype=basis.dtype), atol=1e-10)


def test_bad_input():
    with pytest.raises(ConfigError, match="dimension"):
        feature_error(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ConfigError, match="recovered"):
        feature_error([1, 2], torch.ones(2, 4))
