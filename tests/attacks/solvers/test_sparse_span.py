"""The algebra of ``spear``: kernels shared by several samples told apart (``separate``)."""
from __future__ import annotations

import torch

from leakbench.attacks.solvers.sparse_span import directions_from_inputs, separate


def _layer(seed: int, exclusive: bool = True):
    """Δ (6×60) with a designed activation pattern and L = Δᵀ Q⁻¹ for a random invertible Q.

    Samples 0, 1, 2 are inactive on rows 0–19 (so the kernel of L there is span{q_0, q_1, q_2}); on rows 20–49
    each of them alone is active among the three (10 rows each) unless ``exclusive`` is off; samples 3–5 are
    active on rows 0–19 and at random elsewhere."""
    g = torch.Generator().manual_seed(seed)
    active = torch.rand(6, 60, generator=g) < 0.6
    active[:3, :20] = False
    active[3:, :20] = True                      # no row is dead: each is read
    active[:3, 20:50] = False
    for k in range(3):
        if exclusive:
            active[k, 20 + 10 * k: 30 + 10 * k] = True
        else:
            active[:3, 20 + 10 * k: 30 + 10 * k] = True
    active[:3, 50:] = True
    deltas = torch.randn(6, 60, generator=g, dtype=torch.float64) * active
    q = torch.randn(6, 6, generator=g, dtype=torch.float64)
    left = deltas.T @ torch.linalg.inv(q)                                  # Δᵀ = L Q
    kernel = torch.linalg.svd(left[:20], full_matrices=True)[2][-3:].T     # 6×3
    return left, q, kernel


def _matches(directions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """For each direction, the true column it equals up to scale (−1 when none, to 1e-10 in cosine)."""
    unit = directions / directions.norm(dim=0)
    cos = ((q / q.norm(dim=0)).T @ unit).abs()
    best = cos.max(0)
    return torch.where(best.values > 1 - 1e-10, best.indices, -1)


def test_a_kernel_shared_by_three_samples_is_split_into_their_exact_directions():
    for seed in range(5):
        left, q, kernel = _layer(seed)
        assert torch.linalg.svdvals(left[:20] @ kernel).max() < 1e-12          # a 3-dimensional shared kernel
        found = separate(left, kernel, torch.ones(60, dtype=torch.bool))
        assert found is not None and found.shape == (6, 3)
        assert sorted(_matches(found, q).tolist()) == [0, 1, 2], seed          # each sample's q, exactly


def test_without_rows_exclusive_within_the_group_nothing_is_split():
    left, _, kernel = _layer(0, exclusive=False)
    assert separate(left, kernel, torch.ones(60, dtype=torch.bool)) is None


def test_rows_outside_live_are_not_read():
    # with the exclusive rows of sample 2 masked out, only two groups remain for three samples: refused
    left, _, kernel = _layer(1)
    live = torch.ones(60, dtype=torch.bool)
    live[40:50] = False
    assert separate(left, kernel, live) is None


def test_directions_from_inputs_appends_the_split_directions():
    # the candidate input is inactive on rows 0–19 only (a margin from a layer built for it): a 3-dimensional kernel,
    # rejected as one direction, split into three when asked
    left, q, _ = _layer(2)
    weight = torch.zeros(60, 4, dtype=torch.float64)
    weight[:, 0] = 1.0
    bias = torch.zeros(60, dtype=torch.float64)
    bias[:20] = -torch.linspace(3, 2, 20, dtype=torch.float64)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    plain, ok = directions_from_inputs(left, weight, bias, x, rows=20, null_tol=1e-6)
    assert plain.shape[1] == 1 and not bool(ok[0])
    split, ok = directions_from_inputs(left, weight, bias, x, rows=20, null_tol=1e-6, split=4)
    assert split.shape[1] == 4 and ok[1:].all()
    assert sorted(_matches(split[:, 1:], q).tolist()) == [0, 1, 2]
