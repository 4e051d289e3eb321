"""CMA-ES, the covariance matrix adaptation evolution strategy (Hansen, "The CMA Evolution Strategy: A Tutorial",
arXiv:1604.00772, 2016): the (μ/μ_w, λ)-CMA-ES of the tutorial's Appendix A (Fig. 6, Table 1), with its default
parameters.  A gradient-free optimiser of f: ℝⁿ → ℝ; here the latent search of ``ggl`` (Li et al. CVPR 2022 use
CMA-ES through nevergrad; none ships offline here, so the tutorial's algorithm is written out, ~80 lines).

One generation (``ask`` then ``tell``), in the tutorial's notation:

* sample  y_k = B D z_k, z_k ~ N(0, I), x_k = m + σ y_k, k = 1..λ                                   (eq. 38–40)
* select and recombine  ⟨y⟩_w = Σ_{i≤μ} w_i y_{i:λ},  m ← m + c_m σ ⟨y⟩_w (c_m = 1)                (eq. 41)
* step-size path  p_σ ← (1 − c_σ) p_σ + √(c_σ(2 − c_σ) μ_eff) C^{−½} ⟨y⟩_w                          (eq. 43)
  σ ← σ exp((c_σ / d_σ)(‖p_σ‖ / E‖N(0, I)‖ − 1))                                                    (eq. 44)
* covariance path  p_c ← (1 − c_c) p_c + h_σ √(c_c(2 − c_c) μ_eff) ⟨y⟩_w                            (eq. 45)
  C ← (1 + c_1 δ(h_σ) − c_1 − c_μ Σ w_j) C + c_1 p_c p_cᵀ + c_μ Σ_{i≤μ} w_i y_{i:λ} y_{i:λ}ᵀ        (eq. 47)

Only the positive recombination weights are used (μ = ⌊λ/2⌋; the tutorial's active negative weights are optional).
The eigendecomposition C = B D² Bᵀ is refreshed every generation (n ≤ :data:`MAX_DIM`, an n×n ``eigh`` is cheap).
Internals are float64 on the CPU; the candidates are returned as float64 tensors, for the caller to cast.
"""
from __future__ import annotations

import math

import torch

from ...errors import expect

__all__ = ["CMAES", "MAX_DIM", "default_population"]

#: the largest search dimension: C is n×n and decomposed every generation (2 048² doubles: 32 MB)
MAX_DIM = 2048


def default_population(n: int) -> int:
    """λ = 4 + ⌊3 ln n⌋ (Table 1)."""
    return 4 + int(3 * math.log(n))


class CMAES:
    """(μ/μ_w, λ)-CMA-ES from ``mean`` with step size ``sigma``; ``population`` λ (0: the tutorial's default);
    ``generator`` seeds every sample."""

    def __init__(self, mean: torch.Tensor, sigma: float, *, population: int = 0,
                 generator: torch.Generator | None = None) -> None:
        n = mean.numel()
        expect(1 <= n <= MAX_DIM, f"CMA-ES searches 1 to {MAX_DIM} dimensions, got {n}: use a gradient optimiser")
        expect(math.isfinite(sigma) and sigma > 0, f"expected a step size sigma > 0, got {sigma}")
        lam = population or default_population(n)
        expect(lam >= 2, f"expected a population ≥ 2, got {lam}")
        self.n, self.lam, self.mu = n, lam, lam // 2
        w = math.log((lam + 1) / 2) - torch.log(torch.arange(1, self.mu + 1, dtype=torch.float64))
        self.w = w / w.sum()
        self.mueff = float(1 / self.w.pow(2).sum())
        mueff = self.mueff
        self.cc = (4 + mueff / n) / (n + 4 + 2 * mueff / n)
        self.cs = (mueff + 2) / (n + mueff + 5)
        self.c1 = 2 / ((n + 1.3) ** 2 + mueff)
        self.cmu = min(1 - self.c1, 2 * (mueff - 2 + 1 / mueff) / ((n + 2) ** 2 + mueff))
        self.damps = 1 + 2 * max(0.0, math.sqrt((mueff - 1) / (n + 1)) - 1) + self.cs
        self.chi_n = math.sqrt(n) * (1 - 1 / (4 * n) + 1 / (21 * n * n))
        self.mean = mean.detach().reshape(-1).to("cpu", torch.float64).clone()
        self.sigma = float(sigma)
        self.pc = torch.zeros(n, dtype=torch.float64)
        self.ps = torch.zeros(n, dtype=torch.float64)
        self.C = torch.eye(n, dtype=torch.float64)
        self.B = torch.eye(n, dtype=torch.float64)
        self.D = torch.ones(n, dtype=torch.float64)
        self.generator = generator
        self.generation = 0
        self._y: torch.Tensor | None = None

    def ask(self) -> torch.Tensor:
        """λ candidates (λ × n, float64)."""
        z = torch.randn((self.lam, self.n), generator=self.generator, dtype=torch.float64)
        self._y = (z * self.D) @ self.B.T
        return self.mean + self.sigma * self._y

    def tell(self, values: torch.Tensor) -> None:
        """Update from the values f(x_k) of the last :meth:`ask`'s candidates (lower is better; NaN is worst)."""
        expect(self._y is not None, "CMAES.tell needs the candidates of ask() first")
        values = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
        expect(len(values) == self.lam, f"expected {self.lam} values, got {len(values)}")
        order = torch.argsort(torch.nan_to_num(values, nan=math.inf))
        y = self._y[order[: self.mu]]
        yw = self.w @ y
        self.mean = self.mean + self.sigma * yw
        inv_sqrt = (self.B / self.D) @ self.B.T
        self.ps = (1 - self.cs) * self.ps + math.sqrt(self.cs * (2 - self.cs) * self.mueff) * (inv_sqrt @ yw)
        self.generation += 1
        norm = float(self.ps.norm())
        hsig = norm / math.sqrt(1 - (1 - self.cs) ** (2 * self.generation)) < (1.4 + 2 / (self.n + 1)) * self.chi_n
        self.pc = (1 - self.cc) * self.pc + (math.sqrt(self.cc * (2 - self.cc) * self.mueff) * yw if hsig else 0.0)
        delta = 0.0 if hsig else self.c1 * self.cc * (2 - self.cc)
        rank_mu = (y * self.w[:, None]).T @ y
        self.C = ((1 - self.c1 - self.cmu + delta) * self.C + self.c1 * torch.outer(self.pc, self.pc)
                  + self.cmu * rank_mu)
        self.sigma *= math.exp((self.cs / self.damps) * (norm / self.chi_n - 1))
        self.C = (self.C + self.C.T) / 2
        eigenvalues, self.B = torch.linalg.eigh(self.C)
        self.D = eigenvalues.clamp_min(1e-30).sqrt()
        self._y = None
