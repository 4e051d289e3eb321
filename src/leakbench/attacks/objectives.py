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
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ConfigError

DISTANCES = ("l2", "cosine", "cosine-layer")
LAYER_WEIGHTS = ("equal", "l0")


def layer_weights(kind: "str | Sequence[float]", params: Sequence[torch.Tensor]) -> list[float]:
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

    def __call__(self, dummy: Sequence[torch.Tensor]) -> torch.Tensor:
        w, t = self.weights, self.target
        if self.kind == "l2":
            return sum(w[i] * (dummy[i] - t[i]).pow(2).sum() for i in self.active)
        if self.kind == "cosine":
            dot = sum(w[i] * (dummy[i] * t[i]).sum() for i in self.active)
            norm = torch.sqrt(sum(w[i] * dummy[i].pow(2).sum() for i in self.active))
            return 1.0 - dot / (norm * self.target_norm_all + 1e-20)
        total = 0.0
        for i in self.active:
            cos = (dummy[i] * t[i]).sum() / (dummy[i].norm() * self.target_sq[i].sqrt() + 1e-20)
            total = total + w[i] * (1.0 - cos)
        return total / self.weight_sum


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
