"""Reconstructing training data from trained weights via the KKT conditions (Haim et al. 2022).

Haim, Vardi, Yehudai, Shamir & Irani, "Reconstructing training data from trained neural
networks" (NeurIPS 2022).  A homogeneous network trained to a tiny loss is near a KKT
point of the max-margin problem, so θ = Σ_i λ_i y_i ∇_θΦ(θ; x_i) with λ_i ≥ 0 (their
eq. (2); Thm. 3.1, after Lyu & Li 2020).  The attack optimises m candidates x̂_j with
labels ŷ_j (half −1, half +1) and multipliers λ_j to satisfy it:

    L = ‖θ − Σ_j λ_j ŷ_j ∇_θΦ(θ; x̂_j)‖²           (L_stationary)
      + Σ_j max{λ_min − λ_j, 0}                     (L_λ, appendix B.2)
      + Σ_j ‖(x̂_j − high)_+‖² + ‖(low − x̂_j)_+‖²   (box prior on the inputs)

- In the backward pass only, ReLU′(z) = 1[z > 0] becomes sigmoid(α z) (appendix B.2);
  the forward pass stays ReLU.
- The weighted sum Σ_j λ_j ŷ_j ∇_θΦ(x̂_j) is one vector–Jacobian product (∇_θ of
  Σ_j λ_j ŷ_j Φ(x̂_j)), taken with ``create_graph`` so L differentiates w.r.t. x̂ and λ:
  no per-candidate gradients are materialised.
- Float64 throughout (their code runs in double precision).
- Four hyperparameters, drawn per run from the appendix B.2 distributions when not
  given: lr log-uniform [1e-5, 1], σ_x (initial scale of x̂) log-uniform [1e-6, 1],
  α uniform [10, 500], λ_min log-uniform [1e-4, 1]; ``runs`` random-search runs are
  pooled (all candidates are returned; post-process with
  :func:`leakbench.metrics.voting.vote`, appendix B.3).
- Multiclass (Buzaglo et al. 2023, "Deconstructing data reconstruction"): the term of
  candidate j is λ_j (Φ_{ŷ_j}(x̂_j) − max_{k≠ŷ_j} Φ_k(x̂_j)), labels balanced over classes.

Where the public code differs from the paper we follow the paper: the code scales the
sum by 1/m (a rescaling of λ), squares the λ_min hinge and weights it by 5; here L_λ is
the paper's plain hinge.  The optimiser (SGD, momentum 0.9, x̂ ~ σ_x N(0, I),
λ ~ U(0, 1)) and the squared-hinge box prior, which the appendix does not specify, are
the public code's.  ``rescale`` (off by default, ours) multiplies the weights by one
constant so that ‖θ‖ = rescale before the attack: for a homogeneous network of degree L
the KKT direction is unchanged (Φ(cθ) = c^L Φ(θ), λ absorbs c^{2−L}), and it keeps the
paper's λ and learning-rate ranges meaningful for weights trained far out in norm
(e.g. with ``train_target(schedule="adaptive")``; for a non-homogeneous network it
changes the function).  The box is the observation's ``data_range`` (the network's
inputs: for mean-subtracted data, [0, 1] shifted by the mean); when the observation
grants the training mean, returned images are moved back to data space by adding it.

What the weights must carry — at least about n distinct first-layer neuron directions with different
activation patterns (neuron j gives w_j ∝ Σ_{i active} λ_i y_i (x_i, 1), one equation per direction) —
and the measurements behind it are in ``docs/trained.md`` ("Measured: what the weights must carry").
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ...errors import LeakbenchError, expect
from ...models.targets import scale_to_norm
from ...threat import Observation
from ..base import Attack, Reconstruction, register

__all__ = ["KKTReconstruction", "KKTOptions", "SoftBackwardReLU", "sample_hyperparameters", "PAPER_RANGES"]

#: a run whose candidates leave the data box by more than this many box widths has diverged.
EXPLODED = 100.0


def _tame(x: torch.Tensor, lo: float, hi: float) -> bool:
    """Finite candidates within :data:`EXPLODED` box widths of the data box [lo, hi]."""
    if not torch.isfinite(x).all():
        return False
    width = max(hi - lo, 1e-12)
    return bool(((x - hi).clamp_min(0) + (lo - x).clamp_min(0)).max() <= EXPLODED * width)


#: Haim et al. appendix B.2: the random-search distributions.
PAPER_RANGES = {"lr": (1e-5, 1.0), "init_scale": (1e-6, 1.0), "alpha": (10.0, 500.0), "lambda_min": (1e-4, 1.0)}


class _SoftBackward(torch.autograd.Function):
    """Forward ReLU (or leaky ReLU); backward with the derivative s + (1 − s)·sigmoid(α z) (twice differentiable)."""

    @staticmethod
    def forward(ctx, z, alpha, slope):
        ctx.save_for_backward(z)
        ctx.alpha, ctx.slope = alpha, slope
        return torch.where(z > 0, z, z * slope)

    @staticmethod
    def backward(ctx, grad_out):
        (z,) = ctx.saved_tensors
        gate = torch.sigmoid(ctx.alpha * z)
        return grad_out * (ctx.slope + (1 - ctx.slope) * gate), None, None


class SoftBackwardReLU(nn.Module):
    """ReLU whose backward uses sigmoid(α z) for the derivative (Haim et al. appendix B.2)."""

    def __init__(self, alpha: float, slope: float = 0.0) -> None:
        super().__init__()
        self.alpha, self.slope = float(alpha), float(slope)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return _SoftBackward.apply(z, self.alpha, self.slope)


def _soften(model: nn.Module, alpha: float) -> int:
    """Replace every ReLU / LeakyReLU module of ``model`` in place; returns how many were replaced."""
    count = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.ReLU):
                setattr(parent, name, SoftBackwardReLU(alpha))
                count += 1
            elif isinstance(child, nn.LeakyReLU):
                setattr(parent, name, SoftBackwardReLU(alpha, child.negative_slope))
                count += 1
    return count


def _set_alpha(model: nn.Module, alpha: float) -> None:
    for m in model.modules():
        if isinstance(m, SoftBackwardReLU):
            m.alpha = float(alpha)


@dataclass
class KKTOptions:
    """Options of the KKT reconstruction; ``None`` hyperparameters are drawn per run (appendix B.2)."""

    candidates: int = 100
    iterations: int = 10_000
    runs: int = 1
    lr: float | None = None
    init_scale: float | None = None
    alpha: float | None = None
    lambda_min: float | None = None
    lambda_lr: float | None = None
    momentum: float = 0.9
    box: bool = True
    rescale: float | None = None
    trace_every: int = 500


def sample_hyperparameters(rng: np.random.Generator, options: KKTOptions) -> dict[str, float]:
    """One draw of (lr, σ_x, α, λ_min): the given values, the others from the paper's distributions."""

    def log_uniform(lo: float, hi: float) -> float:
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    draw = {
        "lr": log_uniform(*PAPER_RANGES["lr"]),
        "init_scale": log_uniform(*PAPER_RANGES["init_scale"]),
        "alpha": float(rng.uniform(*PAPER_RANGES["alpha"])),
        "lambda_min": log_uniform(*PAPER_RANGES["lambda_min"]),
    }
    for key in draw:
        given = getattr(options, key)
        if given is not None:
            draw[key] = float(given)
    draw["lambda_lr"] = float(options.lambda_lr) if options.lambda_lr is not None else draw["lr"]
    return draw


def _candidate_labels(m: int, classes: int, device) -> torch.Tensor:
    if classes == 1:
        y = torch.ones(m, device=device)
        y[: m // 2] = -1
        return y
    return torch.arange(m, device=device) % classes


@register
class KKTReconstruction(Attack):
    """Haim et al. 2022: candidates and multipliers fitted to the KKT stationarity condition of the weights."""

    name = "kkt"
    tags = ("weights",)
    Options = KKTOptions
    presets = {
        "default": {},
        # Haim et al.: m = 2n candidates, 50 000–100 000 iterations per run, many random-search runs.
        "paper": {"iterations": 50_000, "runs": 20},
        "quick": {"candidates": 20, "iterations": 1500, "runs": 1, "lr": 0.01, "init_scale": 0.01, "alpha": 100.0,
                  "lambda_min": 0.01, "trace_every": 250},
    }

    def validate(self) -> None:
        o = self.options
        for name in ("candidates", "iterations", "runs", "trace_every"):
            value = getattr(o, name)
            expect(isinstance(value, int) and value >= 1, f"expected a positive int, got {value!r} (option {name})")
        expect(o.rescale is None or (isinstance(o.rescale, (int, float)) and o.rescale > 0),
               f"expected a positive norm or None (weights as given), got {o.rescale!r} (option rescale)")
        for name in ("lr", "init_scale", "alpha", "lambda_min", "lambda_lr"):
            value = getattr(o, name)
            expect(value is None or value > 0, f"expected a positive number or None (drawn), got {value!r} "
                   f"(option {name})")
        expect(0 <= o.momentum < 1, f"expected momentum in [0, 1), got {o.momentum!r} (option momentum)")

    def requirements(self, obs: Observation) -> list[str]:
        reasons = []
        if obs.kind != "weights":
            reasons.append(f"kkt reconstructs from trained weights; got a {obs.kind!r} observation "
                           "(use leakbench.threat.observe_weights on the trained network)")
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in obs.model.modules()):
            reasons.append("kkt needs a network without batch-norm (the KKT conditions are per sample)")
        if obs.num_classes < 1:
            reasons.append("kkt needs a network with at least one output")
        return reasons

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        o = self.options
        device = obs.device
        net = copy.deepcopy(obs.model).to(device=device, dtype=torch.float64).eval()
        _soften(net, 1.0)
        if o.rescale is not None:  # θ ← cθ: same KKT direction for a homogeneous net (λ absorbs c^{2−L})
            scale_to_norm(net, o.rescale)
        params = [p for p in net.parameters() if p.requires_grad]
        theta = [p.detach().clone() for p in params]
        theta_sq = float(sum(t.pow(2).sum() for t in theta))
        lo, hi = obs.data_range
        mean = obs.extras.get("data_mean")
        rng = np.random.default_rng([int(seed), 7])
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        labels = _candidate_labels(o.candidates, obs.num_classes, device)
        pooled, pooled_lam, runs = [], [], []
        total = o.runs * o.iterations
        for r in range(o.runs):
            hp = sample_hyperparameters(rng, o)
            _set_alpha(net, hp["alpha"])
            x0 = torch.randn((o.candidates, *obs.input_shape), generator=gen, dtype=torch.float64)
            x = (x0 * hp["init_scale"]).to(device).requires_grad_(True)
            lam = torch.rand(o.candidates, generator=gen, dtype=torch.float64).to(device).requires_grad_(True)
            opt = torch.optim.SGD([{"params": [x], "lr": hp["lr"]}, {"params": [lam], "lr": hp["lambda_lr"]}],
                                  momentum=o.momentum)
            best_x, stat, curve = x.detach().clone(), float("nan"), []
            for it in range(o.iterations):
                out = net(x)
                if obs.num_classes == 1:
                    phi = out.reshape(-1) * labels
                else:
                    own = out.gather(1, labels[:, None]).squeeze(1)
                    phi = own - out.scatter(1, labels[:, None], float("-inf")).max(1).values
                grads = torch.autograd.grad((lam * phi).sum(), params, create_graph=True)
                l_stat = sum((t - g).pow(2).sum() for t, g in zip(theta, grads))
                l_lam = torch.relu(hp["lambda_min"] - lam).sum()
                loss = l_stat + l_lam
                if o.box:
                    loss = loss + torch.relu(x - hi).pow(2).sum() + torch.relu(lo - x).pow(2).sum()
                value = float(loss.detach())
                if not math.isfinite(value):
                    break
                best_x, stat = x.detach().clone(), math.sqrt(max(float(l_stat.detach()), 0.0) / theta_sq)
                gx, gl = torch.autograd.grad(loss, [x, lam])
                x.grad, lam.grad = gx, gl
                opt.step()
                if it % o.trace_every == 0 or it == o.iterations - 1:
                    curve.append((it, value, stat))
                    if callback is not None:
                        callback(r * o.iterations + it, self._images(best_x, mean))
                    if progress is not None:
                        progress(r * o.iterations + it + 1, total, value)
            diverged = not math.isfinite(value) or not _tame(best_x, lo, hi)
            runs.append({**hp, "relative_stationarity": stat, "finished": it == o.iterations - 1 and
                         math.isfinite(value), "diverged": diverged, "curve": curve})
            if diverged:  # a run whose loss or candidates blew up is dropped, never returned as candidates
                continue
            pooled.append(best_x)
            pooled_lam.append(lam.detach().clone())
        dropped = sum(r["diverged"] for r in runs)
        if not pooled:
            raise LeakbenchError(f"all {o.runs} kkt runs diverged (non-finite loss or candidates beyond "
                                 f"{EXPLODED:g}× the data box); lower lr or init_scale")
        images = self._images(torch.cat(pooled), mean).to(obs.dtype)
        lab = labels.repeat(len(pooled))
        lab = ((lab + 1) / 2).long() if obs.num_classes == 1 else lab
        return Reconstruction(images=images, labels=lab, confidence=torch.cat(pooled_lam).to(obs.dtype),
                              trace={"runs": runs, "candidates_per_run": o.candidates, "diverged_runs": dropped,
                                     "diverged": dropped * o.candidates})

    @staticmethod
    def _images(x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
        return x if mean is None else x + mean.to(x.device, x.dtype)
