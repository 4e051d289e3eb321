"""R-GAP: recursive per-layer linear systems (Zhu & Blaschko, ICLR 2021), as framed by Chen & Campbell (2022).

From the output towards the input, for one sample (Chen & Campbell, Sec. 3):

1. output layer: its input h and δ = ∂ℓ/∂z from Lemma 3.1 (eq. 4 with a bias, eq. 5
   otherwise; :func:`~.fc_inversion.output_layer`);
2. at each layer below, the activation is inverted, z_i = σ⁻¹(h_i) (eq. 2; tanh and
   sigmoid clipped 1e-4 inside their range, leaky ReLU exactly, ReLU only where
   h_i > 0 — R-GAP drops the rows of inactive outputs), and the upstream gradient is
   back-propagated, δ_i = σ'(z_i) ⊙ W_{i+1}ᵀ δ_{i+1} (eq. 3; the shared bias
   gradient replaces it for a biased fully connected layer, where ∇b = δ);
3. a fully connected layer is inverted in closed form (Lemma 3.1); a convolution by
   least squares on the stacked weight and gradient constraints
   [W_circ; K(δ_i)] x_i = [z_i − b_i; vec(∇W_i)] (eqs. 6–8), the minimum-norm solution
   (eq. 8, LAPACK ``gelsd``/``gelsy`` on the CPU, an SVD pseudo-inverse elsewhere);
4. x_i is the output of the layer below; repeat down to the image.

R-GAP's "virtual constraints" are not used (Chen & Campbell, Sec. 2, found they add
little).  The per-layer rank of the system is recorded in ``trace["layers"]``:
rank < dim(x_i) (the security metric's rank deficiency) is where R-GAP must guess.
:func:`solve` takes an optional ``correct`` callback: the hybrid attack
(:mod:`.hybrid`) corrects each convolution's least-squares solution there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError, UnsupportedThreatModel
from ...models.matrices import Chain, ChainBlock, bias_vector, gradient_matrix, layer_chain, weight_matrix
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..labels import recover_labels
from .fc_inversion import (act_derivative, act_inverse, analytic_reasons, chain_or_reason, layer_gradients,
                           output_layer, param_index)

__all__ = ["RGAP", "RGAPOptions", "LayerSystem", "solve", "least_squares", "INVERTIBLE"]

#: activations R-GAP inverts (ReLU only on its active outputs).
INVERTIBLE = ("tanh", "sigmoid", "leaky-relu", "identity", "relu")
SOLVERS = ("auto", "gelsd", "gelsy", "pinv")


@dataclass
class RGAPOptions:
    """Options of ``rgap`` (and of the linear-system part of ``hybrid``)."""

    #: least-squares backend: ``gelsd`` (SVD, CPU), ``gelsy`` (pivoted QR, CPU, faster),
    #: ``pinv`` (SVD pseudo-inverse, any device); ``auto`` = gelsd on CPU, pinv elsewhere.
    #: gelsy's incremental rank estimate can miss on rank-deficient systems (measured: rank
    #: 450 for an SVD rank of 546, residual 0.3 instead of 1e-15, varying with the thread
    #: count), so it is never the default.
    solver: str = "auto"
    #: singular values below rcond·σ_max count as zero (numerical rank of eq. 7).
    rcond: float = 1e-10
    #: tanh / sigmoid outputs are clipped this far inside their range before inversion (eq. 2).
    clip: float = 1e-4

    def check(self) -> None:
        if self.solver not in SOLVERS:
            raise ConfigError(f"expected solver in {SOLVERS}, got {self.solver!r} (option solver)")
        if not 0 < self.rcond < 1:
            raise ConfigError(f"expected 0 < rcond < 1, got {self.rcond} (option rcond)")
        if not 0 <= self.clip < 0.5:
            raise ConfigError(f"expected 0 ≤ clip < 0.5, got {self.clip} (option clip)")


@dataclass
class LayerSystem:
    """The linear system of one convolution (eq. 7) and its least-squares solution."""

    block: int
    name: str
    matrix: torch.Tensor
    rhs: torch.Tensor
    solution: torch.Tensor
    rank: int
    unknowns: int


def least_squares(a: torch.Tensor, b: torch.Tensor, *, solver: str = "auto", rcond: float = 1e-10
                  ) -> tuple[torch.Tensor, int]:
    """Minimum-norm least-squares solution of a x ≈ b and the numerical rank of a."""
    if solver == "auto":
        solver = "gelsd" if a.device.type == "cpu" else "pinv"
    if solver in ("gelsd", "gelsy"):
        if a.device.type != "cpu":
            raise ConfigError(f"solver {solver!r} runs on the CPU only; use solver='pinv' on {a.device}")
        out = torch.linalg.lstsq(a, b[:, None], rcond=rcond, driver=solver)
        return out.solution[:, 0], int(out.rank)
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    keep = s > rcond * s[0]
    coef = (u[:, keep].T @ b) / s[keep]
    return vh[keep].T @ coef, int(keep.sum())


def _back(above: ChainBlock, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """W_{i+1}ᵀ δ_{i+1}: the gradient w.r.t. the input of block ``above`` (bias-free), shaped like h."""
    layer = above.layer
    w = layer.weight.detach().to(delta.dtype)
    if isinstance(layer, nn.Linear):
        return (w.T @ delta.reshape(-1)).reshape(h.shape)
    _, vjp = torch.func.vjp(lambda t: F.conv2d(t, w, None, layer.stride, layer.padding, layer.dilation),
                            h.reshape(1, *above.input_shape))
    (g,) = vjp(delta.reshape(1, *above.output_shape))
    return g.reshape(h.shape)


Corrector = Callable[[int, LayerSystem, torch.Tensor], torch.Tensor]


def rgap_reasons(obs: Observation, attack: str) -> tuple[list[str], Chain | None]:
    reasons = analytic_reasons(obs, attack=attack)
    chain, why = chain_or_reason(obs)
    if chain is None:
        return reasons + [why], None
    if chain.blocks[-1].kind != "linear" or chain.blocks[-1].act != "identity":
        reasons.append(f"{attack} needs a last fully connected layer that outputs the logits (no activation after it)")
    for b in chain.blocks[:-1]:
        if b.act not in INVERTIBLE:
            reasons.append(f"{attack} cannot invert activation {b.act!r} after {b.name!r}; supported: "
                           f"{', '.join(INVERTIBLE)}")
        if b.act == "leaky-relu" and b.slope == 0:
            reasons.append(f"leaky ReLU after {b.name!r} has slope 0 (not invertible)")
    index = param_index(obs)
    missing = [b.name for b in chain.blocks if id(b.layer.weight) not in index]
    if missing:
        reasons.append(f"the weight gradients of {', '.join(missing)} are not shared")
    return reasons, chain


def solve(obs: Observation, options: RGAPOptions, *, labels: torch.Tensor,
          correct: Corrector | None = None) -> tuple[torch.Tensor, dict]:
    """Run the recursion on ``obs`` (batch 1); returns the image (float64) and a trace.

    ``correct(block, system, x)`` may replace each convolution's least-squares
    solution ``x`` (the hybrid attack's gradient-matching correction).
    """
    chain = layer_chain(obs.model, obs.input_shape)
    index = param_index(obs)
    grads = obs.gradients
    blocks = chain.blocks
    top = blocks[-1]
    gw, gb = layer_gradients(obs, top.layer, grads, index)
    w_top = top.layer.weight.detach().double()
    b_top = top.layer.bias.detach().double() if top.layer.bias is not None else None
    out = output_layer(w_top, b_top, gw, gb, labels[:1], obs.loss)
    h, delta = out.inputs, out.delta
    layers = [{"block": top.name, "kind": "linear", "method": out.method, "residual": out.residual}]
    for i in range(len(blocks) - 2, -1, -1):
        start = time.perf_counter()
        block, above = blocks[i], blocks[i + 1]
        h = h.reshape(block.output_shape)
        upstream = _back(above, h, delta)
        gw_i, gb_i = layer_gradients(obs, block.layer, grads, index)
        if block.kind == "linear":
            delta = gb_i if gb_i is not None else act_derivative(block.act, h, block.slope) * upstream
            k = int(delta.abs().argmax())
            if float(delta[k]) == 0.0:
                raise UnsupportedThreatModel(f"the upstream gradient of {block.name!r} vanishes; "
                                             "its input is not determined by the gradient")
            h = gw_i[k] / delta[k]
            layers.append({"block": block.name, "kind": "linear", "method": "Lemma 3.1",
                           "seconds": time.perf_counter() - start})
            continue
        delta = act_derivative(block.act, h, block.slope) * upstream
        system = _conv_system(i, block, h, delta, gw_i, options)
        x = system.solution
        if correct is not None:
            x = correct(i, system, x)
        layers.append({"block": block.name, "kind": "conv", "rank": system.rank, "unknowns": system.unknowns,
                       "rank_deficiency": system.rank - system.unknowns, "rows": int(system.matrix.shape[0]),
                       "residual": float((system.matrix @ x - system.rhs).norm() / system.rhs.norm().clamp_min(1e-300)),
                       "seconds": time.perf_counter() - start})
        h = x
    return h.reshape(obs.input_shape), {"layers": layers[::-1]}


def _conv_system(position: int, block: ChainBlock, h: torch.Tensor, delta: torch.Tensor, grad_w: torch.Tensor,
                 options: RGAPOptions) -> LayerSystem:
    """Eq. (6)/(7) for one convolution and its minimum-norm least-squares solution (eq. 8)."""
    w_circ = weight_matrix(block.layer, block.input_shape, dtype=torch.float64)
    bias = bias_vector(block.layer, block.input_shape, dtype=torch.float64)
    flat = h.reshape(-1)
    z = act_inverse(block.act, flat, block.slope, options.clip)
    if block.act == "relu":  # only active outputs constrain the input
        rows = flat > 0
        w_circ, z, bias = w_circ[rows], z[rows], bias[rows]
    k = gradient_matrix(block.layer, block.input_shape, delta)
    a = torch.cat([w_circ, k])
    rhs = torch.cat([z - bias, grad_w.reshape(-1)])
    x, rank = least_squares(a, rhs, solver=options.solver, rcond=options.rcond)
    return LayerSystem(block=position, name=block.name, matrix=a, rhs=rhs, solution=x, rank=rank, unknowns=a.shape[1])


@register
class RGAP(Attack):
    """R-GAP: per-layer weight + gradient linear systems from the output to the input (batch 1)."""

    name = "rgap"
    Options = RGAPOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        return rgap_reasons(obs, self.name)[0]

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        labels = recover_labels(obs, seed=seed)
        x, trace = solve(obs, self.options, labels=labels)
        images = x.reshape(1, *obs.input_shape).to(obs.dtype)
        if callback is not None:
            callback(0, images)
        deficient = sum(layer.get("rank_deficiency", 0) for layer in trace["layers"])
        trace["exact"] = deficient == 0
        return Reconstruction(images=images, labels=labels, confidence=torch.tensor([float(deficient == 0)]),
                              trace=trace)
