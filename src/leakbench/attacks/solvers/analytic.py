"""Shared algebra of the analytic attacks (Chen & Campbell 2022, "Understanding training-data leakage
from gradients in neural networks for image classification", Sec. 3; Aono et al. 2017).

* :func:`act_derivative` — σ'(z) written through the activation's output h = σ(z) (eq. 3);
* :func:`act_inverse` — z = σ⁻¹(h) (eq. 2);
* :func:`output_layer` — the input h and the loss gradient δ of the output (logit) layer of one
  sample: with a bias gradient δ = ∇b, h = ∇W[k]/∇b[k] (eq. 4); without, ∇W = s·u vᵀ, h = t·v,
  δ = s·u/t with t the root of t·∂ℓ/∂z(t·Wv + b) = s·u (eq. 5 at the output);
* :func:`observed_output_layer` — :func:`output_layer` on the observation's top block;
* :func:`linear_input` — a fully connected layer's input from its weight gradient and δ (Lemma 3.1);
* :func:`analytic_reasons`, :func:`chain_or_reason` — the requirements every analytic attack shares.

Used by ``fc-inversion``, ``rgap``, ``hybrid`` and ``exclusivity``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ConfigError, UnsupportedThreatModel
from ...losses import get_loss
from ...models.matrices import Chain, layer_chain
from ...threat import Observation

__all__ = ["OutputSolve", "output_layer", "observed_output_layer", "linear_input", "act_derivative", "act_inverse",
           "analytic_reasons", "chain_or_reason"]


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
    from scipy.optimize import minimize_scalar  # lazy: `import leakbench` skips scipy
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


def observed_output_layer(obs: Observation, chain: Chain, grads, index, labels: torch.Tensor) -> OutputSolve:
    """:func:`output_layer` on the top block of ``chain`` with the observation's gradients (float64)."""
    from ..observed import layer_gradients

    top = chain.blocks[-1]
    gw, gb = layer_gradients(obs, top.layer, grads, index)
    weight = top.layer.weight.detach().double()
    bias = top.layer.bias.detach().double() if top.layer.bias is not None else None
    return output_layer(weight, bias, gw, gb, labels[:1], obs.loss)


def linear_input(grad_w: torch.Tensor, delta: torch.Tensor, name: str) -> torch.Tensor:
    """A linear layer's input x = ∇W[k]/δ[k] at the largest |δ[k]| (Lemma 3.1, eqs. 4–5)."""
    k = int(delta.abs().argmax())
    if float(delta[k]) == 0.0:
        raise UnsupportedThreatModel(f"the upstream gradient of {name!r} vanishes; its input is not determined by "
                                     "the gradient")
    return grad_w[k] / delta[k]


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
