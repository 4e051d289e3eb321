"""CMA-ES (Hansen 2016): converges on the tutorial's test functions, learns a rotated covariance, is seeded."""
from __future__ import annotations

import math

import pytest
import torch

from leakbench.attacks.solvers.cma_es import MAX_DIM, CMAES, default_population
from leakbench.errors import ConfigError


def _minimise(f, start, sigma, *, seed=0, generations=3000, stop=1e-10):
    es = CMAES(start, sigma, generator=torch.Generator().manual_seed(seed))
    best = math.inf
    for _ in range(generations):
        values = f(es.ask())
        es.tell(values)
        best = min(best, float(values.min()))
        if best < stop:
            break
    return es, best


def _rosenbrock(x):
    return (100 * (x[:, 1:] - x[:, :-1] ** 2) ** 2 + (1 - x[:, :-1]) ** 2).sum(1)


def test_reaches_the_minimum_of_sphere_and_rosenbrock():
    es, best = _minimise(lambda x: x.pow(2).sum(1), torch.ones(10), 0.5)
    assert best < 1e-10 and es.generation < 400            # the tutorial: ~1 600 evaluations at n = 10 (λ = 10)
    es, best = _minimise(_rosenbrock, torch.zeros(8), 0.5)
    assert best < 1e-10 and float((es.mean - 1).abs().max()) < 1e-3


def test_learns_an_ill_conditioned_rotated_ellipsoid():
    """Condition 10⁶ in a random rotation: solved only with the covariance adapted to the Hessian's axes."""
    n = 8
    q = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
    scales = 10.0 ** (3 * torch.arange(n, dtype=torch.float64) / (n - 1))
    es, best = _minimise(lambda x: ((x @ q.T) * scales).pow(2).sum(1), torch.ones(n), 0.5)
    assert best < 1e-10
    hessian_axes = torch.linalg.eigh(q.T @ torch.diag(scales ** 2) @ q).eigenvalues
    # C ∝ H⁻¹ after convergence: the condition numbers agree within a factor 10
    ratio = (es.D.max() / es.D.min()) ** 2 / (hessian_axes.max() / hessian_axes.min()).sqrt() ** 2
    assert 0.1 < float(ratio) < 10


def test_seeded_and_nan_is_worst():
    runs = [_minimise(lambda x: x.pow(2).sum(1), torch.ones(5), 0.3, seed=4, generations=20)[0].mean for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    es = CMAES(torch.zeros(4), 1.0, population=6, generator=torch.Generator().manual_seed(0))
    x = es.ask()
    values = x.pow(2).sum(1)
    values[values.argmin()] = float("nan")                  # a non-finite candidate is never selected
    kept = x[torch.argsort(torch.nan_to_num(values, nan=math.inf))[:3]]
    es.tell(values)
    assert torch.allclose(es.mean, es.w @ kept, atol=1e-12)  # m ← Σ w_i x_{i:λ} (weights sum to 1)


def test_bad_arguments_are_one_line():
    assert default_population(100) == 4 + int(3 * math.log(100))
    with pytest.raises(ConfigError, match="dimensions"):
        CMAES(torch.zeros(MAX_DIM + 1), 1.0)
    with pytest.raises(ConfigError, match="sigma"):
        CMAES(torch.zeros(3), 0.0)
    es = CMAES(torch.zeros(3), 1.0)
    with pytest.raises(ConfigError, match="ask"):
        es.tell(torch.zeros(es.lam))
    es.ask()
    with pytest.raises(ConfigError, match="values"):
        es.tell(torch.zeros(es.lam + 1))
