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

The distance of a trained target to a KKT point of the max-margin problem is
:func:`leakbench.analysis.stationarity.kkt_residual` (``kkt_residual(t.model, t.inputs, t.y)``); measurements of
what the first-layer scale does are in ``docs/trained.md``.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..budget import check_time
from ..errors import ConfigError, expect
from ..losses import LOSSES, get_loss
from .init import weighted_layers
from .spec import build

__all__ = ["TargetConfig", "TrainedTarget", "train_target", "margins", "scale_to_norm",
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
    def load(cls, path: str | Path, *, device: str | torch.device = "cpu") -> TrainedTarget:
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
    check_time(f"training the target ({step:,} of {steps:,} steps)")
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


# --------------------------------------------------------------------------- margins


def margins(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y·Φ(x) for a scalar output and ±1 labels; Φ_y − max_{j≠y} Φ_j for K outputs and class indices."""
    if outputs.dim() == 1 or outputs.shape[-1] == 1:
        return outputs.reshape(-1) * y.reshape(-1).to(outputs.dtype)
    own = outputs.gather(1, y.long().reshape(-1, 1)).squeeze(1)
    others = outputs.scatter(1, y.long().reshape(-1, 1), float("-inf"))
    return own - others.max(dim=1).values
