"""The whole batch fitted to the whole first-layer gradient: Gauss–Newton through δ(X) (ours).

With every sample found, a ReLU layer's gradient is

    ∂L/∂W = Σ_i δ(x_i, y_i) x_iᵀ,   ∂L/∂b = Σ_i δ(x_i, y_i)        (SPEAR, Dimitrov et al. NeurIPS 2024, eq. 1)

with δ = ∂L/∂z through the rest of the model.  Least squares with Δ held fixed (X = (ΔΔᵀ)⁻¹ΔG, alternated with
Δ = δ(X)) ignores that Δ moves with X.  For the samples with the smallest gradients of a trained model the
alternation stalls: a fixed-Δ re-solve turns Δ̂'s error into an error in x̂_i of about (its error)/‖δ_i‖.  On a
trained ``mlp:2000`` at B = 256 (digits-like, accuracy 0.62), every sample was found to 2.6e-4, yet the
residual stopped at 7.9e-6 against a tolerance of 3.6e-6 (the true batch: 2.2e-7).

Gauss–Newton minimises ‖G − Δ(X)ᵀ X̃‖² over all of X at once (X̃ = [X, 1], G = [∂L/∂W, ∂L/∂b]).  The residual's
linearisation in a step V (B×n, Ṽ = [V, 0]) is

    A(V) = (H (V Wᵀ))ᵀ X̃ + Δᵀ Ṽ,          Aᵀ(M) = H(X̃ Mᵀ) W + (Δ M)[:, :n]

where H is each sample's Hessian of the loss with respect to the layer's pre-activations (products with it by
double backward through the rest of the model; it is symmetric).  Each step solves min ‖A V − R‖ by CGLS in
variables whitened by (ΔΔᵀ)^(−1/2): samples with similar δ make ΔΔᵀ ill-conditioned, and CGLS on X itself, or
with each sample's columns scaled by 1/‖δ_i‖, crawled.  At every step, neurons at a hinge take the side the
gradient fits (:mod:`.hinge`).  On that batch, three steps took the residual to 2.1e-7 and every sample to within
2.3e-5.

**Precision.** The certificate needs each sample's precision, and a joint residual at the tolerance does not
bound a sample whose δ is tiny.  With Δ fixed at the fit, X is solved from the even rows of G and from the odd
rows apart.  Their max-abs difference per sample measures what the gradient's own error leaves in x̂_i.  Against
the truth on that batch it came to 0.24–2.9× the actual error (median 1.3).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .hinge import hinge_deltas
from .peeling import SampleGradients

__all__ = ["fit_batch", "split_precision", "misfit", "FitResult"]

#: a step is kept going only while it lowers the residual by at least this fraction
PROGRESS = 0.1


@dataclass
class FitResult:
    """The fitted batch: inputs (K×n), their δ (K×m), the residual ‖G − ΔᵀX̃‖, the steps taken and the hinge pairs
    flipped at the kept point."""

    inputs: torch.Tensor
    deltas: torch.Tensor
    residual: float
    steps: int
    flipped: int


def _residual(target_w, target_b, inputs, deltas) -> tuple[torch.Tensor, torch.Tensor, float]:
    r_w, r_b = target_w - deltas.T @ inputs, target_b - deltas.sum(0)
    return r_w, r_b, float((r_w.pow(2).sum() + r_b.pow(2).sum()).sqrt())


def _step(grads: SampleGradients, inputs, labels, deltas, r_w, r_b, scale: float, inner: int) -> torch.Tensor:
    """One Gauss–Newton step V (K×n): CGLS on the linearised residual, in variables whitened by (ΔΔᵀ)^(−1/2)."""
    weight = grads.weight
    hess = grads.hessian_product(inputs, labels)
    # the fixed-Δ part Δᵀ V is whitened: V = C V' with C = (ΔΔᵀ)^(−1/2) (K×K), so CGLS iterates only on what
    # the curvature term adds (samples with similar δ make ΔΔᵀ ill-conditioned; plain CGLS then crawls)
    evals, evecs = torch.linalg.eigh(deltas @ deltas.T)
    evals = evals.clamp_min(float(evals.max()) * torch.finfo(deltas.dtype).eps)
    col = (evecs * evals.rsqrt()) @ evecs.T

    def forward(v):                                   # K×n (whitened) → (m×n, m)
        v = col @ v
        d_delta = scale * hess(v @ weight.T)
        return d_delta.T @ inputs + deltas.T @ v, d_delta.sum(0)

    def adjoint(m_w, m_b):                             # (m×n, m) → K×n (whitened)
        return col @ (scale * hess(inputs @ m_w.T + m_b) @ weight + deltas @ m_w)

    v = torch.zeros_like(inputs)
    s = adjoint(r_w, r_b)
    p, gamma = s.clone(), float(s.pow(2).sum())
    start = gamma
    for _ in range(inner):
        if not gamma > 1e-12 * start:      # ‖Aᵀr‖ down 10⁶: an inexact Newton step is enough
            break
        q_w, q_b = forward(p)
        curvature = float(q_w.pow(2).sum() + q_b.pow(2).sum())
        if not curvature > 0:
            break
        alpha = gamma / curvature
        v += alpha * p
        r_w, r_b = r_w - alpha * q_w, r_b - alpha * q_b
        s = adjoint(r_w, r_b)
        gamma, previous = float(s.pow(2).sum()), gamma
        p = s + (gamma / previous) * p
    return col @ v


def fit_batch(grads: SampleGradients, inputs: torch.Tensor, labels: torch.Tensor, target_w: torch.Tensor,
              target_b: torch.Tensor, reach: float, *, scale: float = 1.0, steps: int = 8, inner: int = 200,
              newton: bool = True) -> FitResult:
    """The batch X (K×n, labels K) that reproduces ``target_w`` (m×n) and ``target_b`` (m) best: Gauss–Newton from
    ``inputs``, at most ``steps`` steps of ``inner`` CGLS iterations, stopping once a step gains under
    ``PROGRESS``.  Pairs within ``reach``·‖W_j‖₁ of a hinge take the gradient's side (:func:`.hinge_deltas`).
    Returns the best point met (step 0 is ``inputs`` itself).  ``newton=False``: the cheap fixed-Δ re-solve
    X = lstsq(Δᵀ, ∂L/∂W) instead of each Gauss–Newton step, which is enough where every δ_i is large."""
    x = inputs
    deltas, flipped = hinge_deltas(grads, x, labels, target_w, target_b, reach, scale=scale)
    r_w, r_b, best = _residual(target_w, target_b, x, deltas)
    kept = FitResult(x, deltas, best, 0, flipped)
    for step in range(1, steps + 1):
        if not (bool(torch.isfinite(deltas).all()) and best > 0):
            break
        try:
            trial = x + _step(grads, x, labels, deltas, r_w, r_b, scale, inner) if newton else \
                torch.linalg.lstsq(deltas.T, target_w).solution
        except (RuntimeError, torch.linalg.LinAlgError):   # a degenerate Δ̂ (estimates far off)
            break
        if not bool(torch.isfinite(trial).all()):
            break
        trial_deltas, flipped = hinge_deltas(grads, trial, labels, target_w, target_b, reach, scale=scale)
        t_w, t_b, residual = _residual(target_w, target_b, trial, trial_deltas)
        if not residual < best:
            break
        gained = residual < (1 - PROGRESS) * best or not newton   # a re-solve is cheap: on while it gains
        x, deltas, r_w, r_b, best = trial, trial_deltas, t_w, t_b, residual
        kept = FitResult(x, deltas, best, step, flipped)
        if not gained:
            break
    return kept


def misfit(target_w: torch.Tensor, target_b: torch.Tensor, inputs: torch.Tensor, deltas: torch.Tensor) -> float:
    """The larger relative residual of ∂L/∂W and of ∂L/∂b that the batch leaves (the joint certificate's measure)."""
    tiny = torch.finfo(target_w.dtype).tiny
    return max(float((target_w - deltas.T @ inputs).norm() / target_w.norm().clamp_min(tiny)),
               float((target_b - deltas.sum(0)).norm() / target_b.norm().clamp_min(tiny)))


def split_precision(deltas: torch.Tensor, target_w: torch.Tensor) -> torch.Tensor:
    """Per sample, the max-abs difference between X solved (Δ fixed) from the even and from the odd rows of
    ``target_w``: what the gradient's own error leaves in each x̂_i.  Infinite where a half has fewer rows than
    samples or the solve is singular."""
    rows = torch.arange(target_w.shape[0], device=target_w.device)
    halves = []
    for parity in (0, 1):
        keep = rows % 2 == parity
        if int(keep.sum()) < deltas.shape[0]:
            return torch.full((deltas.shape[0],), float("inf"), dtype=deltas.dtype, device=deltas.device)
        halves.append(torch.linalg.lstsq(deltas.T[keep], target_w[keep]).solution)
    spread = (halves[0] - halves[1]).abs().amax(1)
    return torch.where(torch.isfinite(spread), spread, torch.full_like(spread, float("inf")))
