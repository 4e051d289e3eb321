"""One-to-one matching of reconstructions to originals.

A batched gradient sums the per-sample gradients, so it carries the batch as
an unordered set: an attack recovers the samples but not their order.  Scores
are therefore taken after the best one-to-one assignment, as in Liu et al.
(2024), "Data reconstruction attacks and defenses: a systematic evaluation",
eq. (1):

    d(S, π(Ŝ)) = (1/B) Σ_i ‖S_i − Ŝ_π(i)‖²,   minimised over permutations π.

:func:`match` solves that assignment exactly with the Hungarian method
(``scipy.optimize.linear_sum_assignment``) on the matrix of per-pair MSEs
(MSE = squared norm / dimension, so the optimal π is the same as for eq. (1)),
or on negative cosine similarities.  Cost matrices are built with batched
tensor operations, never a Python loop over pairs.

Minimising the *total* error can pair an exact reconstruction with the wrong
original: when a poor reconstruction lies much closer to the exact slot's
original than to any other, giving it that original and the exact slot a
near miss lowers the sum.  Two alternatives (``method``):

- ``"confident-first"`` — the slots an attack flags as exactly recovered
  (``confident``) are matched first, among themselves (Hungarian on their
  columns of the cost matrix: each takes its nearest original whenever no two
  compete), then the rest by eq. (1) on what is left.  An exact slot then always
  keeps its own original (unless two flagged slots are identical).
- ``"minmax"`` — the bottleneck assignment, minimising the largest per-pair
  cost (ties broken by the smallest total): a binary search over the sorted
  costs for the smallest threshold t whose graph {cost ≤ t} has a matching of
  every original (``scipy.sparse.csgraph.maximum_bipartite_matching``), then
  the Hungarian method restricted to those pairs.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy.sparse import csr_matrix

from ..errors import ConfigError
from .image import _as_tensor, _f64

__all__ = ["match", "pairwise_mse", "COSTS", "METHODS"]

#: Cost names accepted by :func:`match`.
COSTS = ("mse", "negcos")
#: Matching methods of :func:`match`: Liu et al.'s eq. (1), flagged slots first, bottleneck.
METHODS = ("total-mse", "confident-first", "minmax")


def _flat_pair(a: object, b: object, *, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    a = _as_tensor(a, "a")
    b = _as_tensor(b, "b")
    if a.ndim == 0 or b.ndim == 0 or a.shape[1:] != b.shape[1:]:
        raise ConfigError(
            f"expected batches with the same per-sample shape for {what}, "
            f"got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[0] == 0 or b.shape[0] == 0 or a[0].numel() == 0:
        raise ConfigError(f"expected non-empty batches for {what}, got {tuple(a.shape)} and {tuple(b.shape)}")
    fa = _f64(a)
    fb = _f64(b).to(fa.device)
    return fa.reshape(a.shape[0], -1), fb.reshape(b.shape[0], -1)


def pairwise_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Matrix of MSEs between every sample of ``a`` (Na×…) and of ``b`` (Nb×…); shape (Na, Nb), float64.

    Entry (i, j) is ``mean((a[i] - b[j])²)``, computed as
    ``(‖a_i‖² + ‖b_j‖² − 2 a_i·b_j) / d`` with one matrix product (clamped at 0
    against round-off).
    """
    fa, fb = _flat_pair(a, b, what="pairwise_mse")
    sq = fa.square().sum(dim=1, keepdim=True) + fb.square().sum(dim=1)[None, :] - 2.0 * fa @ fb.T
    return sq.clamp_min(0.0) / fa.shape[1]


def _pairwise_negcos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    fa, fb = _flat_pair(a, b, what="pairwise cosine")
    fa = fa / fa.norm(dim=1, keepdim=True).clamp_min(1e-12)
    fb = fb / fb.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return -(fa @ fb.T)


def _hungarian(costs: np.ndarray) -> np.ndarray:
    """cols[i] for every row i of a (rows ≤ cols) cost matrix, minimising the total."""
    from scipy.optimize import linear_sum_assignment  # lazy: `import leakbench` skips scipy
    rows, cols = linear_sum_assignment(costs)
    out = np.empty(costs.shape[0], dtype=np.int64)
    out[rows] = cols
    return out


def _confident_first(costs: np.ndarray, confident: np.ndarray) -> np.ndarray:
    """Flagged columns matched first (among themselves), then eq. (1) on the remaining rows and columns."""
    from scipy.optimize import linear_sum_assignment  # lazy: `import leakbench` skips scipy
    b = costs.shape[0]
    perm = np.full(b, -1, dtype=np.int64)
    flagged = np.flatnonzero(confident)
    if flagged.size:
        rows, cols = linear_sum_assignment(costs[:, flagged])  # min(B, #flagged) pairs
        perm[rows] = flagged[cols]
    free_rows = np.flatnonzero(perm < 0)
    if free_rows.size:
        free_cols = np.setdiff1d(np.arange(costs.shape[1]), perm[perm >= 0])
        perm[free_rows] = free_cols[_hungarian(costs[np.ix_(free_rows, free_cols)])]
    return perm


def _minmax(costs: np.ndarray) -> np.ndarray:
    """The bottleneck assignment (smallest largest cost), the smallest total among those."""
    from scipy.sparse.csgraph import maximum_bipartite_matching  # lazy: `import leakbench` skips scipy
    b = costs.shape[0]
    values = np.unique(costs)
    lo, hi = 0, values.size - 1  # the full graph matches every row: values[hi] is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        graph = csr_matrix(costs <= values[mid])
        if int((maximum_bipartite_matching(graph, perm_type="column") >= 0).sum()) == b:
            hi = mid
        else:
            lo = mid + 1
    allowed = costs <= values[lo]
    spread = float(costs.max() - costs.min()) + 1.0
    return _hungarian(np.where(allowed, costs, costs.max() + spread * (b + 1)))


def match(reconstruction: torch.Tensor, originals: torch.Tensor, *, cost: str = "mse",
          method: str = "total-mse", confident: torch.Tensor | None = None) -> torch.Tensor:
    """The best one-to-one assignment of reconstructions to originals (Liu et al. 2024, eq. (1)).

    Returns a LongTensor ``perm`` (CPU) of length B = ``len(originals)`` with
    distinct entries such that ``reconstruction[perm[i]]`` is matched to
    ``originals[i]`` and ``Σ_i cost(reconstruction[perm[i]], originals[i])`` is
    minimal.  ``cost`` is ``"mse"`` (per-pair mean squared error) or
    ``"negcos"`` (negative cosine similarity of the flattened samples).

    ``method``: ``"total-mse"`` (default, eq. (1): the smallest total cost),
    ``"confident-first"`` (the reconstructions flagged in ``confident`` — a bool
    or 0/1 tensor, one entry per reconstruction — are matched first, then eq. (1)
    on the rest) or ``"minmax"`` (the smallest largest cost); see the module text.

    There may be more reconstructions than originals (e.g. an attack that
    returns several candidates per sample): each original then gets one
    distinct reconstruction and the rest are left out.  Fewer reconstructions
    than originals is an error.  Non-finite costs (NaN reconstructions) are
    replaced by a value larger than any finite one, so such pairs are used
    only when nothing else is left.
    """
    if cost not in COSTS:
        raise ConfigError(f"expected cost one of {', '.join(COSTS)}, got {cost!r} (field cost)")
    if method not in METHODS:
        raise ConfigError(f"expected method one of {', '.join(METHODS)}, got {method!r} (field method)")
    rec = _as_tensor(reconstruction, "reconstruction")
    orig = _as_tensor(originals, "originals")
    if rec.ndim == 0 or orig.ndim == 0 or rec.shape[1:] != orig.shape[1:]:
        raise ConfigError(
            "expected reconstruction and originals with the same per-sample shape, "
            f"got {tuple(rec.shape)} and {tuple(orig.shape)}"
        )
    if rec.shape[0] < orig.shape[0]:
        raise ConfigError(
            f"expected at least as many reconstructions as originals, got {rec.shape[0]} "
            f"reconstructions for {orig.shape[0]} originals (shapes {tuple(rec.shape)} and {tuple(orig.shape)})"
        )
    flags = None
    if method == "confident-first":
        if confident is None:
            raise ConfigError("method 'confident-first' needs the flags of the exactly recovered slots "
                              "(argument confident, one entry per reconstruction)")
        flags = torch.as_tensor(confident).detach().cpu().reshape(-1)
        if flags.numel() != rec.shape[0]:
            raise ConfigError(f"expected {rec.shape[0]} confidence flags (one per reconstruction), "
                              f"got {flags.numel()} (argument confident)")
        flags = (flags > 0.5).numpy() if flags.dtype != torch.bool else flags.numpy()
    costs = pairwise_mse(orig, rec) if cost == "mse" else _pairwise_negcos(orig, rec)  # (B, Nr)
    costs = costs.detach().cpu()
    finite = torch.isfinite(costs)
    if not bool(finite.all()):
        top = costs[finite].abs().max().item() if bool(finite.any()) else 0.0
        costs = torch.where(finite, costs, torch.full_like(costs, (top + 1.0) * (costs.shape[0] + 1)))
    c = costs.numpy()
    if method == "total-mse":
        perm = _hungarian(c)
    elif method == "confident-first":
        perm = _confident_first(c, flags)
    else:
        perm = _minmax(c)
    return torch.as_tensor(perm, dtype=torch.long)
