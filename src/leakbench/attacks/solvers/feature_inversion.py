"""Images from the features of a known chain of layers: exact least squares where the rows determine the input.

A chain block computes h = act(W x + b) (:class:`~leakbench.models.matrices.ChainBlock`; W the dense matrix of a
Linear or Conv2d layer, :func:`~leakbench.models.matrices.weight_matrix`).  Going backwards from known features:

* an invertible activation (leaky ReLU, tanh, sigmoid, identity) gives W x = act⁻¹(h) − b on every row;
* a ReLU gives it on the rows where h > 0 only; the rows where h = 0 say W x + b ≤ 0 and are not used.

Per sample, x is the least-squares solution of those rows (an SVD, so the rank is read); it is the input exactly
when the rows have full column rank and the residual is at the features' precision (R-GAP's reasoning, Zhu &
Blaschko ICLR 2021, for a known output instead of a known gradient).  Where the rows are rank deficient, or a
layer's system is above the work bound, the rest of the way is an optimisation instead (Cocktail Party,
Kariyappa et al. ICML 2023, Sec. 4.3, and Liu et al. 2024 invert features so): Adam on
Σ_i ‖f(x_i) − ẑ_i‖² / ‖ẑ_i‖² inside the data box, from the least-squares solution when there is one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...models.matrices import Chain, bias_vector, weight_matrix
from .analytic import act_inverse

__all__ = ["FeatureInversion", "feature_bounds", "invert_features"]

#: at most this many multiply-adds for one sample's SVD (live rows × cols², about a second on 2 cores); above it the
#: layer is optimised instead.
WORK_BOUND = 5e9
#: at most this many entries in one layer's dense matrix (8 bytes each).
MATRIX_BOUND = 2 ** 24
#: a singular value below rcond·σ_max is zero (the rows do not determine that direction).
RCOND = 1e-10


@dataclass
class FeatureInversion:
    """Images (B × input shape), which are exact (full column rank on every layer and the features reproduced),
    the relative feature residual per sample, and per layer why the least squares was or was not used."""

    images: torch.Tensor
    exact: torch.Tensor
    residual: torch.Tensor
    layers: list[dict]


def feature_bounds(chain: Chain, upto: int, data_range: tuple[float, float]) -> tuple[float, float]:
    """The range the inputs of block ``upto`` can take for inputs in the data box: interval bounds through the
    blocks before it (affine layers with |W| on the radius; every supported activation is monotone)."""
    lo, hi = data_range
    ref = chain.blocks[0].layer.weight
    shape = chain.blocks[0].input_shape
    low = torch.full((1, *shape), float(lo), dtype=torch.float64, device=ref.device)
    high = torch.full((1, *shape), float(hi), dtype=torch.float64, device=ref.device)
    for block in chain.blocks[:upto]:
        layer = block.layer
        w = layer.weight.detach().double()
        b = None if layer.bias is None else layer.bias.detach().double()
        low, high = low.reshape(1, *block.input_shape), high.reshape(1, *block.input_shape)
        centre, radius = (low + high) / 2, (high - low) / 2
        if isinstance(layer, nn.Conv2d):
            conv = dict(stride=layer.stride, padding=layer.padding, dilation=layer.dilation, groups=layer.groups)
            mid, spread = F.conv2d(centre, w, b, **conv), F.conv2d(radius, w.abs(), None, **conv)
        else:
            mid, spread = F.linear(centre, w, b), F.linear(radius, w.abs())
        low, high = mid - spread, mid + spread
        if block.act_module is not None:
            act = block.act_module.double()
            low, high = act(low), act(high)
    return float(low.min()), float(high.max())


def _solve(a: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The minimum-norm least-squares solution of a x = rhs and the numerical rank of a."""
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    rank = int((s > RCOND * s[0]).sum()) if s.numel() and float(s[0]) > 0 else 0
    x = vh[:rank].T @ ((u[:, :rank].T @ rhs) / s[:rank])
    return x, rank


def invert_features(chain: Chain, upto: int, features: torch.Tensor, data_range: tuple[float, float], *,
                    zero_tol: float = 1e-7, tol: float = 1e-6, steps: int = 500, lr: float = 0.05, seed: int = 0
                    ) -> FeatureInversion:
    """Images whose activations at the input of block ``upto`` are ``features`` (B × n), through blocks 0..upto−1."""
    blocks = chain.blocks[:upto]
    batch = features.shape[0]
    ref = blocks[0].layer.weight
    target = features.detach().to(ref.device, torch.float64).reshape(batch, -1)
    h = target
    exact = torch.ones(batch, dtype=torch.bool, device=h.device)
    layers: list[dict] = []
    for block in reversed(blocks):
        rows, cols = math.prod(block.output_shape), block.input_dim
        info = {"layer": block.name, "rows": rows, "cols": cols}
        layers.append(info)
        if block.act == "relu":
            live = h > zero_tol * h.abs().amax(1, keepdim=True).clamp_min(1e-300)
            pre = h
        else:
            live = torch.ones_like(h, dtype=torch.bool)
            pre = act_inverse(block.act, h, block.slope)
        used = int(live.sum(1).max())
        if rows * cols > MATRIX_BOUND or used * cols * cols > WORK_BOUND:
            info["solver"] = (f"optimised: its system ({used} live rows × {cols}, matrix {rows}×{cols}) is above the "
                              "least-squares bound")
            exact[:] = False
            break
        w = weight_matrix(block.layer, block.input_shape).to(h.device, torch.float64)
        b = bias_vector(block.layer, block.input_shape, dtype=torch.float64).to(h.device)
        solved, ranks = [], []
        for i in range(batch):  # one SVD per sample: each sample's live rows differ
            x_i, r_i = _solve(w[live[i]], (pre[i] - b)[live[i]])
            solved.append(x_i)
            ranks.append(r_i)
        ranks_t = torch.tensor(ranks, device=h.device)
        exact &= ranks_t == cols
        info.update({"solver": "least squares", "rank_min": int(ranks_t.min()), "full_rank": int((ranks_t == cols).sum())})
        h = torch.stack(solved)
    lo, hi = data_range
    start = h.reshape(batch, *chain.blocks[0].input_shape) if layers[-1]["solver"] == "least squares" else None
    prefix = nn.Sequential(*chain.modules[:chain.blocks[upto].start]).to(ref.device)
    images = _optimise(prefix, target, start, chain.blocks[0].input_shape, (lo, hi), exact, steps=steps, lr=lr,
                       seed=seed)
    with torch.no_grad():
        got = prefix.double()(images).reshape(batch, -1)
    residual = (got - target).norm(dim=1) / target.norm(dim=1).clamp_min(1e-300)
    exact &= residual <= tol
    return FeatureInversion(images, exact, residual, layers[::-1])


def _optimise(prefix: nn.Module, target: torch.Tensor, start: torch.Tensor | None, shape, box: tuple[float, float],
              done: torch.Tensor, *, steps: int, lr: float, seed: int) -> torch.Tensor:
    """The least-squares images clamped to the box where they are exact; Adam on the relative feature misfit (inside
    the box) for the others, from the least-squares solution or from the box centre plus seeded noise."""
    lo, hi = box
    batch = target.shape[0]
    if start is None:
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        start = (lo + hi) / 2 + 0.1 * (hi - lo) * torch.randn((batch, *shape), generator=gen, dtype=torch.float64)
        start = start.to(target.device)
    x = start.detach().clamp(lo, hi)
    todo = ~done
    if steps <= 0 or not bool(todo.any()):
        return x
    net = prefix.double()
    for p in net.parameters():
        p.requires_grad_(False)
    var = x[todo].clone().requires_grad_(True)
    goal, norm = target[todo], target[todo].norm(dim=1).clamp_min(1e-300)
    opt = torch.optim.Adam([var], lr=lr * (hi - lo))
    for _ in range(steps):
        opt.zero_grad()
        loss = (((net(var).reshape(var.shape[0], -1) - goal).norm(dim=1) / norm) ** 2).sum()
        loss.backward()
        opt.step()
        with torch.no_grad():
            var.clamp_(lo, hi)
    x = x.clone()
    x[todo] = var.detach()
    return x
