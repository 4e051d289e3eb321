"""Objective terms of gradient matching, each against a hand computation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from leakbench.attacks.solvers.objectives import (DISTANCES, GradientDistance, bn_statistics, layer_weights,
                                                  total_variation)
from leakbench.errors import ConfigError


def _tensors(seed: int, shapes=((3, 4), (4,), (2, 3, 2, 2))) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


@pytest.fixture
def target() -> list[torch.Tensor]:
    return _tensors(0)


@pytest.fixture
def dummy() -> list[torch.Tensor]:
    return _tensors(1)


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def test_l2_equals_hand_sum(target, dummy):
    expected = sum(float(((d - t) ** 2).sum()) for d, t in zip(dummy, target))
    assert GradientDistance(target, kind="l2")(dummy).item() == pytest.approx(expected, rel=1e-12)
    w = [0.5, 2.0, 3.0]
    expected_w = sum(wi * float(((d - t) ** 2).sum()) for wi, d, t in zip(w, dummy, target))
    assert GradientDistance(target, kind="l2", weights=w)(dummy).item() == pytest.approx(expected_w, rel=1e-12)


def test_cosine_equals_one_minus_cosine_of_concatenation(target, dummy):
    expected = 1 - F.cosine_similarity(_flat(dummy), _flat(target), dim=0)
    assert GradientDistance(target, kind="cosine")(dummy).item() == pytest.approx(expected.item(), rel=1e-10)


def test_weighted_cosine_is_cosine_of_sqrt_weighted_vectors(target, dummy):
    w = [0.25, 4.0, 1.0]
    scale = lambda ts: [t * w_ ** 0.5 for t, w_ in zip(ts, w)]  # noqa: E731
    expected = 1 - F.cosine_similarity(_flat(scale(dummy)), _flat(scale(target)), dim=0)
    assert GradientDistance(target, kind="cosine", weights=w)(dummy).item() == pytest.approx(expected.item(), rel=1e-10)


def test_cosine_layer_with_equal_weights_is_mean_of_per_tensor_terms(target, dummy):
    per = [1 - F.cosine_similarity(d.reshape(-1), t.reshape(-1), dim=0) for d, t in zip(dummy, target)]
    expected = torch.stack(per).mean()
    got = GradientDistance(target, kind="cosine-layer", weights=layer_weights("equal", target))(dummy)
    assert got.item() == pytest.approx(expected.item(), rel=1e-10)
    # the default weights are equal ones
    assert GradientDistance(target, kind="cosine-layer")(dummy).item() == pytest.approx(expected.item(), rel=1e-10)


def test_cosine_layer_with_weights_is_weighted_mean(target, dummy):
    w = [1.0, 3.0, 6.0]
    per = [1 - F.cosine_similarity(d.reshape(-1), t.reshape(-1), dim=0).item() for d, t in zip(dummy, target)]
    expected = sum(wi * p for wi, p in zip(w, per)) / sum(w)
    assert GradientDistance(target, kind="cosine-layer", weights=w)(dummy).item() == pytest.approx(expected, rel=1e-10)


def test_zero_weight_tensors_are_ignored(target, dummy):
    w = [1.0, 0.0, 1.0]
    changed = [dummy[0], dummy[1] * 100 + 5, dummy[2]]
    for kind in DISTANCES:
        d = GradientDistance(target, kind=kind, weights=w)
        assert d(changed).item() == pytest.approx(d(dummy).item(), rel=1e-12)
    # and equal the distance on the other tensors alone
    alone = GradientDistance([target[0], target[2]], kind="cosine")([dummy[0], dummy[2]])
    assert GradientDistance(target, kind="cosine", weights=w)(dummy).item() == pytest.approx(alone.item(), rel=1e-12)


def test_l0_weights_are_nonzero_counts():
    p = [torch.tensor([[0.0, 1.0], [2.0, 0.0]]), torch.zeros(5), torch.tensor([3.0, -1.0, 0.5])]
    assert layer_weights("l0", p) == [2.0, 0.0, 3.0]
    assert layer_weights("equal", p) == [1.0, 1.0, 1.0]
    assert layer_weights([1, 2, 3], p) == [1.0, 2.0, 3.0]
    with pytest.raises(ConfigError, match="expected 3 layer weights"):
        layer_weights([1.0, 2.0], p)
    with pytest.raises(ConfigError, match="got 'l1'"):
        layer_weights("l1", p)


def test_unknown_distance_kind():
    with pytest.raises(ConfigError, match="expected distance in"):
        GradientDistance([torch.ones(2)], kind="l1")


@pytest.mark.parametrize("kind", DISTANCES)
def test_identical_gradients_give_zero(target, kind):
    same = [t.clone() for t in target]
    assert abs(GradientDistance(target, kind=kind)(same).item()) < 1e-12
    assert abs(GradientDistance(target, kind=kind, weights=[2.0, 0.5, 1.0])(same).item()) < 1e-12


@pytest.mark.parametrize("kind", ["cosine", "cosine-layer"])
def test_cosine_is_scale_invariant(target, dummy, kind):
    dist = GradientDistance(target, kind=kind)
    base = dist(dummy).item()
    for c in (1e-3, 0.7, 50.0):
        assert dist([d * c for d in dummy]).item() == pytest.approx(base, rel=1e-10)
    # and bounded: the opposite gradient is at distance 2
    assert dist([-t for t in target]).item() == pytest.approx(2.0, rel=1e-12)


def test_cosine_layer_is_invariant_to_per_tensor_scales(target, dummy):
    dist = GradientDistance(target, kind="cosine-layer")
    scaled = [d * c for d, c in zip(dummy, (0.01, 3.0, 200.0))]
    assert dist(scaled).item() == pytest.approx(dist(dummy).item(), rel=1e-10)


@pytest.mark.parametrize("kind", DISTANCES)
def test_distances_are_differentiable(target, kind):
    dummy = [t.detach().clone().add_(0.3).requires_grad_(True) for t in _tensors(2)]
    dist = GradientDistance(target, kind=kind, weights=[1.0, 2.0, 0.5])
    assert torch.autograd.gradcheck(lambda *ds: dist(list(ds)), tuple(dummy))


def _tv_by_hand(x: np.ndarray) -> float:
    b, c, h, w = x.shape
    dx = [abs(x[i, k, r, s + 1] - x[i, k, r, s]) for i in range(b) for k in range(c) for r in range(h)
          for s in range(w - 1)]
    dy = [abs(x[i, k, r + 1, s] - x[i, k, r, s]) for i in range(b) for k in range(c) for r in range(h - 1)
          for s in range(w)]
    return sum(dx) / len(dx) + sum(dy) / len(dy)


def test_total_variation_equals_hand_computation():
    x = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert total_variation(x).item() == pytest.approx(_tv_by_hand(x.numpy()), rel=1e-12)


def test_total_variation_zero_for_constant_and_vectors():
    assert total_variation(torch.full((2, 3, 6, 6), 0.37)).item() == 0.0
    assert total_variation(torch.rand(4, 10)).item() == 0.0
    # a vertical edge only: horizontal differences only in one column pair
    x = torch.zeros(1, 1, 3, 4)
    x[..., 2:] = 1.0
    assert total_variation(x).item() == pytest.approx(3 / 9)


def test_bn_statistics_equals_hand_computation():
    g = torch.Generator().manual_seed(0)
    dummy = [(torch.randn(4, generator=g), torch.rand(4, generator=g)), (torch.randn(6, generator=g), torch.rand(6, generator=g))]
    target = [(torch.randn(4, generator=g), torch.rand(4, generator=g)), (torch.randn(6, generator=g), torch.rand(6, generator=g))]
    expected = 0.0
    for (m, v), (mt, vt) in zip(dummy, target):
        expected += np.sqrt(((m.numpy() - mt.numpy()) ** 2).sum()) + np.sqrt(((v.numpy() - vt.numpy()) ** 2).sum())
    assert bn_statistics(dummy, target).item() == pytest.approx(expected, rel=1e-6)
    assert bn_statistics(target, target).item() == 0.0


@pytest.mark.parametrize("kind", DISTANCES)
@pytest.mark.parametrize("weights", [None, [0.5, 2.0, 3.0]])
def test_linear_factors_give_the_dense_distance(kind, weights):
    """⟨δᵀz, T⟩ = Σ(δ ∘ zTᵀ) and ‖δᵀz‖² = Σ(δδᵀ ∘ zzᵀ): every distance equals its value on δᵀz formed."""
    from leakbench.attacks.solvers.objectives import LinearFactors

    g = torch.Generator().manual_seed(3)
    delta = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    z = torch.randn(5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    other = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    target = [torch.randn(7, 11, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64),
              torch.randn(7, 11, generator=g, dtype=torch.float64)]
    dist = GradientDistance(target, kind=kind, weights=weights)
    factors = LinearFactors(delta, z)
    dense = dist([delta.T @ z, other, 0.3 * delta.T @ z])
    fact = dist([factors, other, factors.scaled(0.3)])
    assert fact.item() == pytest.approx(dense.item(), rel=1e-12)
    grads = [torch.autograd.grad(v, [delta, z, other]) for v in (dense, fact)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_linear_factors_l2_keeps_precision_near_a_match():
    """The L2 expansion cancels near a match; accumulated in float64 it still equals the float32 dense value."""
    from leakbench.attacks.solvers.objectives import LinearFactors

    g = torch.Generator().manual_seed(4)
    delta, z = torch.randn(4, 300, generator=g), torch.randn(4, 200, generator=g)
    target = delta.double().T @ z.double()
    near = delta * (1 + 1e-4 * torch.randn(4, 300, generator=g))
    exact = float(((near.double().T @ z.double() - target) ** 2).sum())
    got = GradientDistance([target.float()], kind="l2")([LinearFactors(near, z)]).item()
    assert got == pytest.approx(exact, rel=1e-3)
    with pytest.raises(ConfigError, match="same rows"):
        LinearFactors(delta, z[:3])
