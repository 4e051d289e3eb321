"""DAGER's span check (Petrov et al., NeurIPS 2024, Sec. 4–5): the row space of an attention input projection's
weight gradient and a candidate input's relative distance to it.  Shared by :mod:`.dager` (decoders, block 1)
and :mod:`.dager_encoder` (whole encoder sequences at block 2).
"""
from __future__ import annotations

import torch

__all__ = ["span_basis", "span_distance"]


def span_basis(grad: torch.Tensor, rank_tol: float, max_rank: int | None = None) -> torch.Tensor:
    """Orthonormal rows (r × d) spanning the row space of ``grad`` (out × d) (float64 SVD).

    r = #σ > rank_tol·σ_max, at most ``max_rank`` (the number of tokens behind the gradient, which
    bounds its rank, Sec. 4): a float32 gradient's noise floor is not a clean gap, and cutting at the
    token count keeps every true direction and few noise ones.
    """
    g = grad.detach().to(torch.float64)
    _, s, vh = torch.linalg.svd(g, full_matrices=False)
    if s.numel() == 0 or float(s[0]) == 0.0:
        return vh[:0]
    rank = int((s > rank_tol * s[0]).sum())
    return vh[: rank if max_rank is None else min(rank, max_rank)]


def span_distance(z: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """‖z − Π z‖ / ‖z‖ for every row of ``z`` (… × d): the relative distance to the span of ``basis``."""
    z = z.to(torch.float64)
    residual = z - (z @ basis.T) @ basis
    return residual.norm(dim=-1) / z.norm(dim=-1).clamp_min(1e-300)
