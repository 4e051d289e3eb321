"""Directions of SPEAR's factorisation read through the next linear layer (leakbench's, not a paper's).

SPEAR (Dimitrov et al., NeurIPS 2024, Sec. 3) factorises a ReLU layer's weight gradient ∂L/∂W = L R (m×n, rank B)
and looks for the B directions q with L q sparse: column i of ∂L/∂Z, g_i = L q_i, vanishes on the neurons sample i
leaves inactive.  SPEAR finds them as kernels of L on B − 1 rows that one sample leaves inactive; similar samples
(digits) share their inactive rows, and those kernels are then several samples wide.

When the layer's outputs go through the ReLU into a linear layer W₂ (m₂×m), the chain rule says more than "sparse":

    g_i = D_i ⊙ (W₂ᵀ v_i),   D_i = 1[W x_i + b > 0],   v_i = ∂L/∂z₂ of sample i (m₂ numbers; the output's
                                                       p_i − e_{y_i} over B when W₂ is the last layer).

So the unknowns of one direction are q (B numbers) and v (m₂), and every neuron j gives one of two linear equations:
L_j q = 0 (j inactive) or L_j q = W₂[:, j]ᵀ v (active).  With the pattern D fixed, q is eliminated (L q is the
projection of D ⊙ W₂ᵀ v onto the column span of L) and v is the generalized eigenvector of the smallest eigenvalue of
(NᵀP⊥N, NᵀN), N = D ⊙ W₂ᵀ (m×m₂), P⊥ the projector off span L: exactly 0 at a sample's own pattern.  From a pattern
with some wrong neurons the solve is near the sample, and each neuron is re-assigned to the equation it satisfies
better, until the pattern stops changing (an alternating, k-subspaces-style iteration).

Starting patterns come from candidate inputs (the rows SPEAR proposes from): D = 1[W x + b > 0].  Neurons whose
pre-activation is near zero are the ones a nearby sample is likely to flip, so the first solve leaves out the fraction
``drop`` of the least certain neurons (|w_j·x + b_j|/‖w_j‖ smallest), several fractions in turn.  Measured (float64,
digits 28×28 deform 0, ``mlp:1000`` untrained, B = 128, batch from indices < 900): from the gradient's rows, 98, 103,
109 and 117 of the 128 directions exact at drop 0.35 / 0.5 / 0.65 / 0.8 (123 together), 104 with no drop; SPEAR's
own kernels found 118 on that batch.  A direction returned here is a proposal: :func:`.sparse_span.refine` and
SPEAR's sparsity filter judge it like any other, and nothing is certified by this module.
"""
from __future__ import annotations

import time

import torch

from .sparse_span import NULL_SE, unique_columns, zero_band, ZERO_BAND

__all__ = ["next_layer_directions", "usable", "DROPS"]

#: fractions of the least certain neurons left out of the first solve (each tried in turn)
DROPS = (0.35, 0.5, 0.65, 0.8)
#: re-assignments of the neurons per start (they stop earlier when the pattern is stable)
ITERATIONS = 30
#: doubles a chunk of starts may hold in its largest tensor (starts × m × rank): bounds the memory at large B
CHUNK_DOUBLES = 2 ** 24
#: a start's solve is kept when its generalized eigenvalue ‖P⊥ N v‖² / ‖N v‖² is at most this (exact: round-off;
#: a relative residual of 3e-5 at most)
ACCEPT = 1e-9


def usable(live_rows: int, rank: int, width: int) -> bool:
    """The next layer pins a direction when the neurons outnumber the unknowns well: m ≥ 2(B + m₂)."""
    return width >= 1 and live_rows >= 2 * (rank + width)


def _smallest(nn: torch.Tensor, pp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest generalized eigenpair of (PP, NN) per start (k×m₂×m₂ each): vectors k×m₂, values k."""
    eye = torch.eye(nn.shape[-1], dtype=nn.dtype, device=nn.device)
    ridge = 1e-12 * nn.diagonal(dim1=1, dim2=2).mean(1).clamp_min(torch.finfo(nn.dtype).tiny)
    chol, bad = torch.linalg.cholesky_ex(nn + ridge[:, None, None] * eye)
    bad = (bad != 0) | ~torch.isfinite(pp).all(2).all(1)
    chol = torch.where(bad[:, None, None], eye, chol)             # a singular start: answered, then dropped
    inv = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
    sym = inv @ torch.where(bad[:, None, None], eye, pp) @ inv.transpose(1, 2)
    values, vectors = torch.linalg.eigh((sym + sym.transpose(1, 2)) / 2)
    v = (inv.transpose(1, 2) @ vectors[:, :, :1]).squeeze(2)
    return v, values[:, 0].masked_fill(bad, float("inf"))


class _Layer:
    """The products the iteration needs, for patterns given as rows (k×m): with N = D ⊙ W₂ᵀ,
    NᵀN = Σ_j D_j w_j w_jᵀ and SᵀN = Σ_j D_j s_j w_jᵀ (S the orthonormal basis of span L), one GEMM each."""

    def __init__(self, span: torch.Tensor, wt: torch.Tensor) -> None:
        self.span, self.wt = span, wt
        m, r, w = span.shape[0], span.shape[1], wt.shape[1]
        self.ww = (wt[:, :, None] * wt[:, None, :]).reshape(m, w * w)
        self.sw = (span[:, :, None] * wt[:, None, :]).reshape(m, r * w)

    def solve(self, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """v (k×m₂), the eigenvalue (k) and L q = S Sᵀ N v (m×k) for each pattern."""
        k, r, w = masks.shape[0], self.span.shape[1], self.wt.shape[1]
        nn = (masks @ self.ww).reshape(k, w, w)
        sn = (masks @ self.sw).reshape(k, r, w)
        v, value = _smallest(nn, nn - sn.transpose(1, 2) @ sn)
        return v, value, self.span @ (sn @ v[:, :, None]).squeeze(2).T

    def reassign(self, lq: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Each neuron to the equation it satisfies better: active when |L_j q − W₂[:, j]ᵀv| < |L_j q|."""
        return ((lq - self.wt @ v.T).abs() < lq.abs()).T.to(lq.dtype)


def _first(layer: _Layer, masks: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The first solve on the ``kept`` neurons only (k×m each, the same count per start), re-assigned over all
    neurons: the next patterns.  The kept rows' Gram matrix Gₖ = SᵀKS is formed from whichever of the kept or the
    left-out rows are fewer (SᵀS = I), so the cost is k·min(kept, left out)·r²; NᵀPN = (SᵀKN)ᵀGₖ⁻¹(SᵀKN)."""
    span, wt = layer.span, layer.wt
    k, m, r, w = masks.shape[0], span.shape[0], span.shape[1], wt.shape[1]
    count = int(kept[0].sum())
    few = kept if count <= m - count else 1 - kept
    rows = few.argsort(dim=1, descending=True, stable=True)[:, :min(count, m - count)]   # k×c
    part = span[rows]                                                                      # k×c×r
    gram = part.transpose(1, 2) @ part
    if few is not kept:
        gram = torch.eye(r, dtype=span.dtype, device=span.device) - gram
    chol, bad = torch.linalg.cholesky_ex(gram)
    bad = bad != 0                                   # fewer kept neurons than the rank: that start keeps its pattern
    chol = torch.where(bad[:, None, None], torch.eye(r, dtype=span.dtype, device=span.device), chol)
    km = masks * kept
    nn = (km @ layer.ww).reshape(k, w, w)
    sn = (km @ layer.sw).reshape(k, r, w)
    half = torch.linalg.solve_triangular(chol, sn, upper=False)                            # Lₖ⁻¹ SᵀKN
    v, value = _smallest(nn, nn - half.transpose(1, 2) @ half)
    full = (masks @ layer.sw).reshape(k, r, w)
    lq = span @ (full @ v[:, :, None]).squeeze(2).T
    new = layer.reassign(lq, v)
    return torch.where(bad[:, None], masks, new)


def _solve(layer: _Layer, masks: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Alternate solve and re-assignment from ``masks`` (k×m), the first solve on the ``kept`` neurons only, each
    start until its pattern is stable; returns the final projections L q (m×k) and eigenvalues (k)."""
    masks = _first(layer, masks, kept)
    k = masks.shape[0]
    lq_all = masks.new_zeros(layer.span.shape[0], k)
    values = masks.new_full((k,), float("inf"))
    active = torch.arange(k, device=masks.device)
    for _ in range(ITERATIONS + 1):
        v, value, lq = layer.solve(masks)
        lq_all[:, active], values[active] = lq, value
        new = layer.reassign(lq, v)
        moving = (new != masks).any(1)
        if not bool(moving.any()):
            break
        active, masks = active[moving], new[moving]
    return lq_all, values


def next_layer_directions(left: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, next_weight: torch.Tensor,
                          inputs: torch.Tensor, *, drops: tuple[float, ...] = DROPS, deadline: float = float("inf"),
                          right: torch.Tensor | None = None, floor: float = 0.0) -> torch.Tensor:
    """Unit directions q (r×K, in ``left``'s coordinates) whose L q fits g = D ⊙ W₂ᵀv exactly, from the patterns of
    ``inputs`` (K₀×n candidate inputs of the layer ``weight``/``bias``); ``next_weight`` is W₂ (m₂×m).  With the
    gradient's error (``right`` = ΣVᵀ of an orthonormal ``left``, ``floor`` per entry) "exactly" is to that error:
    g's part off span L is then about √m·floor‖Σ⁻¹q‖ (L's first-order error E V Σ⁻¹), which for the samples with
    the smallest gradients of a trained model's ill-conditioned gradient is above ``ACCEPT`` (ours)."""
    left, weight, bias = left.double(), weight.double(), bias.double()
    wt = next_weight.detach().double().T.to(left.device)                # m×m₂
    span, tri = torch.linalg.qr(left)                                    # L = span · tri, span orthonormal
    z = inputs.double().to(left.device) @ weight.T + bias
    certainty = z.abs() / weight.norm(dim=1).clamp_min(torch.finfo(z.dtype).tiny)
    m, r = span.shape
    layer = _Layer(span, wt)
    chunk = max(1, CHUNK_DOUBLES // (m * max(r, wt.shape[1])))
    out = []
    for drop in drops:
        k = int(drop * m)
        for s in range(0, z.shape[0], chunk):
            if time.perf_counter() > deadline:
                break
            zs, cs = z[s:s + chunk], certainty[s:s + chunk]
            kept = torch.zeros_like(cs).scatter_(1, cs.argsort(dim=1)[:, k:], 1.0)   # the m − k most certain
            lq, value = _solve(layer, (zs > 0).to(z.dtype), kept)
            q = torch.linalg.solve_triangular(tri, span.T @ lq, upper=True)
            bound = torch.full_like(value, ACCEPT)
            if right is not None and floor:
                unit = q / q.norm(dim=0, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
                error = zero_band(right, unit, floor) / ZERO_BAND
                bound = torch.maximum(bound, NULL_SE ** 2 * m * error.pow(2))
            ok = torch.isfinite(value) & (value <= bound)
            if bool(ok.any()):
                out.append(q[:, ok])
    if not out:
        return left.new_zeros(r, 0)
    q = torch.cat(out, 1)
    q = q / q.norm(dim=0, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
    return q[:, unique_columns(q)]   # many starts reach the same sample
