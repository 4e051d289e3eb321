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

started from Z̄_c = ∇W[c]/∇b[c] (the bias trick per label: a Δ-weighted mean of the batch's features in which
label c's images weigh most).  The scale s absorbs a uniform factor on the gradient (a clipped gradient, a sum
instead of a mean); it is 1 for the plain gradient and for a one-step update divided by −η, and s = 1 is tried
first: with s fitted at every step the iteration has spurious fixed points on a trained, confident network
(measured on a ConvNet trained 2 epochs: residual 0.06 with s free, 5·10⁻⁸ with s = 1).  The system is
determined when Δ̄ has rank G: for cross-entropy the rows of Δ sum to zero, so this needs fewer distinct labels
than classes (G < K).  The answer is accepted only when it converged and the recovered Z̄ reproduces ∇W and ∇b to
``tolerance`` (relative); otherwise the reason says what breaks the model here, from what the observation itself
shows: images that share a label but get different predictions (a trained network; the mean-per-label model
is then not exact, whatever the defense), a defense named in the observation, several local steps, or a fixed
point that did not converge.

One feature per image instead (B·r unknowns in the r ≤ B dimensional row space of ∇W, K·r + K equations,
Levenberg–Marquardt from four seeded starts around the label means) was tried where labels are shared and
refused, on convnet-16 trained 2 epochs on digits 0–999 (held-out accuracy 0.84), B = 8 held-out batches:
mixed labels, residual 7·10⁻⁵ but the Jacobian's σ_min/σ_max 10⁻¹⁷; one label × 8, residual 2·10⁻⁷ but the
starts disagreed (up to the order within the label).  Confidently classified images have Δ rows near zero
(p ≥ 0.96 on 6 of 8), so their features barely enter the gradient: not identifiable in float32, and not
built.

Used by the gradient-matching engine's ``features`` option (:mod:`.gradient_matching`), which adds
a feature-matching term per label: a batch's gradient pins each image less as B grows, while these
features pin each label's images.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import UnsupportedThreatModel
from ...losses import get_loss
from ...threat import Observation
from ..labels import last_linear
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


def _start(gw: torch.Tensor, gb: torch.Tensor, distinct: torch.Tensor) -> torch.Tensor:
    """Z̄ to start from: row c of ∇W over ∇b_c for each label c — a Δ-weighted mean of the batch's features in
    which the images of label c weigh most (Δ_ic = p_ic − 1 for them, p_ic for the others; Aono et al.'s
    bias trick, exact at B = 1); zeros (logits = b) where ∇b_c vanishes."""
    rows, scale = gw[distinct], gb[distinct]
    usable = (scale != 0)[:, None]
    z = torch.where(usable, rows / torch.where(scale != 0, scale, torch.ones_like(scale))[:, None],
                    torch.zeros_like(rows))
    return torch.where(torch.isfinite(z), z, torch.zeros_like(z))


def _why_not(obs: Observation, z: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, target: torch.Tensor,
             count: int, steps: int, change: float) -> str:
    """What breaks the one-mean-per-label model here, from what the observation itself says."""
    causes = []
    if steps and change >= 1e-10:
        causes.append(f"the fixed point did not converge in {steps} iterations (last relative change {change:.2g})")
    if count < target.numel():
        seen = "" if z is None else (f" (here it gives its recovered means up to "
                                     f"{float(torch.softmax(z @ weight.T + bias, dim=-1).max()):.2f} of the softmax)")
        causes.append(f"{target.numel() - count} image(s) share a label with another, and one mean feature per label is "
                      "exact only when such images get the same prediction; a trained network predicts them "
                      f"differently{seen}, so their gradient rows differ within the label")
    if obs.defense not in ("none", ""):
        causes.append(f"the defense {obs.defense!r} altered the gradient")
    if obs.kind == "update" and obs.local_steps != 1:
        causes.append(f"an update of {obs.local_steps} local steps mixes several gradients")
    if not causes:
        causes.append("the labels are distinct and the observation one undefended step, so the solve itself is "
                      "ill-conditioned here")
    return "; ".join(causes)


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

    def solve(free: bool):
        """The fixed point from the bias-trick start, with s fitted each step (``free``) or held at 1."""
        z = _start(gw, gb, distinct)
        scale, steps, change = 1.0, 0, float("inf")
        while steps < iterations:
            steps += 1
            d = delta(z)
            sums = d.sum(0)
            scale = float(sums @ gb / (sums @ sums).clamp_min(1e-300)) if free else 1.0
            try:
                new = lstsq(scale * d.T, gw)
            except torch.linalg.LinAlgError:
                new = torch.full_like(z, float("nan"))
            if not (torch.isfinite(new).all() and math.isfinite(scale)):
                return None, scale, steps, change, math.inf
            change = float((new - z).norm() / new.norm().clamp_min(1e-300))
            z = new
            if change < 1e-10:
                break
        d = delta(z)
        residual = max(float((scale * d.T @ z - gw).norm() / gw.norm()),
                       float((scale * d.sum(0) - gb).norm() / gb.norm()))
        return z, scale, steps, change, residual

    # an undefended gradient (or one step's update, already divided by −η) has s = 1 exactly; a free s admits
    # spurious fixed points on a confident network (measured: residual 0.06 with s free, 5e-8 with s = 1 on a
    # briefly trained ConvNet), so s = 1 is tried first and the fitted s only where that fails
    z, scale, steps, change, residual = solve(free=False)
    if not residual <= tolerance:
        trial = solve(free=True)
        if trial[0] is not None and (z is None or trial[4] < residual):
            z, scale, steps, change, residual = trial
    if z is None:
        return LastLayerInputs(None, reason="the fixed point diverged: " + _why_not(
            obs, None, weight, bias, target, count, steps, change), iterations=steps, layer=name)
    d = delta(z)
    if torch.linalg.matrix_rank(d).item() < count:
        return LastLayerInputs(None, reason="the loss gradient at the logits is rank deficient: the features are not "
                                     "determined", layer=name)
    found = LastLayerInputs(None, residual=residual, iterations=steps, scale=scale, layer=name)
    if not (residual <= tolerance and torch.isfinite(z).all()):
        found.reason = (f"the recovered features reproduce the output layer's gradient only to {residual:.2g} "
                        f"(tolerance {tolerance:g}): " + _why_not(obs, z, weight, bias, target, count, steps, change))
        return found
    found.features = z.to(device=obs.device, dtype=obs.dtype)
    found.groups = groups.to(obs.device)
    return found
