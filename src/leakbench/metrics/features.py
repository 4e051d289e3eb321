"""Feature reconstruction error (Liu et al. 2024, Sec. 5.1, "Metrics for reconstruction quality").

    error = (1/B) Σ_i ‖P⊥ t_i‖,    t_i = z_i / ‖z_i‖,

the mean norm of the projection of the (unit-normalised) true features z_i onto the orthogonal
complement of the span of the recovered features.  It lies in [0, 1], ignores order, sign and
scale of the recovered features, and — unlike a mean cosine — stays meaningful when several
features are alike (Liu et al.'s Table 2 reports it for the tensor step).
"""
from __future__ import annotations

import torch

from ..errors import ConfigError

__all__ = ["feature_error", "span_basis"]


def _matrix(t: object, field: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"expected a tensor of features (N×d), got {type(t).__name__} (field {field})")
    if t.ndim < 2 or t.shape[0] == 0 or t[0].numel() == 0:
        raise ConfigError(f"expected a non-empty batch of features N×d, got shape {tuple(t.shape)} (field {field})")
    return t.detach().reshape(t.shape[0], -1).to(torch.float64).cpu()


def span_basis(features: torch.Tensor, *, rtol: float | None = None) -> torch.Tensor:
    """Orthonormal basis (d×r) of the span of the rows of ``features`` (numerical rank r).

    Singular values below ``rtol``·σ_max count as zero; by default rtol = 10·max(N, d)·eps of the
    input's dtype (so float32 round-off does not add a dimension).
    """
    f = _matrix(features, "features")
    if rtol is None:
        eps = torch.finfo(features.dtype).eps if features.dtype.is_floating_point else torch.finfo(torch.float64).eps
        rtol = 10 * max(f.shape) * eps
    u, s, _ = torch.linalg.svd(f.T, full_matrices=False)
    rank = int((s > rtol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
    return u[:, :rank]


def feature_error(recovered: torch.Tensor, true: torch.Tensor) -> float:
    """Mean ‖P⊥_span(recovered) (z_i/‖z_i‖)‖ over the true features z_i (rows of ``true``)."""
    rec = _matrix(recovered, "recovered")
    tru = _matrix(true, "true")
    if rec.shape[1] != tru.shape[1]:
        raise ConfigError(f"expected recovered and true features of the same dimension, got "
                          f"{rec.shape[1]} and {tru.shape[1]} (fields recovered, true)")
    tru = tru / tru.norm(dim=1, keepdim=True).clamp_min(1e-300)
    basis = span_basis(rec)
    residual = tru - (tru @ basis) @ basis.T
    return float(residual.norm(dim=1).mean())
