"""Neuron-exclusivity diagnostics of Pan, Zhang, Yan, Zhu & Yang (USENIX Security 2022).

For a ReLU MLP and a batch X = [x_1 … x_M] (d0 × M):

* ExAN counts: neuron j of hidden layer k is exclusively activated by sample m when it
  fires for m and for no other sample of the batch.
* Reconstructable regime (Proposition 2): a sample with ≥ 2 ExANs in the last hidden
  layer (its loss vector and label are read from them) and ≥ 1 ExAN in every other
  hidden layer is recovered exactly from the gradient, layer by layer.
* Theorem 2: the perturbations Δ (d0 × M) with W_0 Δ = 0 and A Δᵀ = 0, where
  A = [α_1 … α_M] (d1 × M) and α_m = ∂ℓ_m/∂z_1 the per-sample gradient at the first
  pre-activation, leave every shared gradient unchanged (the first layer's output is
  unchanged, and ∇W_0 = (1/M) A Xᵀ).  With E an orthonormal basis of null(W_0) and
  V one of null(A), they are Δ = E Θ Vᵀ, so the space has dimension
  (d0 − rank W_0)·(M − rank A).  The proof in the paper states M·(d0 − d1): the
  dimension of {W_0 Δ = 0} alone (its own Kronecker-rank step then subtracts
  d1·(d0 − d1) when M > d1).  We report the exact dimension (``theorem2_dim``, checked
  against a brute-force null space in the tests) and the paper's figure
  (``paper_dim``) side by side.
* The largest perturbation inside the box constraint (the paper's
  max (1/M) Σ_m ‖Δ_m‖² s.t. X + Δ ∈ box): the maximum of a convex function over a
  polytope is at a vertex; we take the best line search along seeded random
  directions of the space, then climb with linear programs (maximise ⟨Δ_t, Δ⟩ over the
  polytope; each step can only grow ‖Δ‖) while the problem is small enough.  The
  result is a feasible perturbation — a lower bound on the maximum — and is returned.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError, UnsupportedThreatModel
from ..losses import get_loss
from ..models.matrices import Chain, layer_chain

__all__ = ["ExclusivityReport", "exclusivity", "exan_counts", "theorem2_space"]

#: largest LP (constraint entries) the box search will build.
LP_LIMIT = 20_000_000


@dataclass
class ExclusivityReport:
    """ExAN counts, the reconstructable samples and Theorem 2's gradient-invariant space."""

    batch_size: int
    widths: list[int]
    exans: list[list[int]]
    reconstructable: list[bool]
    theorem2_dim: int
    paper_dim: int
    theorem2_applies: bool
    rank_w0: int
    rank_a: int
    free_samples: list[bool]
    max_perturbation: float
    max_perturbation_mean_sq: float
    box: tuple[float, float]
    notes: list[str] = field(default_factory=list)
    perturbation: torch.Tensor | None = None

    @property
    def reconstructable_count(self) -> int:
        return int(sum(self.reconstructable))

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("perturbation")
        out["box"] = list(self.box)
        out["reconstructable_count"] = self.reconstructable_count
        return out


def _relu_mlp(model: nn.Module, input_shape: Sequence[int]) -> Chain:
    chain = layer_chain(model, input_shape)
    blocks = chain.blocks
    if len(blocks) < 2 or any(b.kind != "linear" for b in blocks):
        raise UnsupportedThreatModel("neuron exclusivity needs a ReLU MLP: fully connected layers, ≥ 1 hidden layer")
    if any(b.act != "relu" for b in blocks[:-1]):
        raise UnsupportedThreatModel("neuron exclusivity needs ReLU after every hidden layer, got "
                                     + ", ".join(f"{b.name}: {b.act}" for b in blocks[:-1]))
    return chain


@torch.no_grad()
def exan_counts(chain: Chain, x: torch.Tensor) -> torch.Tensor:
    """M × H: for each sample, the neurons of each hidden layer that fire for it alone."""
    h = x.reshape(x.shape[0], -1)
    counts = []
    for block in chain.blocks[:-1]:
        h = torch.relu(block.layer(h))
        active = h > 0
        only = active & (active.sum(0, keepdim=True) == 1)
        counts.append(only.sum(1))
    return torch.stack(counts, dim=1)


def theorem2_space(w0: torch.Tensor, alphas: torch.Tensor, *, rcond: float = 1e-10
                   ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Bases E of null(W_0) (d0 × n) and V of null(A) (M × r), and the ranks of W_0 and A.

    ``alphas`` is M × d1 (row m = α_m); the space is {E Θ Vᵀ}.
    """
    w0 = w0.double()
    a = alphas.double().T  # d1 × M
    _, s0, vh0 = torch.linalg.svd(w0, full_matrices=True)
    rank_w0 = int((s0 > rcond * s0.max()).sum()) if s0.numel() else 0
    _, sa, vha = torch.linalg.svd(a, full_matrices=True)
    rank_a = int((sa > rcond * sa.max()).sum()) if sa.numel() and float(sa.max()) > 0 else 0
    return vh0[rank_w0:].T, vha[rank_a:].T, rank_w0, rank_a


def _step_limit(x: np.ndarray, d: np.ndarray, lo: float, hi: float) -> float:
    """Largest t ≥ 0 with lo ≤ x + t·d ≤ hi (x inside the box)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.where(d > 0, (hi - x) / d, np.inf)
        down = np.where(d < 0, (lo - x) / d, np.inf)
    return float(max(0.0, min(up.min(), down.min())))


def _largest_perturbation(x: np.ndarray, e: np.ndarray, v: np.ndarray, box: tuple[float, float], seed: int,
                          directions: int, lp_steps: int) -> np.ndarray:
    """A large feasible Δ = E Θ Vᵀ (d0 × M) with X + Δ in the box (see the module docstring)."""
    from scipy.optimize import linprog  # lazy: `import leakbench` skips scipy
    lo, hi = box
    n, r = e.shape[1], v.shape[1]
    rng = np.random.default_rng(seed)
    best, best_norm = np.zeros_like(x), 0.0
    for _ in range(directions):
        theta = rng.standard_normal((n, r))
        theta /= np.linalg.norm(theta)
        d = e @ theta @ v.T
        for sign in (1.0, -1.0):
            t = _step_limit(x, sign * d, lo, hi)
            if np.isfinite(t) and t > best_norm:
                best, best_norm = sign * t * d, t
    basis = None
    if x.size * n * r <= LP_LIMIT and best_norm > 0:
        basis = np.kron(v, e)  # vec(Δ) = (V ⊗ E) vec(Θ), column-major vec
    for _ in range(lp_steps if basis is not None else 0):
        c = basis.T @ best.reshape(-1, order="F")
        xv = x.reshape(-1, order="F")
        res = linprog(-c, A_ub=np.vstack([basis, -basis]), b_ub=np.concatenate([hi - xv, xv - lo]),
                      bounds=(None, None), method="highs")
        if res.status != 0:
            break
        cand = (basis @ res.x).reshape(x.shape, order="F")
        norm = float(np.linalg.norm(cand))
        if norm <= best_norm * (1 + 1e-9):
            break
        best, best_norm = cand, norm
    return best


def exclusivity(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None, *, loss: str = "ce",
                box: tuple[float, float] = (0.0, 1.0), seed: int = 0, directions: int = 64,
                lp_steps: int = 10) -> ExclusivityReport:
    """ExAN counts, the reconstructable samples and Theorem 2's invariant space for the batch ``x``.

    ``y`` are the labels (the α_m of Theorem 2 depend on them); without them the
    model's predictions stand in and ``notes`` says so.  ``box`` is the data range of
    the perturbation search, ``seed`` its random directions.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected an nn.Module (build one with leakbench.build), got {type(model).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ConfigError(f"expected x as a batch tensor M×…, got {getattr(x, 'shape', type(x).__name__)} (field x)")
    lo, hi = float(box[0]), float(box[1])
    if not lo < hi:
        raise ConfigError(f"expected box (lo, hi) with lo < hi, got {box!r} (field box)")
    chain = _relu_mlp(model, tuple(x.shape[1:]))
    ref = next(iter(model.parameters()))
    x = x.to(ref.device, ref.dtype)
    notes = []
    M = int(x.shape[0])
    with torch.no_grad():
        if y is None:
            y = model(x).argmax(-1)
            notes.append("labels not given: the model's predictions stand in for the α_m of Theorem 2")
    if y.shape[0] != M:
        raise ConfigError(f"expected one label per sample ({M}), got {tuple(y.shape)} (field y)")
    counts = exan_counts(chain, x)
    reconstructable = [(bool(c[-1] >= 2) and bool((c[:-1] >= 1).all())) for c in counts]

    first = chain.blocks[0].layer
    flat = x.reshape(M, -1)
    z1 = first(flat).detach().requires_grad_(True)
    rest = chain.tail(1)
    out = rest(torch.relu(z1))
    (alphas,) = torch.autograd.grad(get_loss(loss)(out, y.to(out.device)) * M, [z1])  # α_m = ∂ℓ_m/∂z_1
    e, v, rank_w0, rank_a = theorem2_space(first.weight.detach(), alphas.detach())
    d0, d1 = first.in_features, first.out_features
    dim = e.shape[1] * v.shape[1]
    free = [bool(e.shape[1] > 0 and v[m].abs().max() > 1e-10) for m in range(M)] if v.shape[1] else [False] * M
    perturbation = None
    norm = mean_sq = 0.0
    if dim > 0:
        inside = flat.detach().double().cpu().numpy().T  # d0 × M
        if (inside < lo - 1e-12).any() or (inside > hi + 1e-12).any():
            notes.append(f"the batch lies outside the box {box}; no perturbation searched")
        else:
            delta = _largest_perturbation(inside, e.cpu().numpy(), v.cpu().numpy(), (lo, hi), seed, directions,
                                          lp_steps)
            norm = float(np.linalg.norm(delta))
            mean_sq = float((delta ** 2).sum() / M)
            perturbation = torch.from_numpy(delta.T.copy()).reshape(x.shape).to(ref.dtype)
    widths = [d0] + [b.layer.out_features for b in chain.blocks[:-1]]
    return ExclusivityReport(
        batch_size=M, widths=widths, exans=counts.tolist(), reconstructable=reconstructable, theorem2_dim=dim,
        paper_dim=M * (d0 - d1) if d1 < d0 else 0, theorem2_applies=d1 < d0, rank_w0=rank_w0, rank_a=rank_a,
        free_samples=free, max_perturbation=norm, max_perturbation_mean_sq=mean_sq, box=(lo, hi), notes=notes,
        perturbation=perturbation)
