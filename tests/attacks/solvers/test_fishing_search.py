"""The server's threshold search of multi-round feature fishing: on a simulated client whose count and gradient
follow the feature-fishing head exactly, every sample apart from the others is isolated, and its difference of
rounds is its own gradient."""
from __future__ import annotations

import math

import pytest
import torch

from leakbench.attacks.solvers.fishing_search import Round, isolate


def _client(values: torch.Tensor, grads: torch.Tensor, others: int, sharp: float):
    """ask(τ): (N(φ < τ) − others, Σ_i σ(−m(φ_i − τ))·g_i) — the head's soft step with m = ``sharp``."""
    asked = []

    def ask(tau: float):
        asked.append(tau)
        below = torch.sigmoid(-sharp * (values - tau))
        return float(below.sum()) - others, [(below[:, None] * grads).sum(0)]

    return ask, asked


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_separated_sample_is_isolated_with_its_own_gradient(seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(24, generator=gen, dtype=torch.float64)
    grads = torch.randn(24, 7, generator=gen, dtype=torch.float64)
    ask, asked = _client(values, grads, others=5, sharp=1e6)
    search = isolate(ask, start=0.3, spread=1.0, total=24, budget=200)
    assert len(search.isolated) == 24 and len(asked) == len(search.rounds) <= 200
    for single in search.isolated:
        inside = ((values >= single.low) & (values < single.high)).nonzero().flatten()
        assert inside.numel() == 1
        assert torch.allclose(single.shared[0], grads[inside[0]], atol=1e-9)
    # the bracket holds the batch and came from powers of two of the spread
    assert search.bracket[0] < float(values.min()) and search.bracket[1] > float(values.max())


def test_the_budget_bounds_the_rounds_and_want_stops_early():
    gen = torch.Generator().manual_seed(3)
    values, grads = torch.randn(32, generator=gen, dtype=torch.float64), torch.randn(32, 3, generator=gen)
    ask, asked = _client(values, grads.double(), others=0, sharp=1e6)
    few = isolate(ask, start=0.0, spread=1.0, total=32, budget=9)
    assert len(asked) == 9 and any("budget" in n for n in few.notes)
    ask, asked = _client(values, grads.double(), others=0, sharp=1e6)
    some = isolate(ask, start=0.0, spread=1.0, total=32, budget=200, want=3)
    assert len(some.isolated) >= 3 and len(asked) < 32


def test_samples_at_one_value_are_never_claimed_as_one():
    values = torch.tensor([0.0, 0.0, 0.0, 0.5, 1.2, 2.0], dtype=torch.float64)   # a ReLU feature's zeros
    grads = torch.eye(6, dtype=torch.float64)
    ask, _ = _client(values, grads, others=2, sharp=1e5)
    search = isolate(ask, start=0.5, spread=1.0, total=6, budget=80, finest=20 / 1e5)
    lows = sorted(round(s.low, 3) for s in search.isolated)
    assert len(search.isolated) == 3 and all(low > 0 for low in lows)
    assert any("closer" in n or "integers" in n for n in search.notes)


def test_a_known_round_is_reused_and_a_fractional_one_is_not():
    values = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    ask, asked = _client(values, torch.eye(2, dtype=torch.float64), others=0, sharp=1e6)
    known = Round(0.0, 1.0, [torch.tensor([1.0, 0.0], dtype=torch.float64)])
    search = isolate(ask, start=0.0, spread=1.5, total=2, budget=10, known=known)
    assert len(search.isolated) == 2 and len(asked) == 2 and not math.isnan(search.bracket[0])
    fractional = Round(0.0, 0.5, [torch.zeros(2, dtype=torch.float64)])
    assert not fractional.integral
