"""imprint_expected: the bin-occupancy formula of Robbing the Fed."""
from __future__ import annotations

import pytest
import torch

from leakbench.analysis.imprint import imprint_bins_for, imprint_expected
from leakbench.errors import ConfigError


def _simulate(masses: torch.Tensor, batch: int, trials: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(masses.expand(trials, -1), batch, replacement=True, generator=gen)  # trials×B
    counts = torch.zeros(trials, masses.numel()).scatter_add_(1, draws, torch.ones(trials, batch))
    return float((counts == 1).sum(1).double().mean())


@pytest.mark.parametrize("bins,batch", [(8, 4), (32, 8), (64, 32), (10, 1)])
def test_equal_mass_formula_matches_simulation(bins, batch):
    simulated = _simulate(torch.full((bins,), 1.0 / bins), batch, 20000, seed=bins)
    assert imprint_expected(bins, batch) == pytest.approx(batch * (1 - 1 / bins) ** (batch - 1))
    assert simulated == pytest.approx(imprint_expected(bins, batch), rel=0.02)


def test_unequal_masses_match_simulation():
    masses = torch.tensor([0.5, 0.2, 0.2, 0.1])
    assert _simulate(masses, 3, 40000, seed=1) == pytest.approx(imprint_expected(4, 3, masses=masses), rel=0.02)


def test_population_is_the_exact_draw_without_replacement():
    """Batches of 3 from a pool of 10 with 5/2/2/1 samples per bin: enumerate every batch."""
    import itertools
    pool = [0] * 5 + [1] * 2 + [2] * 2 + [3]
    batches = list(itertools.combinations(pool, 3))
    alone = sum(sum(b.count(v) == 1 for v in b) for b in batches) / len(batches)
    masses = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64)
    assert imprint_expected(4, 3, masses=masses, population=10) == pytest.approx(alone, rel=1e-9)
    assert imprint_expected(8, 8, population=10**7) == pytest.approx(imprint_expected(8, 8), rel=1e-5)
    assert imprint_expected(8, 8, population=8) == pytest.approx(8.0)  # every bin holds exactly one


def test_holdout_counts_give_an_unbiased_estimate():
    """Masses counted on M held-out samples: the population-M formula averages to the true expectation;
    plugging the noisy masses into the i.i.d. formula is biased low."""
    bins, batch, m = 32, 16, 64
    true = torch.linspace(0.5, 1.5, bins, dtype=torch.float64)
    true = true / true.sum()
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(true.expand(3000, -1), m, replacement=True, generator=gen)
    counts = torch.zeros(3000, bins, dtype=torch.float64).scatter_add_(1, draws, torch.ones(3000, m, dtype=torch.float64))
    unbiased = sum(imprint_expected(bins, batch, masses=c / m, population=m) for c in counts) / 3000
    plug_in = sum(imprint_expected(bins, batch, masses=c / m) for c in counts) / 3000
    want = imprint_expected(bins, batch, masses=true)
    assert unbiased == pytest.approx(want, rel=0.01)
    assert plug_in < 0.95 * want


def test_block_supplies_bins_masses_and_holdout():
    import leakbench as lb
    from leakbench.models.malicious import imprint
    data = lb.load("digits")
    model = lb.build("mlp:8", input_shape=data.shape, classes=10, seed=0)
    shipped = imprint(model, bins=16, seed=0, calibration=data.images[:100], holdout=data.images[100:300])
    block = shipped[0]
    assert imprint_expected(shipped, 8) == imprint_expected(16, 8, masses=block.masses, population=200)
    assert imprint_expected(block, 300) == imprint_expected(16, 300, masses=block.masses)  # holdout < batch


def test_limits():
    assert imprint_expected(1, 1) == 1.0
    assert imprint_expected(1, 2) == 0.0
    assert imprint_expected(5, 0) == 0.0
    assert imprint_expected(10_000, 4) == pytest.approx(4, rel=1e-3)


def test_bins_for_reaches_fraction():
    for batch in (2, 8, 32):
        k = imprint_bins_for(batch, fraction=0.8)
        assert imprint_expected(k, batch) >= 0.8 * batch
        assert k == 1 or imprint_expected(k - 1, batch) < 0.8 * batch


@pytest.mark.parametrize("kwargs,field", [(dict(bins=0, batch=2), "bins"), (dict(bins=4, batch=-1), "batch"),
                                          (dict(bins=2, batch=2, masses=[0.9, 0.2]), "masses"),
                                          (dict(bins=2, batch=4, population=3), "population")])
def test_bad_input(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        imprint_expected(**kwargs)
