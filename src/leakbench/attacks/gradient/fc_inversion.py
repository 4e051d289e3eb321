"""Closed-form inversion of fully connected layers (Aono et al. 2017; Chen & Campbell 2022, Lemma 3.1).

For a linear layer z = W x + b and one sample, the gradient constraint (eq. 1b) is
∇W = δ xᵀ with δ = ∂L/∂z, and ∇b = δ.  Hence (Lemma 3.1):

* with a bias, eq. (4): x = ∇W[k, :] / ∇b[k] for any k with ∇b[k] ≠ 0 (we take the
  largest |∇b[k]| for stability);
* without a bias, eq. (5): x = ∇W[k, :] / δ[k] with δ obtained by back-propagation
  (eq. 3): δ = σ'(z) ⊙ W_nextᵀ δ_next from the layers above, themselves inverted
  first.  At the output layer δ = ∂ℓ/∂z(logits) depends on the unknown input
  itself: with ∇W = s·u vᵀ (rank one) the input is t·v and δ = s·u / t, and the
  scalar t solves ∂ℓ/∂z(t W v + b) = s·u / t (a one-dimensional search, any loss).

For a batch of B samples ∇W[k]/∇b[k] = Σ_m δ_{m,k} x_m / Σ_m δ_{m,k}: an affine
combination of the batch, not a sample.

An update after several local SGD steps (FedAvg) keeps eq. 4 exact at batch 1: the first layer's
input never changes, so ΔW = −η Σ_t δ_t xᵀ and Δb = −η Σ_t δ_t, and ΔW[k]/Δb[k] = x whatever the
steps, minibatches or epochs (the bias path only: eq. 5 needs δ of one step).  ``fc-inversion`` then returns the B
combinations of the B largest |∇b[k]| and says so in ``trace["recovered"]``.

The helpers (:func:`output_layer`, :func:`act_derivative`, :func:`act_inverse`,
:func:`param_index`) are shared with R-GAP, the hybrid attack and exclusivity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.optimize import minimize_scalar
from torch import nn

from ...errors import ConfigError, UnsupportedThreatModel
from ...losses import get_loss
from ...models.matrices import Chain, layer_chain
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..labels import recover_labels

__all__ = ["FCInversion", "FCOptions", "output_layer", "act_derivative", "act_inverse", "param_index",
           "analytic_reasons", "layer_gradients"]


# --------------------------------------------------------------------------- shared helpers


def param_index(obs: Observation) -> dict[int, int]:
    """id(parameter of ``obs.model``) → its index in ``obs.shared``."""
    position = {n: i for i, n in enumerate(obs.param_names)}
    return {id(p): position[n] for n, p in obs.model.named_parameters() if n in position}


def layer_gradients(obs: Observation, layer: nn.Module, grads: list[torch.Tensor], index: dict[int, int],
                    dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shared gradient of ``layer``'s weight and bias (None without bias) in ``dtype``."""
    if id(layer.weight) not in index:
        raise UnsupportedThreatModel(f"the weight of {layer} is not among the shared gradients")
    gw = grads[index[id(layer.weight)]].to(dtype)
    gb = None
    if layer.bias is not None and id(layer.bias) in index:
        gb = grads[index[id(layer.bias)]].to(dtype)
    return gw, gb


def act_derivative(act: str, h: torch.Tensor, slope: float = 0.0) -> torch.Tensor:
    """σ'(z) written through the activation's output h = σ(z) (eq. 3)."""
    if act == "tanh":
        return 1 - h * h
    if act == "sigmoid":
        return h * (1 - h)
    if act == "relu":
        return (h > 0).to(h.dtype)
    if act == "leaky-relu":
        return torch.where(h >= 0, torch.ones_like(h), torch.full_like(h, slope))
    return torch.ones_like(h)


def act_inverse(act: str, h: torch.Tensor, slope: float = 0.0, clip: float = 1e-4) -> torch.Tensor:
    """z = σ⁻¹(h) (eq. 2); tanh/sigmoid outputs are clipped ``clip`` inside their range first.

    ReLU is invertible only where h > 0 (there z = h); callers drop the other rows.
    """
    if act == "tanh":
        return torch.atanh(h.clamp(-1 + clip, 1 - clip))
    if act == "sigmoid":
        return torch.logit(h.clamp(clip, 1 - clip))
    if act == "leaky-relu":
        return torch.where(h >= 0, h, h / slope)
    return h


@dataclass
class OutputSolve:
    """The input of the output layer, the loss gradient δ at its output, and how they were found."""

    inputs: torch.Tensor
    delta: torch.Tensor
    method: str
    residual: float


def output_layer(weight: torch.Tensor, bias: torch.Tensor | None, grad_w: torch.Tensor,
                 grad_b: torch.Tensor | None, label: torch.Tensor, loss: str) -> OutputSolve:
    """Invert the output (logit) layer of one sample: its input h and δ = ∂ℓ/∂z (float64).

    With a bias gradient: δ = ∇b, h = ∇W[k]/∇b[k] (eq. 4).  Without: ∇W = s·u vᵀ,
    h = t·v, δ = s·u/t with t the root of t·∂ℓ/∂z(t·Wv + b) = s·u, found by a log-spaced
    scan of both signs and a bounded refinement (scipy).
    """
    if grad_b is not None and float(grad_b.abs().max()) > 0:
        k = int(grad_b.abs().argmax())
        return OutputSolve(grad_w[k] / grad_b[k], grad_b.clone(), "bias (eq. 4)", 0.0)
    u_, s_, vh = torch.linalg.svd(grad_w, full_matrices=False)
    s, u, v = s_[0], u_[:, 0], vh[0]
    if float(s) == 0.0:
        raise UnsupportedThreatModel("the output layer's weight gradient is zero; nothing to invert")
    loss_fn = get_loss(loss)
    wv = weight @ v
    b = bias if bias is not None else torch.zeros_like(wv)
    target = label.reshape(1)

    def per_logit(z: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda q: loss_fn(q.unsqueeze(0), target))(z)

    batched = torch.func.vmap(per_logit)

    def residual(ts: torch.Tensor) -> torch.Tensor:
        g = batched(ts[:, None] * wv[None] + b[None])
        return (ts[:, None] * g - s * u[None]).norm(dim=1)

    mags = torch.logspace(-8, 8, 1601, dtype=grad_w.dtype, device=grad_w.device)
    grid = torch.cat([-mags.flip(0), mags])
    values = residual(grid)
    best = int(values.argmin())
    lo_i, hi_i = max(best - 1, 0), min(best + 1, grid.numel() - 1)
    lo, hi = float(grid[lo_i]), float(grid[hi_i])
    if lo < 0 < hi:  # never cross zero (t = 0 is no solution)
        lo, hi = (lo, float(grid[best])) if grid[best] < 0 else (float(grid[best]), hi)
    scalar = lambda t: float(residual(torch.tensor([t], dtype=grad_w.dtype, device=grad_w.device))[0])  # noqa: E731
    refined = minimize_scalar(scalar, bounds=(min(lo, hi), max(lo, hi)), method="bounded",
                              options={"xatol": 1e-14 * max(abs(lo), abs(hi))})
    t = float(refined.x) if refined.fun <= float(values[best]) else float(grid[best])
    return OutputSolve(t * v, s * u / t, "scalar solve (eq. 5 at the output)", scalar(t) / float(s))


def analytic_reasons(obs: Observation, *, attack: str, batch_one: bool = True,
                     several_steps: bool = False) -> list[str]:
    """Requirements shared by the analytic attacks (gradient of one step — or of several with
    ``several_steps`` —, loss, batch size)."""
    reasons = []
    if obs.kind == "weights":
        reasons.append(f"{attack} needs a shared gradient, not trained weights")
    elif obs.kind == "update" and obs.local_steps != 1 and not several_steps:
        reasons.append(f"{attack} needs the gradient of one step; got an update after {obs.local_steps} local steps")
    if obs.train_mode and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in obs.model.modules()):
        reasons.append(f"{attack} cannot invert batch normalisation in training mode")
    if batch_one and obs.batch_size != 1:
        reasons.append(f"{attack} inverts one sample (Chen & Campbell, Sec. 3 assume batch 1); got batch "
                       f"{obs.batch_size}")
    return reasons


def chain_or_reason(obs: Observation) -> tuple[Chain | None, str | None]:
    try:
        return layer_chain(obs.model, obs.input_shape), None
    except (UnsupportedThreatModel, ConfigError) as err:
        return None, str(err)


# --------------------------------------------------------------------------- the attack


@dataclass
class FCOptions:
    """Options of ``fc-inversion``."""

    #: how to read x from ∇W = ∇b xᵀ (batch 1, with bias): the row of the largest |∇b[k]|
    #: ("largest", eq. 4) or the least-squares fit over every row ("all").
    rows: str = "largest"

    def check(self) -> None:
        if self.rows not in ("largest", "all"):
            raise ConfigError(f"expected rows in ('largest', 'all'), got {self.rows!r} (option rows)")


@register
class FCInversion(Attack):
    """Closed-form input of the first fully connected layer from its gradients (Lemma 3.1)."""

    name = "fc-inversion"
    Options = FCOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        reasons = analytic_reasons(obs, attack=self.name, batch_one=False, several_steps=True)
        chain, why = chain_or_reason(obs)
        if chain is None:
            return reasons + [why]
        first = chain.blocks[0]
        if first.kind != "linear":
            reasons.append("fc-inversion rebuilds the input of a first fully connected layer; this model starts "
                           f"with {type(first.layer).__name__} {first.name!r} (use rgap for conv nets)")
            return reasons
        index = param_index(obs)
        if id(first.layer.weight) not in index:
            reasons.append(f"the weight gradient of {first.name!r} is not shared")
        has_bias = first.layer.bias is not None and id(first.layer.bias) in index
        if not has_bias and obs.kind == "update" and obs.local_steps != 1:
            reasons.append(f"without a bias in the first layer fc-inversion needs the gradient of one step; got an "
                           f"update after {obs.local_steps} local steps")
        if not has_bias:
            if obs.batch_size != 1:
                reasons.append("without a bias in the first layer fc-inversion needs batch 1 (eq. 5)")
            if any(b.kind != "linear" for b in chain.blocks):
                reasons.append("without a bias in the first layer every layer must be fully connected (eq. 5)")
            if chain.blocks[-1].act != "identity":
                reasons.append("the last layer must output the logits (no activation after it)")
        return reasons

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        chain = layer_chain(obs.model, obs.input_shape)
        index = param_index(obs)
        grads = obs.gradients
        first = chain.blocks[0]
        gw, gb = layer_gradients(obs, first.layer, grads, index)
        B = obs.batch_size
        if gb is not None:
            order = gb.abs().argsort(descending=True)
            if B == 1 and self.options.rows == "all":
                x = (gb @ gw / gb.dot(gb))[None]  # least squares of ∇W ≈ ∇b xᵀ over every row
                picked = order[:1]
            else:
                picked = order[:B]
                x = gw[picked] / gb[picked, None]
            method = "bias (eq. 4)"
            labels = recover_labels(obs, seed=seed) if B == 1 or obs.labels is not None else None
        else:
            labels = recover_labels(obs, seed=seed)
            x, method = self._no_bias(obs, chain, grads, index, labels)[None], "upstream gradient (eq. 5)"
            picked = None
        images = x.to(obs.dtype).reshape(x.shape[0], *obs.input_shape)
        recovered = ("the batch-1 input, exact" if B == 1 else
                     f"{B} affine combinations Σ_m w_m x_m (Σ_m w_m = 1) of the batch's inputs, one per "
                     "neuron with the largest |∇b|; not individual samples")
        trace = {"method": method, "recovered": recovered, "exact": B == 1,
                 "neurons": None if picked is None else picked.tolist()}
        confidence = torch.ones(images.shape[0]) if B == 1 else torch.zeros(images.shape[0])
        return Reconstruction(images=images, labels=labels, confidence=confidence, trace=trace)

    @staticmethod
    def _no_bias(obs: Observation, chain: Chain, grads, index, labels) -> torch.Tensor:
        """Eq. (5): invert the layers from the output down, δ by back-propagation (eq. 3)."""
        blocks = chain.blocks
        top = blocks[-1]
        gw, gb = layer_gradients(obs, top.layer, grads, index)
        weight = top.layer.weight.detach().double()
        bias = top.layer.bias.detach().double() if top.layer.bias is not None else None
        solved = output_layer(weight, bias, gw, gb, labels[:1], obs.loss)
        h, delta = solved.inputs, solved.delta
        for i in range(len(blocks) - 2, -1, -1):
            block, above = blocks[i], blocks[i + 1]
            gw_i, gb_i = layer_gradients(obs, block.layer, grads, index)
            upstream = above.layer.weight.detach().double().T @ delta
            delta = gb_i if gb_i is not None else act_derivative(block.act, h, block.slope) * upstream
            k = int(delta.abs().argmax())
            if float(delta[k]) == 0.0:
                raise UnsupportedThreatModel(f"the upstream gradient of layer {block.name!r} vanishes; "
                                             "its input cannot be read from the gradient")
            h = gw_i[k] / delta[k]
        return h
