"""Pure objective terms of gradient-matching attacks.

* ``l2`` — DLG (Zhu et al. 2019, eq. 4): Σ_i w_i ‖∇θ_i(x̂) − ∇θ_i(x)‖².
* ``cosine`` — Inverting Gradients (Geiping et al. 2020, eq. 4): 1 − ⟨∇(x̂), ∇(x)⟩ / (‖∇(x̂)‖‖∇(x)‖)
  over the whole (weighted) parameter vector.
* ``cosine-layer`` — one cosine per parameter tensor, averaged with weights w_i.  With
  ``weights="l0"`` w_i = ‖θ_i‖₀ (Liu et al. 2024, App. F, gradient reweighting); we
  divide by Σ w_i so the loss stays in [0, 2] (a constant factor the paper leaves out).
* ``total_variation`` — the anisotropic TV prior of Geiping et al. (mean absolute
  difference of neighbouring pixels, both axes).
* ``bn_statistics`` — the batch-norm prior of Yin et al. 2021 / Liu et al. 2024 eq. (4):
  Σ_l ‖μ_l(x̂) − μ_l‖₂ + ‖σ²_l(x̂) − σ²_l‖₂.

A dummy gradient may be given as :class:`LinearFactors` (δ, z) instead of a tensor: the weight
gradient δᵀz of a linear layer with input rows z (n×d) and upstream rows δ (n×v), never formed.
Its terms are ⟨δᵀz, T⟩ = Σ_b δ_bᵀ T z_b = Σ (δ ∘ z Tᵀ) and ‖δᵀz‖² = Σ (δδᵀ ∘ zzᵀ) — O(n·v·d) in
one matrix product and O(n²(v + d)) instead of the v×d outer product and its passes.  The n×n Gram
matrices and the L2 expansion ‖δᵀz‖² − 2⟨δᵀz, T⟩ + ‖T‖² are accumulated in float64: the expansion
cancels where the match is close, the elementwise form does not.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ConfigError

DISTANCES = ("l2", "cosine", "cosine-layer")
LAYER_WEIGHTS = ("equal", "l0")


def layer_weights(kind: str | Sequence[float], params: Sequence[torch.Tensor]) -> list[float]:
    """Per-tensor weights: ``equal`` (1 each), ``l0`` (non-zero count of each parameter), or explicit."""
    if isinstance(kind, str):
        if kind == "equal":
            return [1.0] * len(params)
        if kind == "l0":
            return [float((p != 0).sum()) for p in params]
        raise ConfigError(f"expected layer weights in {LAYER_WEIGHTS} or a list of numbers, got {kind!r}")
    weights = [float(w) for w in kind]
    if len(weights) != len(params):
        raise ConfigError(f"expected {len(params)} layer weights (one per parameter tensor), got {len(weights)}")
    return weights


class LinearFactors:
    """The weight gradient δᵀz of a linear layer (δ: n×v upstream rows, z: n×d input rows), unformed."""

    def __init__(self, delta: torch.Tensor, z: torch.Tensor) -> None:
        if delta.dim() != 2 or z.dim() != 2 or delta.shape[0] != z.shape[0]:
            raise ConfigError(f"expected δ (n×v) and z (n×d) with the same rows, got {tuple(delta.shape)} and "
                              f"{tuple(z.shape)}")
        self.delta, self.z = delta, z

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.delta.shape[1], self.z.shape[1]))

    def dense(self) -> torch.Tensor:
        """δᵀz formed (for checks)."""
        return self.delta.T @ self.z

    def scaled(self, factor: float) -> LinearFactors:
        return LinearFactors(self.delta * factor, self.z)

    def dot(self, target: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """⟨δᵀz, T⟩ = Σ (δ ∘ z Tᵀ) for T of shape v×d (in ``dtype`` when given)."""
        delta, z = (self.delta, self.z) if dtype is None else (self.delta.to(dtype), self.z.to(dtype))
        return (delta * (z @ target.to(z.dtype).T)).sum()

    def sq(self) -> torch.Tensor:
        """‖δᵀz‖² = Σ (δδᵀ ∘ zzᵀ), accumulated in float64 (at least)."""
        wide = torch.promote_types(self.delta.dtype, torch.float64)
        delta, z = self.delta.to(wide), self.z.to(wide)
        return ((delta @ delta.T) * (z @ z.T)).sum().clamp_min(0.0)


Gradient = "torch.Tensor | LinearFactors"


class GradientDistance:
    """A distance to a fixed target gradient; target norms are computed once."""

    def __init__(self, target: Sequence[torch.Tensor], *, kind: str = "cosine",
                 weights: Sequence[float] | None = None) -> None:
        if kind not in DISTANCES:
            raise ConfigError(f"expected distance in {DISTANCES}, got {kind!r}")
        self.kind = kind
        self.target = [t.detach() for t in target]
        self.weights = list(weights) if weights is not None else [1.0] * len(self.target)
        self.active = [i for i, w in enumerate(self.weights) if w != 0.0]
        with torch.no_grad():
            self.target_sq = [t.pow(2).sum() for t in self.target]
            self.target_norm_all = torch.sqrt(sum(self.weights[i] * self.target_sq[i] for i in self.active))
            self.weight_sum = float(sum(self.weights[i] for i in self.active))
        self._wide: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # float64 T and ‖T‖² of factorised L2 terms

    def _terms(self, i: int, d: Gradient) -> tuple[torch.Tensor, torch.Tensor]:
        """(⟨d, t_i⟩, ‖d‖²) of a factorised entry."""
        return d.dot(self.target[i]), d.sq().to(d.delta.dtype)

    def _l2(self, i: int, d: Gradient) -> torch.Tensor:
        if not isinstance(d, LinearFactors):
            return (d - self.target[i]).pow(2).sum()
        wide = torch.promote_types(d.delta.dtype, torch.float64)
        if i not in self._wide:
            t = self.target[i].to(wide)
            self._wide[i] = (t, t.pow(2).sum())
        t, t_sq = self._wide[i]
        return (d.sq() - 2 * d.dot(t, wide) + t_sq).to(d.delta.dtype)

    def __call__(self, dummy: Sequence[Gradient]) -> torch.Tensor:
        w, t = self.weights, self.target
        if self.kind == "l2":
            return sum(w[i] * self._l2(i, dummy[i]) for i in self.active)
        dots, sqs = {}, {}
        for i in self.active:
            d = dummy[i]
            if isinstance(d, LinearFactors):
                dots[i], sqs[i] = self._terms(i, d)
            else:
                dots[i] = (d * t[i]).sum()
                sqs[i] = d.pow(2).sum() if self.kind == "cosine" else None
        if self.kind == "cosine":
            dot = sum(w[i] * dots[i] for i in self.active)
            norm = torch.sqrt(sum(w[i] * sqs[i] for i in self.active))
            return 1.0 - dot / (norm * self.target_norm_all + 1e-20)
        total = 0.0
        for i in self.active:
            norm = dummy[i].norm() if sqs[i] is None else sqs[i].sqrt()
            cos = dots[i] / (norm * self.target_sq[i].sqrt() + 1e-20)
            total = total + w[i] * (1.0 - cos)
        return total / self.weight_sum


def gradient_distance(dummy: Sequence[torch.Tensor], target: Sequence[torch.Tensor], *, kind: str,
                      weights: Sequence[float]) -> torch.Tensor:
    """:class:`GradientDistance` as a pure function of dense dummy and target gradients (the same arithmetic, in
    the same order), so that ``torch.func.vmap`` can map it over stacked targets of independent problems."""
    active = [i for i, w in enumerate(weights) if w != 0.0]
    if kind == "l2":
        return sum(weights[i] * (dummy[i] - target[i]).pow(2).sum() for i in active)
    dots = {i: (dummy[i] * target[i]).sum() for i in active}
    if kind == "cosine":
        dot = sum(weights[i] * dots[i] for i in active)
        norm = torch.sqrt(sum(weights[i] * dummy[i].pow(2).sum() for i in active))
        target_norm = torch.sqrt(sum(weights[i] * target[i].pow(2).sum() for i in active))
        return 1.0 - dot / (norm * target_norm + 1e-20)
    if kind != "cosine-layer":
        raise ConfigError(f"expected distance in {DISTANCES}, got {kind!r}")
    total = 0.0
    for i in active:
        cos = dots[i] / (dummy[i].norm() * target[i].pow(2).sum().sqrt() + 1e-20)
        total = total + weights[i] * (1.0 - cos)
    return total / float(sum(weights[i] for i in active))


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of horizontally and vertically neighbouring pixels (0 for vectors)."""
    if x.dim() < 4:
        return x.new_zeros(())
    dx = (x[..., :, 1:] - x[..., :, :-1]).abs().mean()
    dy = (x[..., 1:, :] - x[..., :-1, :]).abs().mean()
    return dx + dy


def bn_statistics(dummy: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  target: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Σ over BN layers of ‖μ − μ*‖₂ + ‖σ² − σ²*‖₂."""
    return sum((m - mt).norm() + (v - vt).norm() for (m, v), (mt, vt) in zip(dummy, target))
