"""Univariate reconstruction from a two-layer ReLU network at a KKT point (provable-attacks paper, Sec. 3).

Smorodinsky, Vardi & Safran, "Provable privacy attacks on trained shallow neural
networks": for N(x) = Σ_j v_j ReLU(w_j x + b_j) (eq. (6)) at a KKT point of the
max-margin problem (Assumption 2.1) with margin γ known (w.l.o.g. 1 in the paper),
N is piecewise linear with breakpoints −b_j / w_j, and

- Thm. 3.2: if two adjacent linear pieces [p_{k−1}, p_k], [p_k, p_{k+1}] are both *not*
  constant on the margin, a training point lies in [p_{k−1}, p_{k+1}] on the margin,
  and at most 4 points of that interval are on the margin (≤ 2 crossings per piece);
- Thm. 3.3: if N is constant on the margin on [p_{k−1}, p_k] and [p_{k+1}, p_{k+2}] but
  not in between, then p_k or p_{k+1} is a training point;
- Thm. 3.4 / Algorithm 1: sweeping the pieces left to right and adding the ≤ 4 margin
  points of each Thm. 3.2 pair (then skipping both pieces) or the 2 plateau ends of
  each Thm. 3.3 pattern gives a finite set of which at least a quarter are training
  points.

The algorithm's text is not in our copy of the paper; this module rebuilds it from the
theorem statements and the proof of Thm. 3.4 (each step adds ≤ 4 points, ≥ 1 of them a
training point).  Weights are only approximately at a KKT point after finite training,
so "on the margin" means | |N(x)| − γ | ≤ ``tol``·γ: on each piece the candidate is the
point nearest the margin (the exact crossing when there is one; the vertex where the
network touches the margin from below otherwise), and a piece is a plateau when both of
its ends are within that band.  With ``tol = 0`` this is the exact construction.

Requires a ``weights`` observation of a network with one input, one hidden ReLU layer
and one output without bias (:class:`~leakbench.models.TwoLayer` or ``mlp:M``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...threat import Observation
from ..base import Attack, Reconstruction, register

__all__ = ["Univariate", "UnivariateOptions", "piecewise_linear", "candidate_set"]


@dataclass
class UnivariateOptions:
    """``margin``: γ (None → the one the observation grants); ``tol``: relative band around the margin."""

    margin: float | None = None
    tol: float = 1e-3
    dedupe: float = 1e-9


def _layers(model: nn.Module) -> tuple[nn.Linear, nn.Module, nn.Linear] | None:
    mods = [m for m in model.modules() if not list(m.children())]
    mods = [m for m in mods if not isinstance(m, (nn.Flatten, nn.Identity))]
    if len(mods) != 3 or not isinstance(mods[0], nn.Linear) or not isinstance(mods[2], nn.Linear):
        return None
    if not isinstance(mods[1], nn.ReLU):
        return None
    return mods[0], mods[1], mods[2]


def piecewise_linear(w: torch.Tensor, b: torch.Tensor, v: torch.Tensor):
    """Breakpoints p (sorted, finite) and per-piece (slope, intercept) of N(x) = Σ v_j ReLU(w_j x + b_j).

    Piece k covers [p_{k−1}, p_k] with p_{−1} = −∞ and p_m = +∞ (m + 1 pieces).
    """
    w, b, v = (t.detach().to(torch.float64).reshape(-1) for t in (w, b, v))
    moving = w != 0
    points = torch.unique(-b[moving] / w[moving])  # sorted
    const = (v[~moving] * b[~moving].clamp_min(0)).sum()
    # probe each piece at an interior point to know which neurons are active there
    if points.numel():
        gaps = points.diff()
        span = float(points[-1] - points[0]) if points.numel() > 1 else 1.0
        span = span if span > 0 else 1.0
        mids = torch.cat([points[:1] - span, points[:-1] + gaps / 2, points[-1:] + span])
    else:
        mids = torch.zeros(1, dtype=torch.float64)
    active = ((w[None, moving] * mids[:, None] + b[None, moving]) > 0).to(torch.float64)  # (pieces, moving)
    slope = active @ (v[moving] * w[moving])
    intercept = active @ (v[moving] * b[moving]) + const
    return points, slope, intercept


def candidate_set(points: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor, margin: float, *,
                  tol: float = 1e-3, dedupe: float = 1e-9) -> tuple[torch.Tensor, dict]:
    """Algorithm 1 (Thm. 3.4) on a piecewise-linear function; returns candidates and which theorem added them."""
    m = points.numel()
    lo = torch.cat([points.new_tensor([-float("inf")]), points])
    hi = torch.cat([points, points.new_tensor([float("inf")])])
    band = tol * margin
    scale = float(points[-1] - points[0]) if m > 1 else 1.0
    scale = scale if scale > 0 else 1.0

    def value(k: int, x: float) -> float:
        return float(slope[k] * x + intercept[k])

    def near(val: float) -> bool:
        return abs(abs(val) - margin) <= band

    def plateau(k: int) -> bool:
        ends = [e for e in (float(lo[k]), float(hi[k])) if abs(e) != float("inf")]
        if not ends:
            return abs(float(slope[k])) * scale <= band and near(float(intercept[k]))
        if len(ends) == 1:  # unbounded piece: flat and on the margin
            return abs(float(slope[k])) * scale <= band and near(value(k, ends[0]))
        a, b = value(k, ends[0]), value(k, ends[1])
        return near(a) and near(b) and abs(a - b) <= 2 * band  # constant on one side of the margin

    def margin_points(k: int) -> list[float]:
        """Points of piece k nearest to ±γ when within the band (crossings, or touching vertices)."""
        out = []
        s, c = float(slope[k]), float(intercept[k])
        for target in (margin, -margin):
            if s == 0:
                continue
            x = (target - c) / s
            x = min(max(x, float(lo[k])), float(hi[k]))
            if abs(x) != float("inf") and near(value(k, x)):
                out.append(x)
        return out

    pieces = m + 1
    flat = [plateau(k) for k in range(pieces)]
    chosen: list[float] = []
    source: list[str] = []
    k = 0
    while k < pieces:
        if k + 1 < pieces and not flat[k] and not flat[k + 1]:  # Thm. 3.2
            pts = margin_points(k) + margin_points(k + 1)
            chosen += pts
            source += ["thm3.2"] * len(pts)
            k += 2
        elif flat[k] and k + 2 < pieces and not flat[k + 1] and flat[k + 2]:  # Thm. 3.3
            chosen += [float(lo[k + 1]), float(hi[k + 1])]
            source += ["thm3.3", "thm3.3"]
            k += 2
        else:
            k += 1
    order = sorted(range(len(chosen)), key=lambda i: chosen[i])
    keep_x: list[float] = []
    keep_s: list[str] = []
    for i in order:
        if keep_x and abs(chosen[i] - keep_x[-1]) <= dedupe * max(1.0, abs(chosen[i])):
            continue
        keep_x.append(chosen[i])
        keep_s.append(source[i])
    info = {"breakpoints": points, "plateaus": sum(flat), "pieces": pieces, "source": keep_s}
    return torch.tensor(keep_x, dtype=torch.float64), info


@register
class Univariate(Attack):
    """Univariate candidate set of a 1-D two-layer ReLU net at a KKT point (provable attacks, Thm. 3.2–3.4)."""

    name = "univariate"
    tags = ("weights",)
    Options = UnivariateOptions
    presets = {"default": {}}

    def validate(self) -> None:
        from ...errors import expect

        expect(self.options.tol >= 0, f"expected tol ≥ 0, got {self.options.tol!r} (option tol)")
        expect(self.options.margin is None or self.options.margin > 0,
               f"expected a positive margin, got {self.options.margin!r} (option margin)")

    def requirements(self, obs: Observation) -> list[str]:
        reasons = []
        if obs.kind != "weights":
            reasons.append(f"univariate reads trained weights; got a {obs.kind!r} observation "
                           "(use leakbench.threat.observe_weights)")
        if tuple(obs.input_shape) != (1,):
            reasons.append(f"univariate needs one input feature, got input shape {tuple(obs.input_shape)}")
        layers = _layers(obs.model)
        if layers is None:
            reasons.append("univariate needs a two-layer ReLU network (Linear → ReLU → Linear), e.g. twolayer:M")
        else:
            first, _, second = layers
            if second.weight.shape[0] != 1 or second.bias is not None:
                reasons.append("univariate needs one output and no output bias (a homogeneous network, eq. (6))")
        if self.options.margin is None and "margin" not in obs.extras:
            reasons.append("univariate assumes the margin is known: pass margin=… or observe_weights(..., margin=γ)")
        return reasons

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        first, _, second = _layers(obs.model)
        b = first.bias if first.bias is not None else torch.zeros_like(first.weight[:, 0])
        points, slope, intercept = piecewise_linear(first.weight[:, 0], b, second.weight[0])
        margin = float(self.options.margin if self.options.margin is not None else obs.extras["margin"])
        cand, info = candidate_set(points, slope, intercept, margin, tol=self.options.tol, dedupe=self.options.dedupe)
        dtype = first.weight.dtype
        return Reconstruction(images=cand.reshape(-1, 1).to(dtype), trace={**info, "margin": margin})
