"""Hungarian matching of reconstructions to originals (Liu et al. 2024, eq. (1))."""
from __future__ import annotations

import itertools

import pytest
import torch

from leakbench.errors import ConfigError
from leakbench.metrics import match, pairwise_mse


def _rand(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def _inverse(p: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(p)
    inv[p] = torch.arange(len(p))
    return inv


def test_pairwise_mse_equals_broadcast_definition():
    a = _rand(5, 3, 4, 4, seed=1)
    b = _rand(7, 3, 4, 4, seed=2)
    want = ((a[:, None].double() - b[None].double()) ** 2).flatten(2).mean(2)
    got = pairwise_mse(a, b)
    assert got.shape == (5, 7) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (pairwise_mse(a, a).diagonal() >= 0).all()
    assert pairwise_mse(a, a).diagonal().abs().max() < 1e-12


@pytest.mark.parametrize("noise", [0.0, 0.02])
@pytest.mark.parametrize("cost", ["mse", "negcos"])
def test_recovers_shuffled_batch(noise, cost):
    x = _rand(16, 3, 8, 8, seed=3)
    shuffle = torch.randperm(16, generator=torch.Generator().manual_seed(4))
    rec = x[shuffle] + noise * torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    perm = match(rec, x, cost=cost)
    assert perm.dtype == torch.long and perm.shape == (16,)
    # rec[perm[i]] is x[i]
    assert torch.equal(perm, _inverse(shuffle))
    assert torch.equal(shuffle[perm], torch.arange(16))


def test_more_reconstructions_than_originals():
    x = _rand(4, 20, seed=6)
    distractors = _rand(6, 20, seed=7)
    rec = torch.cat([distractors, x])
    order = torch.randperm(10, generator=torch.Generator().manual_seed(8))
    rec = rec[order]
    perm = match(rec, x)
    assert perm.shape == (4,)
    assert len(set(perm.tolist())) == 4
    assert torch.equal(rec[perm], x)


def test_global_optimum_beats_greedy_nearest_neighbour():
    x = torch.tensor([[0.0], [0.1], [0.2]])
    rec = torch.tensor([[0.1], [5.0], [6.0], [7.0]])  # rec 0 is the nearest for every original
    perm = match(rec, x)
    # greedy would give rec 0 to original 1 (total 58.64); the optimum gives it to
    # original 0: 0.01 + (0.1 - 5)² + (0.2 - 6)² = 57.66
    assert perm.tolist() == [0, 1, 2]
    assert pairwise_mse(x, rec)[torch.arange(3), perm].sum().item() == pytest.approx(57.66)


def _brute_force(cost: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    b, n = cost.shape
    best = min(itertools.permutations(range(n), b), key=lambda p: cost[torch.arange(b), list(p)].sum().item())
    return cost[torch.arange(b), list(best)].sum().item(), best


@pytest.mark.parametrize("b,n", [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (2, 4), (3, 5)])
@pytest.mark.parametrize("cost", ["mse", "negcos"])
def test_agrees_with_brute_force(b, n, cost):
    for seed in range(4):
        x = _rand(b, 2, 3, 3, seed=10 * seed + b)
        # a hard instance: reconstructions near random mixtures of the originals
        rec = _rand(n, 2, 3, 3, seed=100 + 10 * seed + n)
        rec[:b] = 0.5 * rec[:b] + 0.5 * x[torch.randperm(b, generator=torch.Generator().manual_seed(seed))]
        perm = match(rec, x, cost=cost)
        if cost == "mse":
            c = pairwise_mse(x, rec)
        else:
            fx, fr = x.flatten(1).double(), rec.flatten(1).double()
            c = -(fx / fx.norm(dim=1, keepdim=True)) @ (fr / fr.norm(dim=1, keepdim=True)).T
        best_total, best = _brute_force(c)
        total = c[torch.arange(b), perm].sum().item()
        assert total == pytest.approx(best_total, abs=1e-12)
        assert tuple(perm.tolist()) == best  # continuous random data: the optimum is unique


def test_nan_reconstruction_still_gives_a_valid_matching():
    x = _rand(4, 10, seed=20)
    rec = x.clone()[[2, 0, 3, 1]]
    rec[1] = float("nan")  # the copy of x[0] is lost
    perm = match(rec, x)
    assert sorted(perm.tolist()) == [0, 1, 2, 3]
    assert perm[[1, 2, 3]].tolist() == [3, 0, 2]
    assert perm[0].item() == 1


def test_errors():
    x = _rand(3, 4, seed=0)
    with pytest.raises(ConfigError, match="at least as many reconstructions"):
        match(x[:2], x)
    with pytest.raises(ConfigError, match="mse, negcos"):
        match(x, x, cost="l1")
    with pytest.raises(ConfigError) as info:
        match(_rand(3, 5), x)
    assert "(3, 5)" in str(info.value) and "(3, 4)" in str(info.value)
    with pytest.raises(ConfigError, match=r"\(3, 5\).*\(3, 4\)"):
        pairwise_mse(_rand(3, 5), x)


# --------------------------------------------------------------------------- matching methods
def _exact_and_reflected(seed: int = 0):
    """x1 is recovered exactly (slot 0); slot 1 is x1 reflected away from x2, so it lies nearer x1 than x2."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 3, 8, 8, generator=gen, dtype=torch.float64)
    rec = torch.stack([x[0], 2 * x[0] - x[1]])  # cost to x1: D; to x2: 4D; exact slot to x2: D
    return x, rec


def test_total_mse_mispairs_an_exact_slot_that_confident_first_keeps():
    x, rec = _exact_and_reflected()
    total = match(rec, x)
    assert total.tolist() == [1, 0]  # eq. (1): D + D < 0 + 4D, so the exact slot is given x2
    first = match(rec, x, method="confident-first", confident=torch.tensor([1.0, 0.0]))
    assert first.tolist() == [0, 1]  # the exact slot keeps its original
    assert match(rec, x, method="minmax").tolist() == [1, 0]  # max(D, D) < max(0, 4D): minmax swaps too


def _brute(costs: torch.Tensor):
    b, n = costs.shape
    return [list(p) for p in itertools.permutations(range(n), b)]


@pytest.mark.parametrize("seed", range(4))
def test_minmax_and_confident_first_agree_with_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(5, 4, generator=gen, dtype=torch.float64)
    rec = torch.rand(6, 4, generator=gen, dtype=torch.float64)
    costs = pairwise_mse(x, rec)
    perms = _brute(costs)
    rows = torch.arange(5)
    best_max = min(float(costs[rows, torch.tensor(p)].max()) for p in perms)
    got = match(rec, x, method="minmax")
    assert float(costs[rows, got].max()) == pytest.approx(best_max)
    assert len(set(got.tolist())) == 5
    flagged = torch.tensor([1, 0, 1, 0, 0, 0], dtype=torch.bool)

    def key(p):  # confident-first: lexicographic (cost of the flagged slots' pairs, total), all flagged used
        cols = torch.tensor(p)
        on = flagged[cols]
        return float(costs[rows, cols][on].sum()), float(costs[rows, cols].sum())
    feasible = [p for p in perms if set(flagged.nonzero().flatten().tolist()) <= set(p)]
    want = min(feasible, key=key)
    assert match(rec, x, method="confident-first", confident=flagged).tolist() == want


def test_method_errors_name_the_field():
    x = torch.rand(2, 4)
    with pytest.raises(ConfigError, match="method"):
        match(x, x, method="greedy")
    with pytest.raises(ConfigError, match="confident"):
        match(x, x, method="confident-first")
    with pytest.raises(ConfigError, match="confident"):
        match(x, x, method="confident-first", confident=torch.ones(3))
