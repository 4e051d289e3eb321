"""The client's local SGD with leakbench's in-step defenses (flwr-free).

FedAvg's local training (McMahan et al. 2017) as :meth:`leakbench.threat.Observation.from_update` describes it:
``steps`` SGD steps of size ``lr`` on the whole local batch, or ``epochs`` passes over it in
consecutive minibatches of ``minibatch`` (unshuffled, the order ``from_update`` assumes without
``order=``, so the update-matching attacks simulate these exact steps; ``shuffle=True`` draws a seeded
permutation per epoch, :func:`leakbench.defenses.pipeline.minibatches`).  Each step's
gradient is the mean-loss gradient, or the replacement of an in-step defense — DP-SGD's clipped and
noised per-sample sum (Abadi et al. 2016, Alg. 1; :class:`leakbench.defenses.DPSGD`) — with dropout
active around the forward passes: the defenses that act *inside* a step and so cannot be added by a
mod around the client's train function.  :func:`~.mods.defense_mod` asks for them through the train
config (:func:`in_step_defense`) and checks the reply's metrics say they ran.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

import torch
from torch import nn

from ...errors import ConfigError
from .keys import FitKeys

#: reply-metric keys :func:`local_train` fills and :func:`~.mods.defense_mod` reads.
STEPS_KEY = "leakbench-steps"
RATE_KEY = "leakbench-sample-rate"


@dataclass
class LocalResult:
    """What :func:`local_train` ran: the steps, the sampling rate per step and the last step's loss."""

    steps: int
    sample_rate: float
    loss: float
    defense: str

    def metrics(self) -> dict[str, float | int]:
        """Reply metrics telling :func:`~.mods.defense_mod` the in-step defense ran (and for its accounting)."""
        return {STEPS_KEY: self.steps, RATE_KEY: self.sample_rate}


def in_step_defense(config: Mapping[str, Any], keys: FitKeys = FitKeys()) -> str | None:
    """The in-step defense :func:`~.mods.defense_mod` asked for in the train ``config`` (None when none)."""
    value = config.get(keys.defense) if hasattr(config, "get") else None
    return str(value) if value else None


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, lr: float, steps: int | None = None,
                epochs: int | None = None, minibatch: int | None = None, defense: str | None = None,
                shuffle: bool = False, loss: str = "ce", seed: int = 0) -> LocalResult:
    """Train ``model`` in place on ``(x, y)``: ``steps`` full-batch steps, or ``epochs`` of ``minibatch``.

    ``defense``: in-step defenses only (``dpsgd:C,σ``, ``dropout:p``); defenses of the update itself
    (prune, clip, noise, ...) belong to :func:`~.mods.defense_mod`.  ``seed`` drives the DP noise, the
    dropout masks and, with ``shuffle``, the minibatch order.
    """
    from ...defenses import parse, parts_of
    from ...defenses.pipeline import mean_gradient, minibatches, plan_for
    from ...losses import get_loss

    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"expected lr > 0, got {lr!r} (argument lr)")
    n = int(x.shape[0])
    if n < 1 or y.shape[0] != n:
        raise ConfigError(f"expected a batch x with one label per sample, got x {tuple(x.shape)} and y "
                          f"{tuple(y.shape)} (arguments x, y)")
    if (steps is None) == (epochs is None):
        raise ConfigError("expected either steps (full-batch SGD steps) or epochs (passes in minibatches), not "
                          f"both or neither; got steps={steps!r}, epochs={epochs!r}")
    count = steps if steps is not None else epochs
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"expected steps or epochs ≥ 1, got {count!r}")
    mb = n if minibatch is None or steps is not None else int(minibatch)
    if not 1 <= mb <= n:
        raise ConfigError(f"expected 1 ≤ minibatch ≤ {n} (the local batch), got {minibatch!r} (argument minibatch)")
    outside = [p.spec for p in parts_of(parse(defense)) if p.stage not in ("step", "model") and p.spec != "none"]
    if outside:
        raise ConfigError(f"local_train runs in-step defenses (dpsgd, dropout); {outside} act on the update or "
                          "the round: give them to defense_mod (argument defense)")
    plan = plan_for(defense)
    loss_fn = get_loss(loss)
    gradient = plan.gradient or mean_gradient
    param = next(model.parameters())
    gen = torch.Generator(device=param.device).manual_seed(int(seed))
    order_gen = torch.Generator().manual_seed(int(seed))
    x, y = x.to(param.device, param.dtype), y.to(param.device)
    params = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    if steps is not None:
        batches = [torch.arange(n)] * steps
    else:
        batches = minibatches(n, epochs, mb, shuffle=shuffle, generator=order_gen)
    with contextlib.ExitStack() as stack:
        for wrapper in plan.wrappers:
            stack.enter_context(wrapper(model, gen))
        for idx in batches:
            idx = idx.to(param.device)
            grads = gradient(model, params, x[idx], y[idx], loss_fn, gen)
            params = {name: (p - lr * g).detach() for (name, p), g in zip(params.items(), grads)}
    with torch.no_grad():
        last = float(loss_fn(torch.func.functional_call(model, params, (x,), strict=False), y))
        for name, p in model.named_parameters():
            if name in params:
                p.copy_(params[name])
    return LocalResult(steps=len(batches), sample_rate=mb / n, loss=last, defense=parse(defense).spec)


__all__ = ["local_train", "in_step_defense", "LocalResult", "STEPS_KEY", "RATE_KEY"]
