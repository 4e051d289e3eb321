"""Defenses inside the client's computation: dpsgd, local, secagg, dropout.

Liu et al. (2024), Sec. 3.1–3.4 and 5.1:

- ``dpsgd:C,σ[,q,T,δ,accountant]`` — DP-SGD (Abadi et al. 2016, Algorithm 1): per-sample
  gradients g_i (``torch.func.vmap(grad(·))``), each clipped to g_i / max(1, ‖g_i‖/C),
  summed, N(0, σ²C² I) added to the sum, divided by the batch size B.  ε for δ after T
  steps at sample rate q comes from Opacus's accountant (:mod:`.accounting`).  Liu et al.'s
  Sec. 3.2 writes the clipping on the batch gradient (G/max(1, ‖G‖/C) + ε₀, identical for
  B = 1); we follow DP-SGD as the issue and Abadi et al. define it — ``clip:C+noise:σ``
  gives the batch-level variant of Sec. 3.2.
- ``local:k,lr`` — local aggregation (Sec. 3.1, McMahan et al. 2017): k SGD steps of size
  lr on the client's batch; the server sees θ_k − θ_0 (full-batch steps, as the update
  observation of :func:`leakbench.observe` and the attacks' simulation).
- ``secagg:L[,mean|sum]`` — secure aggregation (Sec. 3.3, Bonawitz et al. 2017): the server
  sees only G̃ = (1/B) Σ_l B_l G_l over L clients (``sum``: Σ_l G_l); the target client's
  batch and L − 1 batches of the same size drawn from a population (``population=``).
- ``dropout:p`` — dropout (Sec. 3.4, Srivastava et al. 2014): during the client step every
  hidden unit (the input of every Linear/Conv layer after the first) is zeroed with
  probability p and the kept ones scaled by 1/(1 − p); fresh masks for every forward pass.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from ..errors import ConfigError
from ..models import weighted_layers
from .accounting import ACCOUNTANTS
from .accounting import epsilon as _epsilon
from .base import ClientPlan, Defense, check_choice, check_fraction, check_positive, register
from .gradient import randn_like

REDUCTIONS = ("mean", "sum")


# --------------------------------------------------------------------------- DP-SGD


def per_sample_gradients(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                         loss_fn) -> list[torch.Tensor]:
    """∇θ ℓ(f(x_i), y_i) for every sample, one (B, *shape) tensor per parameter (``vmap(grad)``)."""
    if model.training and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ConfigError("per-sample gradients (dpsgd) are undefined for batch-norm in training mode, which "
                          "mixes the samples of a batch: use train=False or a model without BatchNorm "
                          "(Opacus rejects it too)")
    detached = {n: p.detach() for n, p in params.items()}

    def one(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi.unsqueeze(0),), strict=False), yi.unsqueeze(0))

    try:
        grads = vmap(grad(one), in_dims=(None, 0, 0), randomness="different")(detached, x, y)
    except RuntimeError as err:  # data-dependent control flow vmap cannot map (a transformers attention mask):
        if "vmap" not in str(err):  # the same gradients, one sample after the other
            raise
        rows = [grad(one)(detached, x[i], y[i]) for i in range(x.shape[0])]
        grads = {n: torch.stack([r[n] for r in rows]) for n in params}
    return [grads[n] for n in params]


def clip_per_sample(per_sample: list[torch.Tensor], max_norm: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(Σ_i g_i / max(1, ‖g_i‖/C) per parameter, the per-sample norms ‖g_i‖ over all parameters)."""
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample))
    factors = torch.clamp(max_norm / norms, max=1.0)  # ‖g_i‖ = 0 gives inf → 1
    return [torch.einsum("b,b...->...", factors, g) for g in per_sample], norms


def dp_gradient(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, loss_fn, *,
                max_norm: float, noise_multiplier: float, generator: torch.Generator) -> list[torch.Tensor]:
    """(Σ_i clip_C(g_i) + N(0, σ²C² I)) / B: one DP-SGD step's gradient (Abadi et al. 2016, Alg. 1)."""
    summed, _ = clip_per_sample(per_sample_gradients(model, params, x, y, loss_fn), max_norm)
    std = noise_multiplier * max_norm
    batch = x.shape[0]
    return [(s + std * randn_like(s, generator)) / batch if std else s / batch for s in summed]


@register("dpsgd", help="DP-SGD: per-sample clipping to C, N(0, σ²C²) on the sum "
                        "(dpsgd:C,σ[,q,steps,δ,accountant])")
class DPSGD(Defense):
    """Per-sample clipping and Gaussian noise in every client step; ε from Opacus's accountant.

    ``sample_rate`` q, ``steps`` T and ``delta`` δ only enter :meth:`epsilon` (the defaults
    describe one observed step of a batch drawn at rate 0.01); ``accountant`` is ``rdp``
    (default), ``prv`` or ``gdp``.
    """

    stage = "step"

    def __init__(self, C: float, sigma: float, sample_rate: float = 0.01, steps: int = 1, delta: float = 1e-5,
                 accountant: str = "rdp") -> None:
        self.C = check_positive(C, "the per-sample norm bound C", "dpsgd")
        self.sigma = check_positive(sigma, "the noise multiplier σ", "dpsgd", allow_zero=True)
        if not (isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1):
            raise ConfigError(f"expected sample_rate in (0, 1] for defense 'dpsgd', got {sample_rate!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"expected steps ≥ 1 for defense 'dpsgd', got {steps!r}")
        if not (isinstance(delta, (int, float)) and 0 < delta < 1):
            raise ConfigError(f"expected delta in (0, 1) for defense 'dpsgd', got {delta!r}")
        self.sample_rate, self.steps, self.delta = float(sample_rate), steps, float(delta)
        self.accountant = check_choice(accountant, "accountant", "dpsgd", ACCOUNTANTS)

    def gradient(self, model, params, x, y, loss_fn, generator) -> list[torch.Tensor]:
        return dp_gradient(model, params, x, y, loss_fn, max_norm=self.C, noise_multiplier=self.sigma,
                           generator=generator)

    def configure(self, plan: ClientPlan) -> None:
        if plan.gradient is not None:
            raise ConfigError(f"expected one defense that replaces the client's gradient, got {plan.gradient_owner!r} "
                              f"and {self.spec!r}")
        plan.gradient, plan.gradient_owner = self.gradient, self.spec

    def describe(self) -> dict[str, Any]:
        return {"max_norm": self.C, "noise_multiplier": self.sigma, "sum_noise_std": self.sigma * self.C}

    def epsilon(self, *, sample_rate: float | None = None, steps: int | None = None, delta: float | None = None,
                accountant: str | None = None) -> float:
        """ε(δ) after ``steps`` at ``sample_rate`` (the spec's values unless given), from Opacus."""
        return _epsilon(self.sigma, self.sample_rate if sample_rate is None else sample_rate,
                        self.steps if steps is None else steps, delta=self.delta if delta is None else delta,
                        accountant=self.accountant if accountant is None else accountant)


# --------------------------------------------------------------------------- local aggregation


@register("local", help="local aggregation (FedAvg): k epochs of SGD of size lr over the client's n samples, in "
                        "minibatches of b (0: the whole batch, k steps), reshuffled per epoch with shuffle; the "
                        "server sees θ_k − θ_0 (local:k,lr[,b[,shuffle]])")
class LocalSteps(Defense):
    """FedAvg's client round (McMahan et al. 2017; Dimitrov et al. 2022's setting): ``k`` epochs over the
    client's n samples, each epoch ⌈n/b⌉ SGD steps on minibatches of ``b`` (the last one smaller, as a
    data loader without ``drop_last``), in the samples' order or reshuffled every epoch (``shuffle``).
    ``b = 0`` (or b ≥ n) is the whole batch: k full-batch steps.  The server knows k, lr and b (the fit
    configuration); a shuffled order is the client's own."""

    stage = "round"

    def __init__(self, k: int, lr: float = 0.1, b: int = 0, shuffle: bool = False) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"expected the number of local steps k ≥ 1 (an int; with b, the number of epochs) for "
                              f"defense 'local', got {k!r}")
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ConfigError(f"expected the minibatch size b ≥ 1 (or 0 for the whole batch) for defense 'local', "
                              f"got {b!r}")
        self.k = k
        self.lr = check_positive(lr, "the local learning rate lr", "local")
        self.b = b
        self.shuffle = bool(shuffle)

    def configure(self, plan: ClientPlan) -> None:
        if plan.local_steps is not None:
            raise ConfigError(f"expected one local-aggregation defense, got a second {self.spec!r}")
        plan.local_steps, plan.local_lr = self.k, self.lr
        plan.local_batch, plan.local_shuffle = (self.b or None), self.shuffle

    def describe(self) -> dict[str, Any]:
        if not self.b:
            return {"local_steps": self.k, "local_lr": self.lr}
        return {"local_epochs": self.k, "local_lr": self.lr, "local_batch": self.b, "local_shuffle": self.shuffle}


# --------------------------------------------------------------------------- secure aggregation


@register("secagg", help="secure aggregation: the server sees the sum of L clients' updates (secagg:L[,sum|mean])")
class SecureAggregation(Defense):
    """The other L − 1 clients' batches are drawn from ``population`` (here or ``observe(population=)``).

    ``reduce="sum"`` (the default, as the issue specifies: the server sees the sum of the L updates);
    ``"mean"`` gives Liu et al.'s batch-weighted mean G̃ = (1/B) Σ_l B_l G_l (Sec. 3.3).  The two differ
    by a known positive factor, so scale-invariant attacks (cosine matching) see the same direction.
    """

    stage = "aggregate"

    def __init__(self, L: int, reduce: str = "sum", *, population: Any = None) -> None:
        if isinstance(L, bool) or not isinstance(L, int) or L < 1:
            raise ConfigError(f"expected the number of clients L ≥ 1 (an int) for defense 'secagg', got {L!r}")
        self.L = L
        self.reduce = check_choice(reduce, "reduce", "secagg", REDUCTIONS)
        self.population = population

    def configure(self, plan: ClientPlan) -> None:
        plan.clients, plan.reduce = self.L, self.reduce
        if self.population is not None:
            plan.population = self.population

    def describe(self) -> dict[str, Any]:
        return {"clients": self.L, "reduce": self.reduce}


# --------------------------------------------------------------------------- dropout


def hidden_layers(model: nn.Module) -> list[nn.Module]:
    """The Linear/Conv layers whose input is a hidden representation (all but the first)."""
    return weighted_layers(model)[1:]


@contextlib.contextmanager
def dropout_hooks(model: nn.Module, p: float, generator: torch.Generator):
    """While active, every forward zeroes each hidden unit with probability ``p`` (scaling the rest by 1/(1−p))."""

    def hook(_module, args):
        inp, *rest = args
        keep = torch.rand(inp.shape, generator=generator, device=generator.device) >= p
        return (inp * keep.to(inp) / (1.0 - p), *rest)

    handles = [layer.register_forward_pre_hook(hook) for layer in hidden_layers(model)] if p > 0 else []
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@register("dropout", help="dropout inside the model during the client step (dropout:p)")
class Dropout(Defense):
    stage = "model"

    def __init__(self, p: float) -> None:
        self.p = check_fraction(p, "the drop probability p", "dropout", closed=False)

    def wrap(self, model: nn.Module, generator: torch.Generator):
        if not hidden_layers(model) and self.p > 0:
            raise ConfigError("defense dropout needs a model with a hidden layer (two or more Linear/Conv layers)")
        return dropout_hooks(model, self.p, generator)

    def configure(self, plan: ClientPlan) -> None:
        if plan.wrappers:
            raise ConfigError(f"expected one dropout defense, got a second {self.spec!r}")
        plan.wrappers.append(self.wrap)

    def describe(self) -> dict[str, Any]:
        return {"p": self.p}


__all__ = ["DPSGD", "LocalSteps", "SecureAggregation", "Dropout", "per_sample_gradients", "clip_per_sample",
           "dp_gradient", "dropout_hooks", "hidden_layers", "REDUCTIONS"]
