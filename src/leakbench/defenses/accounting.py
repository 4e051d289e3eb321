"""Privacy accounting for DP-SGD through Opacus's accountants.

ε(δ) of T steps of the sampled Gaussian mechanism with noise multiplier σ and sample
rate q (Abadi et al. 2016; Mironov 2017), computed by ``opacus.accountants``: the RDP
accountant by default (Mironov et al. 2019's analysis of the subsampled Gaussian), the
PRV accountant (Gopi et al. 2021) or the Gaussian-DP one on request.  Like Opacus, the
accountants assume Poisson sampling of each batch.
"""
from __future__ import annotations

import math

from ..errors import ConfigError

ACCOUNTANTS = ("rdp", "prv", "gdp")


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, *, delta: float = 1e-5,
            accountant: str = "rdp") -> float:
    """ε spent by ``steps`` DP-SGD steps at ``noise_multiplier`` σ and ``sample_rate`` q for ``delta``.

    σ = 0 (no noise) gives ε = ∞; ``steps = 0`` gives 0.
    """
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"expected accountant in {ACCOUNTANTS}, got {accountant!r} (field accountant)")
    if not (isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1):
        raise ConfigError(f"expected sample_rate in (0, 1], got {sample_rate!r} (field sample_rate)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"expected steps a non-negative int, got {steps!r} (field steps)")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ConfigError(f"expected delta in (0, 1), got {delta!r} (field delta)")
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0):
        raise ConfigError(f"expected noise_multiplier ≥ 0, got {noise_multiplier!r} (field noise_multiplier)")
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    from opacus.accountants import create_accountant  # imported on use: opacus is slow to import

    acc = create_accountant(accountant)
    acc.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    return float(acc.get_epsilon(delta=float(delta)))


__all__ = ["epsilon", "ACCOUNTANTS"]
