"""The gradient-matching engine shared by DLG, Inverting Gradients and the attacks built on them.

Given an observation (a gradient or a local update), find inputs x̂ — and, for
DLG, soft labels — whose simulated gradient/update matches the observed one:

    x̂ = argmin_x  D(∇θ L(f_θ(x), ŷ), G_obs) + α_TV·TV(x) + α_BN·R_BN(x)

with D one of :mod:`.objectives` (L2 of Zhu et al. 2019; cosine of Geiping et al.
2020 eq. 4; per-tensor cosine with ℓ0 weights of Liu et al. 2024 App. F).  For
an update observation the client's k SGD steps are simulated differentiably
(Geiping et al. 2020, Sec. 5).  Optimisers: Adam on the signed gradient with
the box constraint enforced after every step (Geiping et al.), L-BFGS (Zhu et
al.), or plain SGD; step decay ×0.1 at 3/8, 5/8, 7/8 of the run; several
restarts keeping the best final match, optionally run as one batched
computation with ``torch.func.vmap``.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from ..errors import ConfigError, expect
from ..losses import get_loss
from ..threat import Observation
from .objectives import DISTANCES, GradientDistance, bn_statistics, layer_weights, total_variation

OPTIMIZERS = ("adam", "lbfgs", "sgd")
STEP_UNITS = ("data", "normalised")
SCHEDULES = ("multistep", "cosine", "none")
INITS = ("gaussian", "uniform", "grey", "randn")


@dataclass
class MatchingSettings:
    """Options of a gradient-matching attack (every field is an attack option)."""

    iterations: int = 4800
    distance: str = "cosine"
    weights: str = "equal"
    tv: float = 0.0
    bn: float = 0.0
    optimizer: str = "adam"
    lr: float = 0.1
    step_unit: str = "data"
    signed: bool = True
    schedule: str = "multistep"
    restarts: int = 1
    batched_restarts: bool = False
    init: str = "gaussian"
    init_std: float = 1.0
    box: bool = True
    soft_labels: bool = False
    lbfgs_max_iter: int = 20
    trace_every: int = 50

    def check(self) -> None:
        expect(self.iterations >= 1, f"expected iterations ≥ 1, got {self.iterations}")
        expect(self.restarts >= 1, f"expected restarts ≥ 1, got {self.restarts}")
        expect(self.lr > 0, f"expected lr > 0, got {self.lr}")
        expect(self.tv >= 0 and self.bn >= 0, f"expected tv, bn ≥ 0, got tv={self.tv}, bn={self.bn}")
        expect(self.init_std > 0, f"expected init_std > 0, got {self.init_std} (option init_std)")
        expect(self.trace_every >= 1, f"expected trace_every ≥ 1, got {self.trace_every}")
        for name, value, allowed in (("distance", self.distance, DISTANCES), ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("schedule", self.schedule, SCHEDULES), ("init", self.init, INITS),
                                     ("step_unit", self.step_unit, STEP_UNITS)):
            expect(value in allowed, f"expected {name} in {allowed}, got {value!r} (option {name})")
        expect(not (self.batched_restarts and self.optimizer == "lbfgs"),
               "batched_restarts works with adam or sgd, not lbfgs (option batched_restarts)")


@dataclass
class MatchResult:
    images: torch.Tensor
    labels: torch.Tensor
    trace: dict


def initial_images(shape: Sequence[int], kind: str, data_range: tuple[float, float], *,
                   generator: torch.Generator, device, dtype, std: float = 1.0) -> torch.Tensor:
    """Starting images: ``gaussian`` (box centre + ``std``·N(0, 1) in normalised units, i.e. times a
    quarter of the box width — N(0, 1) of normalised data, as Geiping et al. start), ``uniform`` in
    the box, ``grey`` (box centre), ``randn`` (N(0, 1) in the data's units, as DLG)."""
    lo, hi = data_range
    if kind == "randn":
        x = torch.randn(tuple(shape), generator=generator)
    elif kind == "gaussian":
        x = (lo + hi) / 2 + std * (hi - lo) / 4 * torch.randn(tuple(shape), generator=generator)
    elif kind == "uniform":
        x = lo + (hi - lo) * torch.rand(tuple(shape), generator=generator)
    else:
        x = torch.full(tuple(shape), (lo + hi) / 2)
    return x.to(device=device, dtype=dtype)


def step_schedule(opt: torch.optim.Optimizer, kind: str, iterations: int):
    """The learning-rate schedule ``kind`` (multistep ×0.1 at 3/8, 5/8, 7/8; cosine; none → None)."""
    if kind == "multistep":
        marks = sorted({max(1, int(iterations * f)) for f in (3 / 8, 5 / 8, 7 / 8)})
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=marks, gamma=0.1)
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iterations)
    return None


class GradientMatcher:
    """Simulates the client's shared quantity for candidate inputs and scores it against the observation."""

    def __init__(self, obs: Observation, settings: MatchingSettings) -> None:
        settings.check()
        self.obs, self.s = obs, settings
        self.model = copy.deepcopy(obs.model)
        self.model.train(obs.train_mode)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.names = list(obs.param_names)
        base = obs.params()
        self.params = {n: base[n].clone().requires_grad_(True) for n in self.names}
        self.loss_fn = get_loss(obs.loss)
        weights = layer_weights(settings.weights, [base[n] for n in self.names])
        self.distance = GradientDistance(obs.shared, kind=settings.distance, weights=weights)
        self.use_bn = settings.bn > 0
        if self.use_bn:
            expect(obs.bn_stats is not None,
                   "option bn > 0 needs the batch-norm statistics: observe(..., train=True, bn_stats=True)")
        self._bn_layers = [m for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self._bn_seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.use_bn:
            for m in self._bn_layers:
                m.register_forward_hook(self._record_bn)
        if obs.train_mode:
            for m in self._bn_layers:  # no running-stat side effects on the attacker's copy
                m.track_running_stats = False
                m.running_mean = m.running_var = None

    def _record_bn(self, module, inputs, _output) -> None:
        (inp,) = inputs
        dims = [0] + list(range(2, inp.dim()))
        self._bn_seen.append((inp.mean(dims), inp.var(dims, unbiased=False)))

    @property
    def lr(self) -> float:
        """The step size in the data's units: ``lr`` itself, or with ``step_unit="normalised"`` ``lr`` times
        a quarter of the data box — the standard deviation of normalised data that Geiping et al. optimise
        in (their lr 0.1 moves a CIFAR pixel by 0.1·σ ≈ 0.025, not 0.1), the scale ``init="gaussian"`` uses."""
        if self.s.step_unit == "normalised":
            lo, hi = self.obs.data_range
            return self.s.lr * (hi - lo) / 4
        return self.s.lr

    # -- the simulated client -------------------------------------------------------------
    def forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, params, (x,), strict=False)

    def shared_of(self, x: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
        """The gradient (or local update) the client would share for inputs ``x`` and targets ``target``."""
        obs = self.obs
        if obs.kind == "gradient":
            loss = self.loss_fn(self.forward(self.params, x), target)
            return list(torch.autograd.grad(loss, list(self.params.values()), create_graph=True))
        current = dict(self.params)
        for _ in range(obs.local_steps):
            loss = self.loss_fn(self.forward(current, x), target)
            grads = torch.autograd.grad(loss, list(current.values()), create_graph=True)
            current = {n: p - obs.local_lr * g for (n, p), g in zip(current.items(), grads)}
        return [current[n] - self.params[n] for n in self.names]

    def objective(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(total loss, gradient-match term) for candidate ``x``."""
        self._bn_seen.clear()
        match = self.distance(self.shared_of(x, target))
        total = match
        if self.s.tv:
            total = total + self.s.tv * total_variation(x)
        if self.use_bn:
            total = total + self.s.bn * bn_statistics(self._bn_seen[: len(self._bn_layers)], self.obs.bn_stats)
        return total, match

    # -- batched restarts (torch.func) -----------------------------------------------------
    def _batched_objective(self, xs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        expect(self.obs.kind == "gradient" and not self.use_bn,
               "batched_restarts supports gradient observations without the BN prior")
        params = {n: p.detach() for n, p in self.params.items()}

        def one(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            grads = torch.func.grad(lambda p: self.loss_fn(self.forward(p, x), target))(params)
            match = self.distance([grads[n] for n in self.names])
            total = match + self.s.tv * total_variation(x) if self.s.tv else match
            return total, match

        def summed(xs_):
            totals, matches = torch.func.vmap(one)(xs_)
            return totals.sum(), matches

        grad, matches = torch.func.grad(summed, has_aux=True)(xs)
        return grad, matches

    # -- optimisation ----------------------------------------------------------------------
    def targets(self, labels: torch.Tensor, label_logits: torch.Tensor | None) -> torch.Tensor:
        return torch.softmax(label_logits, dim=-1) if label_logits is not None else labels

    def _clamp(self, x: torch.Tensor) -> None:
        if self.s.box:
            with torch.no_grad():
                x.clamp_(*self.obs.data_range)

    def run(self, labels: torch.Tensor | None, *, seed: int = 0, init: torch.Tensor | None = None,
            callback: Callable[[int, torch.Tensor], None] | None = None,
            progress: Callable[[int, int, float], None] | None = None) -> MatchResult:
        """Optimise; ``labels`` are the class indices per slot (ignored with soft labels)."""
        s, obs = self.s, self.obs
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        shape = (obs.batch_size, *obs.input_shape)
        if labels is None and not s.soft_labels:
            raise ConfigError("labels are needed unless soft_labels=True")
        if init is not None:
            expect(tuple(init.shape) == shape, f"expected init of shape {shape}, got {tuple(init.shape)}")
        start = time.perf_counter()
        if s.batched_restarts and s.restarts > 1 and not s.soft_labels:
            result = self._run_batched(labels, gen, shape, init, callback, progress)
        else:
            result = self._run_sequential(labels, gen, shape, init, callback, progress)
        result.trace["seconds"] = time.perf_counter() - start
        return result

    def _start(self, gen, shape, init) -> torch.Tensor:
        if init is not None:
            return init.detach().clone().to(self.obs.device, self.obs.dtype)
        return initial_images(shape, self.s.init, self.obs.data_range, generator=gen,
                              device=self.obs.device, dtype=self.obs.dtype, std=self.s.init_std)

    def _run_sequential(self, labels, gen, shape, init, callback, progress) -> MatchResult:
        s, obs = self.s, self.obs
        total_steps = s.iterations * s.restarts
        best = (math.inf, torch.empty(0), torch.empty(0))
        history: list[list[float]] = []
        finals: list[float] = []
        for r in range(s.restarts):
            x = self._start(gen, shape, init if r == 0 else None).requires_grad_(True)
            variables = [x]
            label_logits = None
            if s.soft_labels:
                label_logits = torch.randn((obs.batch_size, obs.num_classes), generator=gen).to(
                    obs.device, obs.dtype).requires_grad_(True)
                variables.append(label_logits)
            curve: list[float] = []
            if s.optimizer == "lbfgs":
                opt = torch.optim.LBFGS(variables, lr=self.lr, max_iter=s.lbfgs_max_iter,
                                        line_search_fn="strong_wolfe")
            elif s.optimizer == "adam":
                opt = torch.optim.Adam(variables, lr=self.lr)
            else:
                opt = torch.optim.SGD(variables, lr=self.lr, momentum=0.9)
            sched = step_schedule(opt, s.schedule, s.iterations)
            last_match = math.inf
            for step in range(s.iterations):
                if s.optimizer == "lbfgs":
                    def closure():
                        opt.zero_grad(set_to_none=True)
                        total, _ = self.objective(x, self.targets(labels, label_logits))
                        grads = torch.autograd.grad(total, variables)
                        for v, g in zip(variables, grads):
                            v.grad = g
                        return total
                    opt.step(closure)
                    self._clamp(x)
                    if step % s.trace_every == 0 or step == s.iterations - 1:
                        with torch.enable_grad():
                            _, match = self.objective(x, self.targets(labels, label_logits))
                        last_match = float(match.detach())
                else:
                    total, match = self.objective(x, self.targets(labels, label_logits))
                    grads = torch.autograd.grad(total, variables)
                    for v, g in zip(variables, grads):
                        v.grad = g.sign() if (s.signed and v is x) else g
                    opt.step()
                    self._clamp(x)
                    last_match = float(match.detach()) if (step % s.trace_every == 0 or step == s.iterations - 1) else last_match
                if sched is not None:
                    sched.step()
                if step % s.trace_every == 0 or step == s.iterations - 1:
                    if not math.isfinite(last_match):
                        break
                    curve.append(last_match)
                    if callback is not None:
                        callback(r * s.iterations + step, x.detach())
                    if progress is not None:
                        progress(r * s.iterations + step + 1, total_steps, last_match)
            with torch.enable_grad():
                _, match = self.objective(x, self.targets(labels, label_logits))
            final = float(match.detach())
            finals.append(final)
            history.append(curve)
            final_labels = (label_logits.detach().argmax(-1) if label_logits is not None else labels)
            if r == 0 or (math.isfinite(final) and final < best[0]):
                best = (final, x.detach().clone(), final_labels.detach().clone())
        chosen = finals.index(best[0]) if best[0] in finals else 0
        trace = {"loss": history[chosen],
                 "restart_losses": finals, "iterations": s.iterations, "restarts": s.restarts,
                 "trace_every": s.trace_every, "final_match": best[0]}
        return MatchResult(images=best[1], labels=best[2], trace=trace)

    def _run_batched(self, labels, gen, shape, init, callback, progress) -> MatchResult:
        s = self.s
        starts = [self._start(gen, shape, init if r == 0 else None) for r in range(s.restarts)]
        xs = torch.stack(starts).requires_grad_(True)
        opt = (torch.optim.Adam([xs], lr=self.lr) if s.optimizer == "adam"
               else torch.optim.SGD([xs], lr=self.lr, momentum=0.9))
        sched = step_schedule(opt, s.schedule, s.iterations)
        curve: list[list[float]] = []
        matches = None
        for step in range(s.iterations):
            grad, matches = self._batched_objective(xs.detach(), labels)
            xs.grad = grad.sign() if s.signed else grad
            opt.step()
            self._clamp(xs)
            if sched is not None:
                sched.step()
            if step % s.trace_every == 0 or step == s.iterations - 1:
                values = matches.detach().tolist()
                curve.append(values)
                best_r = int(torch.tensor(values).argmin())
                if callback is not None:
                    callback(step, xs[best_r].detach())
                if progress is not None:
                    progress(step + 1, s.iterations, min(values))
        _, matches = self._batched_objective(xs.detach(), labels)
        finals = matches.detach().tolist()
        best_r = int(torch.tensor(finals).argmin())
        trace = {"loss": [c[best_r] for c in curve], "restart_losses": finals, "iterations": s.iterations,
                 "restarts": s.restarts, "trace_every": s.trace_every, "final_match": finals[best_r],
                 "batched": True}
        return MatchResult(images=xs[best_r].detach().clone(), labels=labels, trace=trace)


__all__ = ["MatchingSettings", "GradientMatcher", "MatchResult", "initial_images", "step_schedule", "OPTIMIZERS",
           "SCHEDULES", "INITS",
           "STEP_UNITS"]
