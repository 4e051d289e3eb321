"""Trained target networks for the attacks on published weights, and their distance to a KKT point.

:func:`train_target` trains the networks that Haim et al. (2022, "Reconstructing
training data from trained neural networks", Sec. 5 and appendix C) and the
provable-attacks paper (Smorodinsky, Vardi & Safran, "Provable privacy attacks on
trained shallow neural networks", Sec. 5) attack:

- a ReLU MLP d-W1-…-1 (``"mlp:1000-1000"``) or a two-layer net (``"twolayer:M"``);
  *homogeneous* means only the first layer has a bias (Haim et al.'s code and the
  provable-attacks paper: then Φ(cθ; x) = c^L Φ(θ; x));
- the "small" initialisation: first layer N(0, 10⁻⁸), the rest Kaiming (Haim et al.
  appendix C.3.1);
- full-batch gradient descent on the logistic or exponential loss of ±1 labels
  (cross-entropy for multiclass targets, Buzaglo et al. 2023), until the training
  loss is below ``loss_tol`` or ``steps`` run out; float64 by default.
  ``schedule="loss-scaled"`` uses the step η/L(θ_t) of Lyu & Li (2020, "Gradient
  descent maximizes the margin of homogeneous neural networks", Sec. 6), which reaches a
  tiny loss in far fewer steps than a constant step; ``schedule="adaptive"`` is the
  same step η_t/L(θ_t) with η_t adapted as in Lyu & Li's experiments (Sec. 6 and their
  appendix: the rate grows while the loss decreases, and a step that does not decrease
  it is undone and retried with a smaller rate; our factors ×1.1 up, ÷2 down).  Both are
  time changes of the same gradient flow on log L (dθ/dt = −∇L/L), so they follow the
  paper's trajectory while reaching the far-out, direction-converged regime that
  constant-step GD needs 10⁶ epochs for (Haim et al. appendix C.3.2); ``"constant"``
  (Haim et al.'s full-batch GD) stays the default;
- inputs optionally centred by the training mean (Haim et al.: "mean-subtracted").

The first-layer scale matters for what the weights reveal: from the paper's std 10⁻⁴ a
two-layer net first aligns its neurons to a few directions (early alignment) and keeps
them — measured on 10 random-label sphere points in d = 10, ``twolayer:200``, adaptive
schedule, data seeds 0–4: 4–18 significant distinct directions (within 0.99 cosine),
hundreds of (neuron, sample) pairs at a kink; with ``init_scale=0.3`` 110–180.  A KKT point
with fewer directions than training points does not pin the points down (see
:mod:`leakbench.attacks.trained.kkt`).

Theorem 2.1 (Lyu & Li; Ji & Telgarsky) says gradient flow on such a network converges
in direction to a KKT point of  min ½‖θ‖²  s.t.  y_i Φ(θ; x_i) ≥ 1,  whose stationarity
condition is (Haim et al. eq. (2); provable-attacks paper eq. (2))

    θ = Σ_i λ_i y_i ∇_θ Φ(θ; x_i),    λ_i ≥ 0.

(for ReLU networks with ∇_θΦ a Clarke subgradient: ReLU′(0) ∈ [0, 1], see ``kink_tol``).
:func:`kkt_residual` measures how far the weights are from it:
min_{λ ≥ 0} ‖θ − Σ_i λ_i y_i ∇_θΦ(θ; x_i)‖ / ‖θ‖ with the best non-negative multipliers
found by NNLS (``scipy.optimize.nnls``).  The ratio is invariant to rescaling θ for a
homogeneous network (λ absorbs the scale), so the margin need not be normalised.  For
multiclass targets each pair (i, j ≠ y_i) contributes ∇(Φ_{y_i} − Φ_j)(x_i) (the
multiclass max-margin KKT conditions of Buzaglo et al. 2023).

Per-sample gradients are never materialised for networks made of Linear layers: with
h the layer input and δ the back-propagated output gradient, ⟨∇_W s_i, ∇_W s_k⟩ =
(δ_i·δ_k)(h_i·h_k), so the Gram matrix costs one forward and one backward pass per
output direction (other architectures fall back to ``torch.func.vmap`` per-sample
gradients).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError, expect
from ..losses import LOSSES, get_loss
from .init import weighted_layers
from .spec import build

__all__ = ["TargetConfig", "TrainedTarget", "KKTResidual", "train_target", "kkt_residual", "margins", "scale_to_norm",
           "make_homogeneous"]

BINARY_LOSSES = ("logistic", "exponential")
SCHEDULES = ("constant", "loss-scaled", "adaptive")
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class TargetConfig:
    """How a target network is built and trained (everything needed to rebuild it)."""

    model: str = "mlp:1000-1000"
    act: str = "relu"
    homogeneous: bool = True
    init: str = "small"
    init_scale: float | None = 1e-4
    loss: str = "logistic"
    lr: float = 0.01
    steps: int = 10_000
    loss_tol: float = 1e-6
    schedule: str = "constant"
    max_lr: float = math.inf
    center: bool = True
    dtype: str = "float64"
    seed: int = 0

    def check(self) -> None:
        expect(self.loss in LOSSES, f"expected loss one of {', '.join(LOSSES.names())}, got {self.loss!r} (field loss)")
        expect(self.loss in (*BINARY_LOSSES, "ce"),
               f"expected loss 'logistic' or 'exponential' (±1 labels) or 'ce' (multiclass), got {self.loss!r} "
               "(field loss)")
        expect(self.schedule in SCHEDULES, f"expected schedule one of {', '.join(SCHEDULES)}, got {self.schedule!r} "
               "(field schedule)")
        expect(self.dtype in DTYPES, f"expected dtype 'float64' or 'float32', got {self.dtype!r} (field dtype)")
        for name in ("lr", "max_lr", "loss_tol"):
            value = getattr(self, name)
            expect(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= (name == "loss_tol") - 1
                   and (value > 0 or name == "loss_tol"),
                   f"expected a positive number{' (or 0: no early stop)' if name == 'loss_tol' else ''}, "
                   f"got {value!r} (field {name})")
        expect(isinstance(self.steps, int) and not isinstance(self.steps, bool) and self.steps >= 0,
               f"expected steps ≥ 0 (an int), got {self.steps!r} (field steps)")
        expect(isinstance(self.seed, int) and not isinstance(self.seed, bool),
               f"expected an integer seed, got {self.seed!r} (field seed)")

    @property
    def binary(self) -> bool:
        return self.loss in BINARY_LOSSES


@dataclass
class KKTResidual:
    """Distance of trained weights to the stationarity condition of the max-margin problem.

    ``residual`` = ‖θ − Σ λ_c ∇s_c‖ / ‖θ‖ with the NNLS multipliers ``multipliers``
    (one per sample for binary targets, n×(K−1) for multiclass), ``margins`` the
    per-sample margins y_i Φ(x_i) (or Φ_{y_i} − max_{j≠y_i} Φ_j), ``normalized_margins``
    the margins divided by their minimum (1 on the margin).  ``kink_tol`` > 0: the
    first-layer ReLU derivative of the ``kinks`` (sample, neuron) pairs within that
    tolerance of the kink was free in [0, 1] (see :func:`kkt_residual`).
    """

    residual: float
    multipliers: torch.Tensor
    margins: torch.Tensor
    normalized_margins: torch.Tensor
    theta_norm: float
    method: str
    kink_tol: float = 0.0
    kinks: int = 0

    @property
    def on_margin(self) -> torch.Tensor:
        """Samples whose margin is within 10 % of the smallest (the provable-attacks code's slack)."""
        return self.normalized_margins <= 1.1


@dataclass(eq=False)
class TrainedTarget:
    """A trained network with its training set, saved and loaded together.

    ``x``: the training samples in data space (N×C×H×W or N×d); ``mean``: the
    per-feature mean subtracted before the network (``None`` if not centred), so the
    network's inputs are :attr:`inputs`; ``y``: float ±1 for binary targets, class
    indices for multiclass; ``history``: (step, loss) pairs; ``stop_reason``: why training
    ended — ``"loss_tol"``, ``"steps"``, or ``"precision"`` (the adaptive schedule reached
    a loss so small that no step it can still resolve in the weights' float precision
    decreases it: a report, not an error; see :func:`train_target`).
    """

    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    config: TargetConfig
    mean: torch.Tensor | None = None
    history: list[tuple[int, float]] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    stop_reason: str = ""

    @property
    def inputs(self) -> torch.Tensor:
        """What the network was trained on: ``x − mean`` (``x`` when not centred)."""
        return self.x if self.mean is None else self.x - self.mean

    @property
    def binary(self) -> bool:
        return self.config.binary

    @property
    def final_loss(self) -> float:
        return self.history[-1][1] if self.history else float("nan")

    @property
    def input_range(self) -> tuple[float, float]:
        """The box the network's inputs live in: the data box [0, 1] shifted by the mean."""
        if self.mean is None:
            return (0.0, 1.0)
        return (float(-self.mean.max()), float(1.0 - self.mean.min()))

    @torch.no_grad()
    def outputs(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Network outputs on data-space samples ``x`` (default: the training set), centred as in training."""
        x = self.x if x is None else x
        x = x.to(self.x.device, self.x.dtype)
        return self.model(x if self.mean is None else x - self.mean)

    def margins(self) -> torch.Tensor:
        """Per-sample margins of the training set (y·Φ, or Φ_y − max_{j≠y} Φ_j)."""
        return margins(self.outputs(), self.y)

    def kkt_residual(self, *, kink_tol: float = 0.0) -> KKTResidual:
        """Distance of the weights to a KKT point of the max-margin problem on the training set (see kkt_residual)."""
        return kkt_residual(self.model, self.inputs, self.y, kink_tol=kink_tol)

    def save(self, path: str | Path) -> Path:
        """Write model weights, training set, config and history with ``torch.save`` (tensors and plain data only,
        so :meth:`load` reads it with ``weights_only=True``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({
            "format": "leakbench-target-1",
            "config": dataclasses.asdict(self.config),
            "state_dict": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "input_shape": tuple(self.x.shape[1:]),
            "outputs": _out_width(self.model),
            "x": self.x.detach().cpu(), "y": self.y.detach().cpu(),
            "mean": None if self.mean is None else self.mean.detach().cpu(),
            "history": list(self.history), "classes": list(self.classes), "seconds": self.seconds,
            "stop_reason": self.stop_reason,
        }, path)
        return path

    @classmethod
    def load(cls, path: str | Path, *, device: str | torch.device = "cpu") -> "TrainedTarget":
        """Read a target written by :meth:`save` (weights, data, config; bit-identical)."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"expected a saved target file, got {str(path)!r} which does not exist (argument path)")
        try:  # weights_only: tensors, numbers, strings and containers; a pickled callable is refused unrun
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # UnpicklingError (code in the file), RuntimeError (not a torch zip), EOFError...
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise ConfigError(f"expected a target file written by TrainedTarget.save, got {str(path)!r}, which "
                              f"torch.load(weights_only=True) refuses ({first}); files are read as data only, "
                              "never as code (argument path)") from None
        if not isinstance(blob, dict) or blob.get("format") != "leakbench-target-1":
            raise ConfigError(f"expected a file written by TrainedTarget.save, got {str(path)!r}")
        try:
            config = TargetConfig(**blob["config"])
            config.check()
            model = _make_model(config, tuple(blob["input_shape"]), blob["outputs"])
            model.load_state_dict(blob["state_dict"])
            x, y, mean = blob["x"], blob["y"], blob["mean"]
            expect(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                   and (mean is None or isinstance(mean, torch.Tensor)), "x, y and mean must be tensors")
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ConfigError(f"{str(path)!r} is not a complete leakbench target ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:160] if str(err) else ''}); save it again with "
                              "TrainedTarget.save (argument path)") from None
        model.to(device)
        return cls(model=model.eval(), x=x.to(device), y=y.to(device), config=config,
                   mean=None if mean is None else mean.to(device), history=[tuple(h) for h in blob["history"]],
                   classes=blob["classes"], seconds=blob["seconds"],
                   stop_reason=blob.get("stop_reason", ""))


# --------------------------------------------------------------------------- building and training


def make_homogeneous(model: nn.Module) -> nn.Module:
    """Drop the bias of every Linear/Conv layer but the first (in place): Φ(cθ; x) = c^L Φ(θ; x).

    This is the homogeneous network of Haim et al.'s code and of the provable-attacks
    paper (hidden bias in the first layer only, none in the output layer).
    """
    for layer in weighted_layers(model)[1:]:
        if layer.bias is not None:
            layer.register_parameter("bias", None)
    return model


def scale_to_norm(model: nn.Module, norm: float) -> nn.Module:
    """Multiply every trainable parameter by one constant so that ‖θ‖ = ``norm`` (in place).

    For a homogeneous network of degree L, Φ(cθ) = c^L Φ(θ): the KKT direction and every
    input-gradient direction are unchanged, while outputs and step sizes come back to the
    scale the attacks' hyperparameter ranges assume (weights trained far out in norm).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        current = math.sqrt(float(sum(p.pow(2).sum() for p in params)))
        for p in params:
            p.mul_(norm / current)
    return model


def _out_width(model: nn.Module) -> int:
    return int(weighted_layers(model)[-1].weight.shape[0])


def _make_model(config: TargetConfig, input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    scale = config.init_scale if config.init in ("small", "uniform") else None
    options: dict[str, Any] = {"init_scale": scale} if scale is not None else {}
    model = build(config.model, input_shape, outputs, act=config.act, bias=True, init=config.init,
                  seed=config.seed, dtype=DTYPES[config.dtype], **options)
    if config.homogeneous:
        make_homogeneous(model)
    return model.eval()


def _select(data: Any, labels: Any, per_class: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    from ..data import ImageDataset  # data is left of models: allowed

    if isinstance(data, ImageDataset):
        expect(labels is None, "labels come from the dataset; pass labels only with a tensor x (argument labels)")
        x, y, classes = data.images, data.labels, list(data.classes)
        if per_class is not None:
            expect(isinstance(per_class, int) and per_class >= 1,
                   f"expected per_class as a positive int, got {per_class!r} (argument per_class)")
            rng = np.random.default_rng(seed)
            lab = y.cpu().numpy()
            picks = []
            for c in range(len(classes)):
                pool = np.flatnonzero(lab == c)
                expect(pool.size >= per_class, f"expected at least {per_class} samples of class {classes[c]!r}, "
                       f"got {pool.size} (argument per_class)")
                picks.append(rng.choice(pool, size=per_class, replace=False))
            idx = torch.from_numpy(np.sort(np.concatenate(picks)))
            x, y = x[idx], y[idx]
        return x, y, classes
    expect(isinstance(data, torch.Tensor) and data.dim() >= 2,
           f"expected an ImageDataset or a tensor x of shape N×d or N×C×H×W, got {type(data).__name__} (argument data)")
    expect(isinstance(labels, torch.Tensor) and labels.dim() == 1 and labels.shape[0] == data.shape[0],
           f"expected labels as a 1-D tensor with one entry per sample ({data.shape[0]}), got "
           f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__} (argument labels)")
    expect(per_class is None, "per_class selects from an ImageDataset; slice the tensors yourself (argument per_class)")
    return data, labels, []


def _targets(y: torch.Tensor, config: TargetConfig) -> tuple[torch.Tensor, int]:
    """±1 float labels and width 1 for binary losses; class indices and K outputs for ce."""
    if config.binary:
        if y.dtype.is_floating_point:
            values = set(torch.unique(y).tolist())
            expect(values <= {-1.0, 1.0}, f"expected ±1 labels for loss {config.loss!r}, got values {sorted(values)}")
            return y, 1
        values = set(torch.unique(y).tolist())
        expect(values <= {0, 1}, f"expected a binary task (classes 0/1) for loss {config.loss!r}, got classes "
               f"{sorted(values)[:10]}; load a binary variant (binary='odd-even' or 'vehicles-animals') or use loss='ce'")
        return y.to(torch.float64) * 2 - 1, 1
    expect(not y.dtype.is_floating_point, "expected integer class indices for loss 'ce' (argument labels)")
    k = int(y.max()) + 1
    expect(k >= 2, f"expected at least 2 classes for loss 'ce', got {k}")
    return y.long(), k


def train_target(
    data: Any,
    labels: torch.Tensor | None = None,
    *,
    per_class: int | None = None,
    data_seed: int = 0,
    device: str | torch.device = "cpu",
    progress: Any = None,
    **options: Any,
) -> TrainedTarget:
    """Train a target network the way the attacks on trained weights assume.

    ``data``: an :class:`~leakbench.data.ImageDataset` (``per_class`` picks that many
    samples of each class, seeded by ``data_seed``) or a tensor ``x`` with ``labels``
    (0/1 or ±1 for binary losses, class indices for ``ce``).  ``options`` are the fields
    of :class:`TargetConfig` (``model="mlp:1000-1000"``, ``loss="logistic"``, ``lr``,
    ``steps``, ``loss_tol``, ``schedule``, ``homogeneous``, ``init``, ``init_scale``,
    ``center``, ``dtype``, ``seed``).  ``progress(done, total, loss)`` is called every
    few hundred steps.

    Training ends at ``loss_tol``, after ``steps``, or — adaptive schedule only — when the
    loss can no longer decrease in the weights' float precision: far out in norm a step
    small enough to decrease log L (e.g. one that must not cross a ReLU kink the weights
    sit next to) changes θ by less than its rounding (‖Δθ‖ ≤ 2⁻⁵²‖θ‖ in float64).  That
    is where training has got all it can in this precision, not a failure: it stops and
    reports ``stop_reason="precision"`` (measured: twolayer:200 on 10 sphere points in d = 100
    after ≈ 1 000 steps, ‖θ‖ ≈ 3·10¹¹, log L ≈ −6·10²², where it used to raise "training
    stalled" after halving the rate down to 10⁻³⁰⁰).
    """
    known = {f.name for f in dataclasses.fields(TargetConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r} for train_target; known options: {', '.join(sorted(known))}")
    config = TargetConfig(**options)
    config.check()
    x, y, classes = _select(data, labels, per_class, data_seed)
    dtype = DTYPES[config.dtype]
    x = x.to(device=device, dtype=dtype)
    y, width = _targets(y.to(device), config)
    y = y.to(dtype) if config.binary else y
    mean = x.mean(dim=0, keepdim=True) if config.center else None
    inputs = x if mean is None else x - mean
    model = _make_model(config, tuple(x.shape[1:]), width).to(device)
    history = _gradient_descent(model, inputs, y, config, progress)
    return TrainedTarget(model=model.eval(), x=x, y=y, config=config, mean=mean, history=history[0],
                         classes=classes, seconds=history[1], stop_reason=history[2])


def _log(value: float) -> float:
    return math.inf if value == math.inf else math.log(value)


def _log_loss(loss: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log L(θ) computed without underflow (log-sum-exp), for the loss-scaled step ∇log L = ∇L / L."""
    if loss == "ce":
        return torch.log(torch.nn.functional.cross_entropy(out, y))
    z = -y.reshape(-1) * out.reshape(-1)  # −q_i
    if loss == "exponential":
        per = z
    else:  # log softplus(z): z for z ≪ 0 (softplus(z) ≈ e^z), else the direct value
        per = torch.where(z < -30, z, torch.log(torch.nn.functional.softplus(z.clamp_min(-30))))
    return torch.logsumexp(per, 0) - math.log(per.numel())


def _gradient_descent(model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TargetConfig,
                      progress: Any) -> tuple[list[tuple[int, float]], float, str]:
    """Full-batch GD: θ ← θ − η∇L (constant) or θ ← θ − min(η/L, η_max)·∇L = θ − min(η, η_max·L)·∇log L."""
    if config.schedule == "adaptive":
        return _adaptive_descent(model, x, y, config, progress)
    loss_fn = get_loss(config.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    history: list[tuple[int, float]] = []
    every = max(1, min(1000, config.steps // 100 or 1))
    log_tol = math.log(config.loss_tol) if config.loss_tol > 0 else -math.inf
    start = time.perf_counter()
    step = 0
    while True:
        out = model(x)
        if config.schedule == "constant":
            objective = loss_fn(out, y)
            log_value = math.log(max(float(objective.detach()), 1e-320))
        else:
            objective = _log_loss(config.loss, out, y)
            log_value = float(objective.detach())
        if _record(history, step, log_value, log_tol, config.steps, every, progress):
            break
        grads = torch.autograd.grad(objective, params)
        lr = config.lr if config.schedule == "constant" else math.exp(min(math.log(config.lr),
                                                                           _log(config.max_lr) + log_value))
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)
        step += 1
    return history, time.perf_counter() - start, _reason(log_value, log_tol)


def _reason(log_value: float, log_tol: float) -> str:
    return "loss_tol" if log_value < log_tol else "steps"


def _record(history: list[tuple[int, float]], step: int, log_value: float, log_tol: float, steps: int, every: int,
            progress: Any, *, final: bool = False) -> bool:
    """Log the loss every ``every`` steps (and at the end, or when ``final``); raise on divergence; True when
    training is done."""
    value = math.exp(min(log_value, 700.0))
    done = final or log_value < log_tol or step >= steps
    if step % every == 0 or done:
        history.append((step, value))
        if progress is not None:
            progress(step, steps, value)
    if not math.isfinite(log_value):
        raise ConfigError(f"training diverged at step {step} (loss {value}); lower lr (field lr)")
    return done


def _adaptive_descent(model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TargetConfig,
                      progress: Any) -> tuple[list[tuple[int, float]], float, str]:
    """θ ← θ − min(η_t, η_max·L)·∇log L with η_t ×1.1 after an accepted step, ÷2 (and the step undone) otherwise.

    Every gradient evaluation counts as a step (accepted or not), so ``steps`` bounds the cost.
    When the rejected step is already below the weights' float resolution (‖Δθ‖ ≤ ε‖θ‖) no
    smaller step can help: training stops there with reason ``"precision"``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    history: list[tuple[int, float]] = []
    every = max(1, min(1000, config.steps // 100 or 1))
    log_tol = math.log(config.loss_tol) if config.loss_tol > 0 else -math.inf
    start = time.perf_counter()
    eta = float(config.lr)
    objective = _log_loss(config.loss, model(x), y)
    log_value = float(objective.detach())
    eps = torch.finfo(x.dtype).eps
    step, reason = 0, ""
    while True:
        if _record(history, step, log_value, log_tol, config.steps, every, progress):
            reason = _reason(log_value, log_tol)
            break
        grads = torch.autograd.grad(objective, params)
        saved = [p.detach().clone() for p in params]
        lr = math.exp(min(math.log(eta), _log(config.max_lr) + log_value))
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)
        trial = _log_loss(config.loss, model(x), y)
        trial_value = float(trial.detach())
        if math.isfinite(trial_value) and trial_value < log_value:
            objective, log_value, eta = trial, trial_value, eta * 1.1
        else:  # undo the step and retry with half the rate
            with torch.no_grad():
                torch._foreach_copy_(params, saved)
            step_norm = lr * math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
            theta_norm = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in params))
            if math.isfinite(trial_value) and step_norm <= eps * theta_norm:
                # below the weights' rounding: no representable step decreases the loss any more
                step += 1
                _record(history, step, log_value, log_tol, config.steps, every, progress, final=True)
                reason = "precision"
                break
            eta /= 2
            objective = _log_loss(config.loss, model(x), y)
            if eta < 1e-300:
                raise ConfigError(f"training stalled at step {step}: no step decreases the loss (field lr)")
        step += 1
    return history, time.perf_counter() - start, reason


# --------------------------------------------------------------------------- margins and KKT residual


def margins(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y·Φ(x) for a scalar output and ±1 labels; Φ_y − max_{j≠y} Φ_j for K outputs and class indices."""
    if outputs.dim() == 1 or outputs.shape[-1] == 1:
        return outputs.reshape(-1) * y.reshape(-1).to(outputs.dtype)
    own = outputs.gather(1, y.long().reshape(-1, 1)).squeeze(1)
    others = outputs.scatter(1, y.long().reshape(-1, 1), float("-inf"))
    return own - others.max(dim=1).values


def _directions(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Output weightings v (G, n, K): the scalars s_{g,i} = v_{g,i}·Φ(x_i) whose gradients enter the KKT sum."""
    n, k = outputs.shape
    if k == 1:
        return y.reshape(1, n, 1).to(outputs.dtype)
    eye = torch.eye(k, dtype=outputs.dtype, device=outputs.device)
    own = eye[y.long()]  # (n, K)
    others = torch.stack([torch.arange(k, device=y.device)[torch.arange(k, device=y.device) != c] for c in range(k)])
    j = others[y.long()]  # (n, K−1): the wrong classes of each sample
    return torch.stack([own - eye[j[:, g]] for g in range(k - 1)])  # (K−1, n, K)


def _linear_only(model: nn.Module) -> list[nn.Linear] | None:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    covered = {id(p) for m in linears for p in m.parameters(recurse=False)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    has_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not linears or has_norm or any(id(p) not in covered for p in trainable):
        return None
    return linears


def _layer_terms(model: nn.Module, linears: list[nn.Linear], x: torch.Tensor, v: torch.Tensor, act_grad: bool = False):
    """Per Linear layer: (input h (n, in), output gradients δ (c, out) of the scalars s_c, W h + b (n, out)).

    With ``act_grad`` also the gradients u (c, out) of the scalars w.r.t. the output of the activation
    that follows the first layer (the ReLU derivative not yet applied), or ``None`` as the last item
    when that activation is not a ReLU module fed by the first layer.
    """
    inputs: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}
    calls: dict[int, int] = {}
    acts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, args, output):
        calls[id(module)] = calls.get(id(module), 0) + 1
        inputs[id(module)] = args[0].detach().reshape(args[0].shape[0], -1)
        outs[id(module)] = output

    def act_hook(module, args, output):
        acts.append((args[0], output))

    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)] if act_grad else []
    handles = [m.register_forward_hook(hook) for m in linears]
    handles += [m.register_forward_hook(act_hook) for m in relus[:1]]
    try:
        with torch.enable_grad():
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    if any(calls.get(id(m), 0) != 1 for m in linears) or any(outs[id(m)].dim() != 2 for m in linears):
        return None
    first_act = None
    if act_grad and len(acts) == 1 and acts[0][0] is outs[id(linears[0])]:
        first_act = acts[0][1]
    out = out.reshape(out.shape[0], -1)
    groups = v.shape[0]
    wanted = [outs[id(m)] for m in linears] + ([first_act] if first_act is not None else [])
    deltas = []  # per group: list over layers of (n, out)
    for g in range(groups):
        s = (out * v[g]).sum()
        deltas.append(torch.autograd.grad(s, wanted, retain_graph=g < groups - 1))
    terms = []
    for li, m in enumerate(linears):
        h = inputs[id(m)]
        d = torch.cat([deltas[g][li] for g in range(groups)]).detach()  # (c, out)
        wh = h @ m.weight.detach().T  # (n, out): W h_i
        if m.bias is not None:
            wh = wh + m.bias.detach()
        terms.append((h, d, wh))
    if act_grad:
        u = torch.cat([deltas[g][-1] for g in range(groups)]).detach() if first_act is not None else None
        return terms, u
    return terms


def _gram_linear(model: nn.Module, linears: list[nn.Linear], x: torch.Tensor, v: torch.Tensor):
    """Gram matrix and ⟨∇s_c, θ⟩ of the scalars s_{g,i} = v_{g,i}·Φ(x_i), via layer inputs and output gradients."""
    terms = _layer_terms(model, linears, x, v)
    if terms is None:
        return None
    return _assemble(linears, terms, v.shape[0])


def _assemble(linears: list[nn.Linear], terms, groups: int):
    n = terms[0][0].shape[0]
    c = groups * n
    dtype, device = terms[0][0].dtype, terms[0][0].device
    gram = torch.zeros(c, c, dtype=dtype, device=device)
    proj = torch.zeros(c, dtype=dtype, device=device)
    for m, (h, d, wh) in zip(linears, terms):
        hh = h @ h.T + (1.0 if m.bias is not None else 0.0)
        gram += (d @ d.T) * hh.repeat(groups, groups)
        proj += (d * wh.repeat(groups, 1)).sum(1)
    return gram, proj


def _gram_generic(model: nn.Module, x: torch.Tensor, v: torch.Tensor, *, max_entries: float = 2e8):
    """Gram matrix and ⟨∇s_c, θ⟩ from per-sample gradients (torch.func.vmap), for any architecture."""
    from torch.func import functional_call, grad, vmap

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in params.values())
    groups, n = v.shape[:2]
    if groups * n * total > max_entries:
        raise ConfigError(f"the KKT residual of this architecture needs {groups * n} per-sample gradients of "
                          f"{total} parameters (over {max_entries:.0e} numbers); use fewer samples or an MLP")

    def scalar(p, xi, vi):
        return (functional_call(model, p, (xi.unsqueeze(0),)).reshape(-1) * vi).sum()

    per_sample = vmap(grad(scalar), in_dims=(None, 0, 0))
    rows = []
    for g in range(groups):
        gr = per_sample(params, x, v[g])
        rows.append(torch.cat([gr[name].reshape(n, -1) for name in names], dim=1))
    big = torch.cat(rows)
    theta = torch.cat([params[name].reshape(-1) for name in names])
    return big @ big.T, big @ theta


def kkt_residual(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, kink_tol: float = 0.0,
                 max_kinks: int = 6000) -> KKTResidual:
    """min_{λ≥0} ‖θ − Σ_c λ_c ∇_θ s_c(θ)‖ / ‖θ‖ by NNLS, with s = y_i Φ(x_i) (or Φ_{y_i} − Φ_j, multiclass).

    ``x`` are the network's inputs (centred if it was trained centred), ``y`` ±1 labels
    for a scalar output or class indices for K outputs.  Solved on the Gram matrix
    K = G Gᵀ of the per-sample gradients G: with K = V S Vᵀ, NNLS on
    (S^{1/2} Vᵀ, S^{−1/2} Vᵀ Gθ) minimises the same quadratic as on (Gᵀ, θ).

    ``kink_tol`` > 0 (default 0: the plain gradient, ReLU′(0) = 0): the KKT conditions
    of a non-smooth homogeneous network (Lyu & Li 2020, Def. of KKT points with the
    Clarke subdifferential) allow ReLU′ anywhere in [0, 1] at a kink, and gradient
    descent converges *in direction* to a point where some pre-activations w_j·x_i + b_j
    are exactly 0, while at any finite time they are only small: the plain gradient then
    picks 0 or 1 and the residual stalls (measured 0.3–0.4 on trained two-layer nets,
    whatever the training length).  Pairs (sample i, first-layer neuron j) with
    |w_j·x_i + b_j| ≤ kink_tol·‖(w_j, b_j)‖‖(x_i, 1)‖ (an angle within ≈ kink_tol rad of
    the kink) get a free derivative s_ij ∈ [0, 1]; with μ_ij = λ_i s_ij the problem stays
    convex (λ ≥ 0, 0 ≤ μ_ij ≤ λ_i) and is solved by accelerated projected gradient
    from the NNLS point (so the relaxed residual is never above the plain one).  Only
    the first hidden layer is relaxed (its derivative enters the gradient linearly);
    deeper kinks keep ReLU′(0) = 0.  Needs an MLP of Linear layers whose first layer
    feeds a ReLU module, and at most ``max_kinks`` relaxed pairs.
    """
    from scipy.optimize import nnls

    expect(isinstance(kink_tol, (int, float)) and not isinstance(kink_tol, bool) and kink_tol >= 0,
           f"expected kink_tol ≥ 0, got {kink_tol!r} (argument kink_tol)")
    expect(isinstance(x, torch.Tensor) and x.dim() >= 2 and isinstance(y, torch.Tensor) and y.shape[0] == x.shape[0],
           "expected inputs x (N×…) and one label per sample (arguments x, y)")
    model = model.eval()
    with torch.no_grad():
        out = model(x)
    out = out.reshape(out.shape[0], -1)
    if out.shape[1] == 1:
        expect(y.dtype.is_floating_point and set(torch.unique(y).tolist()) <= {-1.0, 1.0},
               "expected ±1 float labels for a network with one output (argument y)")
    v = _directions(out, y)
    linears = _linear_only(model)
    pair = _gram_linear(model, linears, x, v) if linears is not None else None
    method = "linear-layers"
    if pair is None:
        pair, method = _gram_generic(model, x, v), "vmap"
    gram, proj = (t.detach().to(torch.float64).cpu() for t in pair)
    theta_sq = float(sum(p.detach().double().pow(2).sum() for p in model.parameters() if p.requires_grad))
    evals, evecs = torch.linalg.eigh(gram)
    keep = evals > evals.max().clamp_min(0) * 1e-13
    root = evals[keep].sqrt()
    a = (root[:, None] * evecs[:, keep].T).numpy()
    b = ((evecs[:, keep].T @ proj) / root).numpy()
    lam, _ = nnls(a, b, maxiter=50 * max(a.shape[1], 10))
    lam_t = torch.from_numpy(lam)
    res_sq = theta_sq - 2 * float(lam_t @ proj) + float(lam_t @ gram @ lam_t)
    residual = math.sqrt(max(res_sq, 0.0) / theta_sq) if theta_sq > 0 else float("nan")
    kinks = 0
    if kink_tol > 0:
        if linears is None:
            raise ConfigError("kink_tol needs a network made of Linear layers (an MLP) (argument kink_tol)")
        lam_t, res_sq, kinks = _kink_relaxed(model, linears, x, v, theta_sq, lam_t, res_sq, float(kink_tol),
                                             max_kinks)
        residual = math.sqrt(max(res_sq, 0.0) / theta_sq) if theta_sq > 0 else float("nan")
        method += "+kinks"
    marg = margins(out, y).detach().double().cpu()
    groups, n = v.shape[:2]
    multipliers = lam_t.reshape(groups, n).T.squeeze(1) if groups > 1 else lam_t
    low = float(marg.min())
    normalized = marg / low if low > 0 else torch.full_like(marg, float("nan"))
    return KKTResidual(residual=residual, multipliers=multipliers, margins=marg, normalized_margins=normalized,
                       theta_norm=math.sqrt(theta_sq), method=method, kink_tol=float(kink_tol), kinks=kinks)


def _kink_relaxed(model: nn.Module, linears: list[nn.Linear], x: torch.Tensor, v: torch.Tensor, theta_sq: float,
                  lam0: torch.Tensor, res0: float, tol: float, max_kinks: int, iterations: int = 5000):
    """min over λ ≥ 0, 0 ≤ μ_k ≤ λ_{c(k)} of ‖θ − Σ_c λ_c G⁻_c − Σ_k μ_k E_k‖² (FISTA), from the NNLS point.

    G⁻_c: the gradient of s_c with the derivative of its near-kink first-layer pairs set to 0;
    E_k, k = (c, j): the first-layer row-j gradient u_cj·(x_i, 1) that a derivative of 1 adds.
    """
    got = _layer_terms(model, linears, x, v, act_grad=True)
    if got is None or got[1] is None:
        raise ConfigError("kink_tol needs an MLP whose first Linear layer feeds a ReLU module (argument kink_tol)")
    terms, u = got
    first = linears[0]
    h1, d1, z1 = terms[0]
    groups, n = v.shape[0], h1.shape[0]
    bias = 1.0 if first.bias is not None else 0.0
    w_sq = first.weight.detach().pow(2).sum(1) + (first.bias.detach().pow(2) if first.bias is not None else 0.0)
    x_norm = (h1.pow(2).sum(1) + bias).sqrt()
    near = (z1.abs() <= tol * x_norm[:, None] * w_sq.sqrt()[None, :]).repeat(groups, 1)  # (C, W)
    near &= u != 0
    idx = near.nonzero()
    kinks = int(idx.shape[0])
    if kinks == 0:
        return lam0, res0, 0
    if kinks > max_kinks:
        raise ConfigError(f"kink_tol={tol} relaxes {kinks} (sample, neuron) pairs, more than max_kinks={max_kinks}; "
                          "use a smaller kink_tol (argument kink_tol)")
    cs, js = idx[:, 0], idx[:, 1]
    rows = cs % n
    d1m = d1.masked_fill(near, 0.0)
    gram0, proj0 = _assemble(linears, [(h1, d1m, z1), *terms[1:]], groups)
    hh = h1 @ h1.T + bias
    uk = u[cs, js]
    ee = (js[:, None] == js[None, :]).to(hh.dtype) * (uk[:, None] * uk[None, :]) * hh[rows][:, rows]
    ge = d1m[:, js] * uk[None, :] * hh.repeat(groups, 1)[:, rows]
    q = torch.cat([torch.cat([gram0, ge], 1), torch.cat([ge.T, ee], 1)]).double().cpu()
    p = torch.cat([proj0, uk * z1[rows, js]]).double().cpu()
    cs = cs.cpu()
    count = groups * n

    # the relaxed pairs of each column c, padded: slot[k] is the position of pair k in its row
    order = torch.argsort(cs, stable=True)
    per = torch.bincount(cs, minlength=count)
    width = int(per.max())
    slot = torch.empty_like(cs)
    slot[order] = torch.arange(kinks) - torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
    filled = torch.zeros(count, width, dtype=torch.bool)
    filled[cs, slot] = True
    steps_t = torch.arange(width + 1, dtype=torch.float64)

    def project(w: torch.Tensor) -> torch.Tensor:
        # Projection on {0 ≤ μ_k ≤ λ_c}: λ_c = max_t (a_c + sum of the t largest b_k of c)/(1 + t), clipped at 0
        # (each t gives a lower bound of the root of λ = a_c + Σ_k (b_k − λ)_+, the right t gives the root).
        a, b = w[:count], w[count:]
        pad = torch.full((count, width), -math.inf, dtype=torch.float64)
        pad[cs, slot] = b
        top = torch.sort(pad, dim=1, descending=True).values
        sums = torch.cumsum(torch.where(torch.isfinite(top), top, 0.0), 1)
        cand = (a[:, None] + torch.cat([torch.zeros(count, 1, dtype=torch.float64), sums], 1)) / (1 + steps_t)
        cand[:, 1:] = cand[:, 1:].masked_fill(~torch.isfinite(top), -math.inf)
        lam = cand.max(1).values.clamp_min(0)
        return torch.cat([lam, torch.minimum(b.clamp_min(0), lam[cs])])

    def value(w: torch.Tensor) -> float:
        return theta_sq - 2 * float(w @ p) + float(w @ (q @ w))

    s0 = (z1[rows, js] > 0).to(torch.float64).cpu()  # the plain derivative: the NNLS point is feasible
    w = torch.cat([lam0.double(), lam0.double()[cs] * s0])
    best, best_w = value(w), w
    step = 1.0 / (2 * float(torch.linalg.eigvalsh(q).max()))
    prev, z, t = w, w, 1.0
    last = best
    for it in range(iterations):
        w = project(z - step * 2 * (q @ z - p))
        t_next = (1 + math.sqrt(1 + 4 * t * t)) / 2
        z = w + ((t - 1) / t_next) * (w - prev)
        prev, t = w, t_next
        if it % 50 == 0 or it == iterations - 1:
            f = value(w)
            if f < best:
                best, best_w = f, w
        if it % 1000 == 999:  # stop when 1 000 iterations gain less than 10⁻⁶ of ‖θ‖²
            if last - best < 1e-6 * theta_sq:
                break
            last = best
    return best_w[:count], min(best, res0), kinks
