"""Expected recovery of the imprint block (Fowl et al., "Robbing the Fed", ICLR 2022, Sec. 3).

With K bins and a batch of B samples, each sample falls into bin k independently with
probability p_k (1/K for equal-mass bins).  A sample is recovered exactly when no other
sample shares its bin, so the expected number recovered is

    E[#recovered] = Σ_k B·p_k·(1 − p_k)^(B−1)        (= B·(1 − 1/K)^(B−1) for equal masses),

the bin-occupancy count Fowl et al. use to pick K for a batch size.

The masses must be those *realised* by the shipped block on the clients' data: edges at the
empirical quantiles of N public samples leave bins of unequal true mass (spacings of N order
statistics), and Σ_k B·p_k·(1 − p_k)^(B−1) is largest at equal masses, so 1/K over-predicts.
Pass the block itself — ``imprint_expected(block, B)`` uses its masses measured on public samples
its edges were not fitted to (:func:`leakbench.models.malicious.imprint`, ``holdout=``) — or
masses measured on any held-out data with ``block.bin_masses(x)``.  When batches are drawn
without replacement from a finite pool of N samples (a client's dataset), ``population=N``
gives the exact hypergeometric count, Σ_k n_k·C(N − n_k, B − 1)/C(N, B) with n_k = p_k·N.
The same expression on M held-out samples with counts m_k is an *unbiased* estimate of the
i.i.d. count: for m ~ Binomial(M, p), E[m·C(M − m, B − 1)/C(M, B)] = p(1 − p)^(B−1), whereas
plugging the noisy p̂ = m/M into B·p̂(1 − p̂)^(B−1) is biased low when K is large next to M/K
(photos, K = 64, 150 held-out images: 0.232 of the batch by plug-in, 0.303 unbiased, 0.290
measured).  ``imprint_expected(block, B)`` uses it (population = the holdout's size).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import ConfigError

__all__ = ["imprint_expected", "imprint_bins_for"]


def _masses(bins: int, masses: Sequence[float] | torch.Tensor | None) -> torch.Tensor:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ConfigError(f"expected bins ≥ 1 (an integer), got {bins!r} (argument bins)")
    if masses is None:
        return torch.full((bins,), 1.0 / bins, dtype=torch.float64)
    p = torch.as_tensor(masses, dtype=torch.float64).reshape(-1)
    if p.numel() != bins or bool((p < 0).any()) or abs(float(p.sum()) - 1.0) > 1e-6:
        raise ConfigError(f"expected {bins} non-negative bin masses summing to 1, got {p.tolist()} (argument masses)")
    return p


def _log_choose(n: torch.Tensor, k: int) -> torch.Tensor:
    return torch.lgamma(n + 1) - math.lgamma(k + 1) - torch.lgamma(n - k + 1)


def imprint_expected(bins: int | object, batch: int, *, masses: Sequence[float] | torch.Tensor | None = None,
                     population: int | None = None) -> float:
    """Expected number of the ``batch`` samples alone in one of ``bins`` bins (exactly recovered).

    ``masses``: the bins' probability masses (default 1/K); ``population``: draw the batch
    without replacement from N samples of which p_k·N fall in bin k (default: independent draws).
    ``bins`` may be an imprint block (or a model holding one): its K, ``masses`` and, when they
    were counted on a holdout of at least ``batch`` samples, that holdout as ``population``.
    """
    block = bins if hasattr(bins, "masses_samples") else next(
        (m for m in getattr(bins, "modules", lambda: [])() if hasattr(m, "masses_samples")), None)
    if block is not None:
        held = block.masses_samples
        return imprint_expected(int(block.bins), batch, masses=block.masses.detach().cpu(),
                                population=held if held is not None and isinstance(batch, int)
                                and held >= batch else None)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ConfigError(f"expected batch ≥ 0 (an integer), got {batch!r} (argument batch)")
    p = _masses(bins, masses)
    if batch == 0:
        return 0.0
    if population is None:
        return float((batch * p * (1.0 - p) ** (batch - 1)).sum())
    if isinstance(population, bool) or not isinstance(population, int) or population < batch:
        raise ConfigError(f"expected population ≥ batch ({batch}) samples, got {population!r} (argument population)")
    n = p * population
    rest = population - n
    ok = (n > 0) & (rest >= batch - 1 - 1e-9)
    log_p = torch.log(n.clamp_min(1e-300)) + _log_choose(rest.clamp_min(batch - 1), batch - 1) \
        - _log_choose(torch.tensor(float(population), dtype=torch.float64), batch)
    return float(torch.where(ok, log_p.exp(), torch.zeros_like(n)).sum())


def imprint_bins_for(batch: int, *, fraction: float = 0.5) -> int:
    """The fewest equal-mass bins whose expected recovery is at least ``fraction`` of ``batch``."""
    if not 0 < fraction < 1:
        raise ConfigError(f"expected 0 < fraction < 1, got {fraction!r} (argument fraction)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"expected batch ≥ 1 (an integer), got {batch!r} (argument batch)")
    if batch == 1:
        return 1
    # B(1 − 1/K)^(B−1) ≥ fB  ⇔  K ≥ 1 / (1 − f^(1/(B−1))); check the integer neighbourhood.
    k = max(1, int(1.0 / (1.0 - fraction ** (1.0 / (batch - 1)))))
    while imprint_expected(k, batch) < fraction * batch:
        k += 1
    while k > 1 and imprint_expected(k - 1, batch) >= fraction * batch:
        k -= 1
    return k
