"""Neurons at the hinge: which side of a ReLU a recovered sample sits on, where its own precision cannot tell (ours).

A sample recovered to ε (max-abs) leaves each pre-activation z_ij = W_j x̂_i + b_j within ε‖W_j‖₁ of the true one.
Where |z_ij| is inside that reach, x̂ cannot say whether sample i activated neuron j, yet δ(x̂_i, y_i) takes x̂'s side,
and the wrong side moves ∂L/∂W's row j by a whole term δ_ij x_iᵀ (the unit's back-propagated value, not a small one).
At B = 256 a batch has half a million (sample, neuron) pairs and the nearest sits ~1e-7 from the hinge: one such
flip left the whole-gradient residual of an exact batch (every sample within 8e-6) at 1.2e-3, and the joint
certificate refused it.

The observed gradient decides instead.  The pair's inactive δ_ij is 0; its active one is x̂'s own where x̂ is active
there, else what the rest of the model gives at a pre-activation of +tiny (nothing downstream moves).  The side that
fits row j of ∂L/∂W and ∂L/∂b better is kept.  The flips are greedy, one per row and round (two pairs on one
row interact).  A point within ε of x̂ may take either side of each of these hinges, so the δ chosen is still
that of a sample within the precision the certificate claims.
"""
from __future__ import annotations

import torch

from .peeling import SampleGradients

__all__ = ["hinge_deltas"]


def hinge_deltas(grads: SampleGradients, inputs: torch.Tensor, labels: torch.Tensor, target_w: torch.Tensor,
                 target_b: torch.Tensor, reach: float, *, scale: float = 1.0, rounds: int = 4
                 ) -> tuple[torch.Tensor, int]:
    """δ(x̂, y)·``scale`` (K×m) for the recovered ``inputs`` (K×n), with every pre-activation within ``reach``·‖W_j‖₁
    of zero (``reach``: the samples' max-abs precision) set to the side that best fits ``target_w`` (m×n) and
    ``target_b`` (m), the gradient the K samples make together.  Returns the δ and the number of pairs flipped
    from x̂'s own side."""
    pre = inputs @ grads.weight.T + grads.bias                                 # K×m
    deltas = scale * grads.at_pre(pre, labels)
    near = pre.abs() <= reach * grads.weight.abs().sum(1)
    if not bool(near.any()):
        return deltas, 0
    active = pre[near] > 0
    # the active side's δ_ij: x̂'s own where it is active there, else the rest of the model at a pre-activation of
    # +tiny (nothing downstream moves); the inactive side's is 0
    lifted = pre.masked_fill(near & (pre <= 0), torch.finfo(pre.dtype).tiny)
    on = deltas[near] if bool(active.all()) else \
        torch.where(active, deltas[near], scale * grads.at_pre(lifted, labels)[near])
    rows, cols = near.nonzero().unbind(1)                                     # sample i, neuron j per pair
    sq = inputs.pow(2).sum(1)[rows] + 1.0                                     # ‖[x_i, 1]‖²
    # ⟨[R_j, r_j], [x_i, 1]⟩ with R = T − Δᵀ X: T Xᵀ once, then Δᵀ (X Xᵀ) per round (K×K, not m×n)
    target_x, gram = target_w @ inputs.T, inputs @ inputs.T                   # m×K, K×K
    flipped = torch.zeros_like(active)
    for _ in range(rounds):
        fit = (target_x - deltas.T @ gram)[cols, rows] + (target_b - deltas.sum(0))[cols]
        step = torch.where(active, -on, on)                                   # δ_ij's change if flipped
        gain = 2 * step * fit - step.pow(2) * sq                              # drop of row j's squared residual
        best = torch.full((target_w.shape[0],), -float("inf"), dtype=gain.dtype, device=gain.device)
        best = best.scatter_reduce(0, cols, gain, "amax")
        flip = (gain > 0) & (gain == best[cols])
        if not bool(flip.any()):
            break
        active = active ^ flip
        flipped = flipped ^ flip
        deltas[rows[flip], cols[flip]] = (on * active)[flip]
    return deltas, int(flipped.sum())
