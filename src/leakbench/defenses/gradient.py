"""Defenses on the shared gradient (or update): prune, clip, noise, graddrop, quantize.

Liu et al. (2024), Sec. 3 and 5.1 (and the observation models of App. E):

- ``prune:p[,scope]`` — gradient pruning (Sun et al. 2017; App. E.4 operator P): zero the
  fraction p of entries with the smallest magnitude, over the whole gradient (``global``,
  the paper's P thresholds every coordinate with one γ) or within each tensor (``layer``,
  as in DLG's defense).  Exactly ⌊p·n⌋ entries are zeroed (ties broken arbitrarily).
- ``clip:C[,scope]`` — gradient clipping (Sec. 3.2 and App. E.2): G / max(1, ‖G‖/C) with ‖G‖
  the norm of the whole gradient (``global``, the formula of Sec. 3.2 and E.2), or
  g_l / max(1, ‖g_l‖/C) for every parameter tensor g_l on its own (``layer``, a reading of
  Sec. 5.1, "shrinks individual model gradients when their norm exceeds a given threshold";
  per-layer clipping as in McMahan et al. 2018).  Per-sample clipping, the clipping of
  breaching's ``per_example_clipping`` that Liu et al.'s code builds on, is ``dpsgd:C,0``
  (:mod:`.client`).  Each tensor is only multiplied by a positive factor, so an attack that
  scores every tensor by its own cosine (Liu et al.'s App. F objective) sees neither form.
- ``noise:σ`` — gradient noise (Sec. 3, Theorem 3.2): G + ε, ε ~ N(0, σ² I).
- ``graddrop:p`` — gradient dropout (Sec. 5.1, App. E.1): every entry is set to 0
  independently with probability p (no rescaling: E.1 "setting them to 0").
- ``quantize:bits[,stochastic]`` — not in the paper (users expect it; Zhu et al. 2019 try
  half precision and int8): symmetric uniform quantisation of each tensor to 2^(bits−1) − 1
  levels per sign of max|g|, rounding to nearest or, with ``stochastic``, unbiased random
  rounding (QSGD, Alistarh et al. 2017).

Each is a pure function on a list of tensors with a thin registered class on top.
"""
from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from .base import Defense, check_choice, check_fraction, check_positive, register

PRUNE_SCOPES = ("global", "layer")
CLIP_SCOPES = ("global", "layer")


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)


def _unflat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    sizes = [g.numel() for g in like]
    return [part.view_as(g) for part, g in zip(torch.split(flat, sizes), like)]


def pruned_count(p: float, n: int) -> int:
    """How many of ``n`` entries pruning the fraction ``p`` zeroes: ⌊p·n⌋ (robust to float error)."""
    return min(n, int(math.floor(p * n + 1e-9 * max(1, n))))


def keep_mask(magnitude: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean mask keeping the n − ⌊p·n⌋ largest entries of the 1-D ``magnitude``."""
    n = magnitude.numel()
    keep = n - pruned_count(p, n)
    mask = torch.zeros(n, dtype=torch.bool, device=magnitude.device)
    if keep > 0:
        mask[torch.topk(magnitude, keep, sorted=False).indices] = True
    return mask


def prune(grads: list[torch.Tensor], p: float, *, scope: str = "global") -> list[torch.Tensor]:
    """Zero the fraction ``p`` of smallest-magnitude entries, over all tensors or within each."""
    if p <= 0 or not grads:
        return list(grads)
    if scope == "global":
        flat = _flat(grads)
        return _unflat(flat * keep_mask(flat.abs(), p), grads)
    return [g * keep_mask(g.reshape(-1).abs(), p).view_as(g) for g in grads]


def global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """‖G‖: the Euclidean norm of all tensors together."""
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
    return torch.linalg.vector_norm(norms).to(grads[0].dtype)


def clip(grads: list[torch.Tensor], max_norm: float, *, scope: str = "global") -> list[torch.Tensor]:
    """G / max(1, ‖G‖/C) (``global``: the whole gradient to norm ≤ ``max_norm``) or, with ``scope="layer"``,
    g_l / max(1, ‖g_l‖/C) for every tensor g_l (each tensor to norm ≤ ``max_norm``)."""
    if not grads:
        return []
    tiny = torch.finfo(grads[0].dtype).tiny
    if check_choice(scope, "scope", "clip", CLIP_SCOPES) == "layer":
        return [g * torch.clamp(max_norm / torch.linalg.vector_norm(g).clamp_min(tiny), max=1.0) for g in grads]
    factor = torch.clamp(max_norm / global_norm(grads).clamp_min(tiny), max=1.0)
    return [g * factor for g in grads]


def randn_like(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """N(0, 1) of ``t``'s shape drawn from ``generator`` (on its device), cast to ``t``'s dtype and device."""
    return torch.randn(t.shape, generator=generator, device=generator.device,
                       dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).to(t)


def add_noise(grads: list[torch.Tensor], sigma: float, *, generator: torch.Generator) -> list[torch.Tensor]:
    """G + ε with ε ~ N(0, σ² I)."""
    if sigma == 0:
        return list(grads)
    return [g + sigma * randn_like(g, generator) for g in grads]


def drop(grads: list[torch.Tensor], p: float, *, generator: torch.Generator) -> list[torch.Tensor]:
    """Zero every entry independently with probability ``p``."""
    if p == 0:
        return list(grads)
    out = []
    for g in grads:
        keep = torch.rand(g.shape, generator=generator, device=generator.device) >= p
        out.append(g * keep.to(g.device))
    return out


def quantize(grads: list[torch.Tensor], bits: int, *, stochastic: bool = False,
             generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Each tensor on the grid {k·s/L : |k| ≤ L}, s = max|g|, L = 2^(bits−1) − 1."""
    levels = 2 ** (bits - 1) - 1
    out = []
    for g in grads:
        scale = g.abs().max()
        if float(scale) == 0.0:
            out.append(g.clone())
            continue
        v = g / scale * levels
        if stochastic:
            if generator is None:
                raise ConfigError("stochastic quantisation needs a generator")
            u = torch.rand(g.shape, generator=generator, device=generator.device).to(g)
            q = torch.floor(v + u)
        else:
            q = torch.round(v)
        out.append(q.clamp(-levels, levels) * (scale / levels))
    return out


@register("prune", help="gradient pruning: zero the fraction p of smallest-magnitude entries (prune:p[,global|layer])")
class Prune(Defense):
    def __init__(self, p: float, scope: str = "global") -> None:
        self.p = check_fraction(p, "the pruned fraction p", "prune")
        self.scope = check_choice(scope, "scope", "prune", PRUNE_SCOPES)

    def apply_gradients(self, grads, *, generator):
        return prune(grads, self.p, scope=self.scope)


@register("clip", help="gradient clipping: rescale the whole gradient, or each tensor, to norm ≤ C "
                       "(clip:C[,global|layer])")
class Clip(Defense):
    def __init__(self, C: float, scope: str = "global") -> None:
        self.C = check_positive(C, "the norm bound C", "clip")
        self.scope = check_choice(scope, "scope", "clip", CLIP_SCOPES)

    def apply_gradients(self, grads, *, generator):
        return clip(grads, self.C, scope=self.scope)

    def describe(self):
        return {"max_norm": self.C, "scope": self.scope}


@register("noise", help="gradient noise: add N(0, σ²) to every entry (noise:σ)")
class Noise(Defense):
    def __init__(self, sigma: float) -> None:
        self.sigma = check_positive(sigma, "the noise std σ", "noise", allow_zero=True)

    def apply_gradients(self, grads, *, generator):
        return add_noise(grads, self.sigma, generator=generator)

    def describe(self):
        return {"noise_std": self.sigma}


@register("graddrop", help="gradient dropout: zero every entry with probability p (graddrop:p)")
class GradDrop(Defense):
    def __init__(self, p: float) -> None:
        self.p = check_fraction(p, "the drop probability p", "graddrop")

    def apply_gradients(self, grads, *, generator):
        return drop(grads, self.p, generator=generator)


@register("quantize", help="uniform quantisation of each tensor to 2^(bits-1)-1 levels per sign "
                           "(quantize:bits[,stochastic])")
class Quantize(Defense):
    def __init__(self, bits: int = 8, stochastic: bool = False) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 32:
            raise ConfigError(f"expected bits an integer in 2..32 for defense 'quantize', got {bits!r}")
        self.bits = bits
        self.stochastic = bool(stochastic)

    def apply_gradients(self, grads, *, generator):
        return quantize(grads, self.bits, stochastic=self.stochastic, generator=generator)


__all__ = ["prune", "clip", "add_noise", "drop", "quantize", "global_norm", "pruned_count", "randn_like", "keep_mask",
           "Prune", "Clip", "Noise", "GradDrop", "Quantize", "PRUNE_SCOPES", "CLIP_SCOPES"]
