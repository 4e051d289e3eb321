"""The inputs of the output layer, recovered from its shared gradient when the labels are known.

For the last linear layer, logits ℓ = Z Wᵀ + b with Z (B×d) the features of the batch, the
gradient of the mean loss L is

    ∇W = Δᵀ Z,   ∇b = Δᵀ 1,   Δ = ∂L/∂ℓ (B×K),

(for B = 1 this gives x = ∇W[k]/∇b[k], the bias trick of Aono et al. 2017 that Geiping et al. 2020,
Sec. 3, state for any fully connected layer; :mod:`~leakbench.attacks.gradient.fc_inversion`).  For a
batch, Δ depends on Z itself through the logits, and ∇W[k]/∇b[k] is only an affine mix of the batch.
With the labels known, Δ(Z) is a function of Z alone; the batch solve below is leakbench's, not a
paper's.  Images of one label have Δ rows that differ only through their predictions — negligibly
at small logits (singular values 10⁻⁶ of the largest, measured on an untrained ConvNet) — so what the
gradient determines is one feature vector per label, the mean Z̄_c of that label's images.  With
Δ̄ (G×K) the summed rows of each of the G labels, evaluated at Z̄, Z̄ solves the fixed point

    Z̄ = (s Δ̄(Z̄)ᵀ)⁺ ∇W,   s = ⟨Δ̄(Z̄)ᵀ1, ∇b⟩ / ‖Δ̄(Z̄)ᵀ1‖²,

started from Z̄ = 0 (logits = b).  The scale s absorbs a uniform factor on the gradient (an update
−η∇ of one local step, a clipped gradient, a sum instead of a mean); it is 1 for the plain gradient.
The system is determined when Δ̄ has rank G: for cross-entropy the rows of Δ sum to zero, so this needs
fewer distinct labels than classes (G < K).  The fixed point contracts when the logits are small
(untrained or lightly trained networks); it is accepted only when it converged and the recovered Z̄
reproduces ∇W and ∇b to ``tolerance`` (relative): a noised, pruned or multi-step observation, or a
confident network whose predictions differ within a label, fails that check and nothing is returned.

Used by the gradient-matching engine's ``features`` option (:mod:`.gradient_matching`), which adds
a feature-matching term per label: a batch's gradient pins each image less as B grows, while these
features pin each label's images.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UnsupportedThreatModel
from ..losses import get_loss
from ..threat import Observation
from .labels import last_linear
from .linalg import lstsq

__all__ = ["LastLayerInputs", "last_layer_inputs"]


@dataclass
class LastLayerInputs:
    """The recovered per-label mean features (None when refused), with why not and how well they fit."""

    #: G×d, the mean input of the output layer over the images of each distinct label
    features: torch.Tensor | None
    #: (B,) the row of ``features`` each slot's label maps to
    groups: torch.Tensor | None = None
    reason: str = ""
    residual: float = float("nan")
    iterations: int = 0
    scale: float = float("nan")
    layer: str = ""


def _layer_name(obs: Observation, layer: torch.nn.Module) -> str:
    return next(n for n, m in obs.model.named_modules() if m is layer)


def last_layer_inputs(obs: Observation, labels: torch.Tensor | None, *, iterations: int = 200,
                      tolerance: float = 1e-3) -> LastLayerInputs:
    """Z̄ (G×d, the mean input row of the output layer per distinct label) from the shared gradient, or the
    reason it cannot be had."""
    if labels is None:
        return LastLayerInputs(None, reason="needs the labels (known or recovered)")
    if obs.kind == "update" and obs.local_steps != 1:
        return LastLayerInputs(None, reason=f"an update of {obs.local_steps} local steps mixes several gradients")
    try:
        layer, w_at, b_at = last_linear(obs)
    except UnsupportedThreatModel as err:
        return LastLayerInputs(None, reason=str(err))
    name = _layer_name(obs, layer)
    if b_at is None:
        return LastLayerInputs(None, reason="the output layer has no (shared) bias", layer=name)
    target = labels.detach().cpu().long().reshape(-1)
    if target.numel() != obs.batch_size:
        return LastLayerInputs(None, reason=f"expected {obs.batch_size} labels, got {target.numel()}", layer=name)
    classes = layer.out_features
    distinct, groups = torch.unique(target, return_inverse=True)
    count = len(distinct)
    if count >= classes:
        return LastLayerInputs(None, reason=f"{count} distinct labels are not determined by an output layer of "
                                     f"{classes} classes (needs fewer than {classes})", layer=name)
    # A K×G system: solved on the CPU in float64 (gelsd, which copes with a singular step, is CPU-only).
    grads = obs.gradients
    gw, gb = grads[w_at].detach().cpu().double(), grads[b_at].detach().cpu().double().reshape(-1)
    if not (torch.isfinite(gw).all() and torch.isfinite(gb).all()) or gb.norm() == 0:
        return LastLayerInputs(None, reason="the output layer's gradient is zero or not finite", layer=name)
    weight, bias = layer.weight.detach().cpu().double(), layer.bias.detach().cpu().double()
    loss_fn = get_loss(obs.loss)

    def delta(z: torch.Tensor) -> torch.Tensor:
        """Δ̄: ∂L/∂(logits of each label's mean feature), the rows of one label summed."""
        logits = (z @ weight.T + bias).requires_grad_(True)
        with torch.enable_grad():
            return torch.autograd.grad(loss_fn(logits[groups], target), logits)[0]

    z = torch.zeros(count, weight.shape[1], dtype=torch.float64)
    scale, steps = 1.0, 0
    while steps < iterations:
        steps += 1
        d = delta(z)
        sums = d.sum(0)
        scale = float(sums @ gb / (sums @ sums).clamp_min(1e-300))
        try:
            new = lstsq(scale * d.T, gw)
        except torch.linalg.LinAlgError:
            new = torch.full_like(z, float("nan"))
        if not (torch.isfinite(new).all() and math.isfinite(scale)):
            return LastLayerInputs(None, reason="the fixed point diverged: a defended, noised or confident network's "
                                                "observation", iterations=steps, layer=name)
        change = float((new - z).norm() / new.norm().clamp_min(1e-300))
        z = new
        if change < 1e-10:
            break
    d = delta(z)
    if torch.linalg.matrix_rank(d).item() < count:
        return LastLayerInputs(None, reason="the loss gradient at the logits is rank deficient: the features are not "
                                     "determined", layer=name)
    sums = d.sum(0)
    residual = max(float((scale * d.T @ z - gw).norm() / gw.norm()), float((scale * sums - gb).norm() / gb.norm()))
    found = LastLayerInputs(None, residual=residual, iterations=steps, scale=scale, layer=name)
    if not (residual <= tolerance and torch.isfinite(z).all()):
        found.reason = (f"the recovered features reproduce the output layer's gradient only to {residual:.2g} "
                        f"(tolerance {tolerance:g}): a defended, noised or multi-step observation")
        return found
    found.features = z.to(device=obs.device, dtype=obs.dtype)
    found.groups = groups.to(obs.device)
    return found
