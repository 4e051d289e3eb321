"""Cramér–Rao bounds on the error of unbiased reconstructions (Liu et al. 2024, Sec. 3, Table 1, App. D–E).

The bound holds for *unbiased* estimators of the batch only: an attack that clamps to the
data box or uses an image prior is biased and can reach a lower error (measured in sweeps:
box-constrained attacks below the bound at every noise setting).  Reports label it
"Cramér–Rao bound (unbiased estimators)".

The attacker observes O(S) = D(∇θ L(θ; S)) + ε, ε ~ N(0, σ² I), for the batch S of B
samples of dimension d and a defense D.  With J = ∇_S O (a (B·d) × P matrix, the paper's
convention; the transpose of ``torch.func.jacrev``'s output) the Cramér–Rao bound
(eq. 28) and its looser form through Lemma D.2 (eq. 29) bound the minimax risk of eq. (1),
whose distance carries a 1/B (Def. D.1, Theorem D.7):

    R_L² ≥ (1/B) · σ² · tr((J Jᵀ)⁻¹) ≥ (1/B) · σ² · (B·d)² / tr(J Jᵀ).

Defenses enter as in App. E: clipping (E.2, Lemma E.1) observes C·G/‖G‖ when ‖G‖ > C, so
J is the Jacobian of the clipped map (its scale is max(1, ‖G‖/C), reported as
``clip_scale``); pruning (E.4, Lemma E.3) zeroes the pruned coordinates, which removes
their rows from the Jacobian (the mask is locally constant), and p̂ = ‖J_pruned‖_F²/‖J‖_F².

:func:`two_layer_scaling` gives Table 1's rates for the two-layer random network
f(x) = Σ_j a_j σ(w_jᵀx) (up to constants and log factors), for plots.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, jacfwd, jacrev

from ..defenses.gradient import keep_mask
from ..errors import ConfigError
from ..losses import get_loss


@dataclass
class BoundResult:
    """Cramér–Rao lower bounds on the reconstruction error R_L of eq. (1) for one batch.

    ``exact`` = sqrt(σ² tr((JJᵀ)⁻¹)/B) (``inf`` when JJᵀ is singular: the gradient does not
    determine the batch), ``trace`` = sqrt(σ² (Bd)²/tr(JJᵀ)/B) ≤ ``exact``; ``*_rmse`` divide
    by sqrt(d): bounds on the per-entry RMSE that :func:`leakbench.compare` reports.
    """

    sigma: float
    batch_size: int
    dim: int
    observed: int
    exact: float
    trace: float
    exact_rmse: float
    trace_rmse: float
    fisher_trace: float
    rank: int
    grad_norm: float
    clip_scale: float = 1.0
    pruned_energy: float = 0.0


def _flat_gradient_map(model: nn.Module, y: torch.Tensor, loss: str, clip: float | None):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    loss_fn = get_loss(loss)

    def gradient(x: torch.Tensor) -> torch.Tensor:
        g = grad(lambda p: loss_fn(functional_call(model, p, (x,), strict=False), y))(params)
        return torch.cat([g[n].reshape(-1) for n in names])

    def observed(x: torch.Tensor) -> torch.Tensor:
        g = gradient(x)
        if clip is None:
            return g
        return g * torch.clamp(clip / torch.linalg.vector_norm(g), max=1.0)

    return gradient, observed


def cramer_rao(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, sigma: float, clip: float | None = None,
               prune: float | None = None, loss: str = "ce", jacobian: str = "rev",
               chunk_size: int | None = None) -> BoundResult:
    """The Cramér–Rao bound for reconstructing ``x`` from the defended gradient plus N(0, σ²) noise.

    ``model`` is evaluated in eval mode and float64 (a copy); ``clip`` = C clips the whole
    gradient to norm C before the noise, ``prune`` = p zeroes its fraction p of
    smallest-magnitude entries (global, after clipping).  J comes from
    ``torch.func.jacrev`` (``jacobian="fwd"`` uses ``jacfwd``, cheaper when the model has
    many more parameters than the batch has entries; ``chunk_size`` bounds jacrev's memory).
    """
    if not (isinstance(sigma, (int, float)) and sigma >= 0 and math.isfinite(sigma)):
        raise ConfigError(f"expected sigma ≥ 0 (the observation noise std), got {sigma!r} (field sigma)")
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise ConfigError(f"expected clip > 0 (the norm bound C) or None, got {clip!r} (field clip)")
    if prune is not None and not (isinstance(prune, (int, float)) and 0 <= prune < 1):
        raise ConfigError(f"expected prune in [0, 1) (the pruned fraction) or None, got {prune!r} (field prune)")
    if jacobian not in ("rev", "fwd"):
        raise ConfigError(f"expected jacobian 'rev' or 'fwd', got {jacobian!r} (field jacobian)")
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not isinstance(y, torch.Tensor) or y.shape[0] != x.shape[0]:
        raise ConfigError("expected a batch x (B × ...) and one label per sample in y (arguments x, y)")
    net = copy.deepcopy(model).to(device=x.device, dtype=torch.float64).eval()
    xd = x.detach().to(torch.float64)
    yd = y.detach().to(torch.float64) if y.dtype.is_floating_point else y.detach()
    gradient, observed = _flat_gradient_map(net, yd, loss, clip)
    with torch.no_grad():
        g = gradient(xd)
        o = observed(xd)
    grad_norm = float(torch.linalg.vector_norm(g))
    jac_fn = jacrev(observed, chunk_size=chunk_size) if jacobian == "rev" else jacfwd(observed)
    J = jac_fn(xd).reshape(o.numel(), -1)  # P × (B·d): rows are observed coordinates
    full_energy = float(J.pow(2).sum())
    if prune:
        J = J[keep_mask(o.abs(), float(prune))]
    kept_energy = float(J.pow(2).sum())
    batch, dim = int(x.shape[0]), int(xd[0].numel())
    fisher = J.T @ J  # the paper's J Jᵀ: (B·d) × (B·d)
    evals = torch.linalg.eigvalsh(fisher)
    tol = evals.max().clamp_min(0) * fisher.shape[0] * torch.finfo(torch.float64).eps
    rank = int((evals > tol).sum())
    total = batch * dim
    s2 = float(sigma) ** 2
    exact_sq = s2 * float((1.0 / evals).sum()) if rank == total else math.inf
    trace_sq = s2 * total ** 2 / kept_energy if kept_energy > 0 else math.inf
    exact, trace = math.sqrt(exact_sq / batch), math.sqrt(trace_sq / batch)
    return BoundResult(
        sigma=float(sigma), batch_size=batch, dim=dim, observed=int(J.shape[0]), exact=exact, trace=trace,
        exact_rmse=exact / math.sqrt(dim), trace_rmse=trace / math.sqrt(dim), fisher_trace=kept_energy, rank=rank,
        grad_norm=grad_norm, clip_scale=max(1.0, grad_norm / clip) if clip else 1.0,
        pruned_energy=1.0 - kept_energy / full_energy if full_energy > 0 else 0.0,
    )


# --------------------------------------------------------------------------- Table 1


TABLE1_DEFENSES = ("none", "local", "secagg", "noise", "clip", "dpsgd", "dropout", "graddrop", "prune")


@dataclass
class Scaling:
    """Table 1's rates: ``upper`` (tensor-based attack, Wang et al. 2023; ``None`` = unknown) and ``lower``."""

    defense: str
    upper: float | np.ndarray | None
    lower: float | np.ndarray


def two_layer_scaling(defense: str, *, d, m, B=1, sigma=1.0, sigma0=0.0, p=0.0, C=None, grad_norm=None) -> Scaling:
    """Table 1 of Liu et al. for f(x) = Σ_j a_j σ(w_jᵀx), up to constants and log factors.

    ``d``: input dimension, ``m``: width, ``B``: batch size (all may be numpy arrays);
    ``sigma``: the observation noise of the lower bound; ``sigma0``: the defense's noise
    (``noise``, ``dpsgd``); ``C`` and ``grad_norm`` ‖G‖ for ``clip``/``dpsgd``; ``p`` the
    drop probability (``dropout``, ``graddrop``) or p̂ of Prop. 3.4 for ``prune``.
    ``local`` and ``secagg`` leave both bounds unchanged (Sec. 3.1, 3.3; B is then the
    aggregated batch).
    """
    if defense not in TABLE1_DEFENSES:
        raise ConfigError(f"expected defense in {TABLE1_DEFENSES}, got {defense!r} (field defense)")
    d, m, B = np.asarray(d, dtype=float), np.asarray(m, dtype=float), np.asarray(B, dtype=float)
    base = np.sqrt(d / m)
    scale = 1.0
    if defense in ("clip", "dpsgd"):
        if C is None or grad_norm is None:
            raise ConfigError(f"defense {defense!r} needs C and grad_norm (‖G‖) for max(1, ‖G‖/C)")
        scale = np.maximum(1.0, np.asarray(grad_norm, dtype=float) / float(C))
    if defense in ("dropout", "graddrop", "prune"):
        if not 0 <= float(np.max(p)) < 1:
            raise ConfigError(f"expected p in [0, 1) for defense {defense!r}, got {p!r} (field p)")
        base = np.sqrt(d / ((1.0 - np.asarray(p, dtype=float)) * m))
    upper = {
        "none": B * base, "local": B * base, "secagg": B * base, "clip": B * base,
        "noise": (B + sigma0) * base, "dpsgd": (B + sigma0 * scale) * base,
        "dropout": B * base, "graddrop": B * base, "prune": None,
    }[defense]
    lower = sigma * scale * base
    as_float = lambda v: float(v) if isinstance(v, np.ndarray) and v.ndim == 0 else v  # noqa: E731
    return Scaling(defense=defense, upper=None if upper is None else as_float(upper), lower=as_float(lower))


__all__ = ["BoundResult", "cramer_rao", "Scaling", "two_layer_scaling", "TABLE1_DEFENSES"]
