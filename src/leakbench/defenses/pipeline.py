"""The client's round with its defenses: :func:`share` computes what the server receives.

One code path serves :func:`leakbench.observe` (one round on the attacked batch) and
:func:`leakbench.evaluation.training.utility.train_model` (one round per training step):

1. every client computes, with the model-stage wrappers active (dropout), either one
   step's gradient (FedSGD) or θ_k − θ_0 after its local epochs (FedAvg, ``local`` defense:
   k epochs of SGD over its n samples, in minibatches of b — :func:`minibatches` — or one
   full-batch step per epoch), each step's gradient being the mean-loss gradient of its
   minibatch or the step-stage replacement (DP-SGD, Abadi et al. 2016);
2. the shared-stage defenses written before ``secagg`` act on each client's output;
3. with ``secagg:L`` the server receives the aggregate of L clients (the target batch and
   L − 1 batches of the same size drawn from ``population``), Liu et al. 2024 Sec. 3.3;
4. the shared-stage defenses written after ``secagg`` act on the aggregate.

Everything is computed with :func:`torch.func.functional_call` on a parameter dict, so the
module passed in is never mutated (apart from batch-norm running statistics in training
mode, as in any client step).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call

from ..errors import ConfigError
from ..models.loki import client_parameters
from .base import ClientPlan, Defense, client_scope, parse, parts_of

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Shared:
    """What the server receives from one round, and what it knows about how it was made."""

    tensors: list[torch.Tensor]
    kind: str  # "gradient" or "update"
    local_steps: int
    local_lr: float
    x: torch.Tensor  # the batch behind ``tensors`` (the union of the clients' batches under secagg)
    y: torch.Tensor
    clients: int = 1
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the target client's minibatches, step by step (indices into its batch); None for full-batch steps
    batches: list[list[int]] | None = None
    shuffled: bool = False


def mean_gradient(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                  loss_fn: LossFn, generator: torch.Generator) -> list[torch.Tensor]:
    """∇θ of the mean loss over the batch (the plain client gradient), in ``params`` order."""
    live = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    loss = loss_fn(functional_call(model, live, (x,), strict=False), y)
    return [g.detach() for g in torch.autograd.grad(loss, list(live.values()))]


def minibatches(n: int, epochs: int, batch: int | None, *, shuffle: bool = False,
                generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The index sets of a client's local steps: ``epochs`` passes over ``n`` samples, each split into
    consecutive minibatches of ``batch`` (the last one smaller, as ``DataLoader(drop_last=False)``) after a
    fresh permutation when ``shuffle``; ``batch`` None (or ≥ n) is one full-batch step per epoch."""
    if n < 1 or epochs < 1:
        raise ConfigError(f"expected n ≥ 1 samples and epochs ≥ 1, got n={n}, epochs={epochs}")
    if batch is not None and batch < 1:
        raise ConfigError(f"expected a minibatch size ≥ 1, got {batch}")
    size = n if batch is None else min(batch, n)
    steps: list[torch.Tensor] = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator) if shuffle and size < n else torch.arange(n)
        steps.extend(order[i:i + size] for i in range(0, n, size))
    return steps


def plan_for(defense: str | Defense | None, *, local_steps: int = 0, local_lr: float = 0.1,
             local_batch: int | None = None, local_shuffle: bool = False, population: Any = None) -> ClientPlan:
    """The :class:`ClientPlan` of ``defense`` for a round with ``local_steps`` given by the caller."""
    plan = ClientPlan(population=population)
    seen_aggregate = False
    for part in parts_of(parse(defense)):
        spec = part.spec
        if spec != "none":
            key = part.name or spec
            repeats = sum(k.split("#")[0] == key for k in plan.info)
            plan.info[f"{key}#{repeats + 1}" if repeats else key] = {"spec": spec, **part.describe()}
        if part.stage == "shared":
            (plan.after if seen_aggregate else plan.before).append(part)
            continue
        if part.stage == "aggregate":
            if seen_aggregate:
                raise ConfigError(f"expected at most one aggregation defense, got a second {part.spec!r}")
            seen_aggregate = True
        part.configure(plan)
    if plan.local_steps is not None and local_steps:
        given = plan.info.get("local", {}).get("spec", "local")
        raise ConfigError(f"got local_steps={local_steps} and the defense {given!r} — give the local steps once: "
                          "either observe(local_steps=, local_lr=) or the local:k,lr defense")
    if local_batch is not None and not local_steps:
        raise ConfigError(f"got local_batch={local_batch} without local epochs: pass local_steps=E (epochs) too, "
                          "or the local:E,lr,b defense")
    if plan.local_steps is None:
        plan.local_steps, plan.local_lr = int(local_steps), float(local_lr) if local_steps else 0.0
        plan.local_batch, plan.local_shuffle = local_batch, bool(local_shuffle)
    return plan


def extend_model(defense: str | Defense | None, model: nn.Module, *, seed: int = 0) -> nn.Module:
    """``model`` as the defense's round trains it: a defense that adds layers (PRECODE's bottleneck) inserts them in
    place, initialised from a generator seeded by ``seed``; every other defense leaves the model as it is."""
    return parse(defense).extend(model, torch.Generator(device="cpu").manual_seed(int(seed)))


def client_round(plan: ClientPlan, model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                 y: torch.Tensor, loss_fn: LossFn, generator: torch.Generator,
                 schedule: list[torch.Tensor] | None = None, *, client: int = 0) -> list[torch.Tensor]:
    """One client's shared tensors: its gradient or update, then the per-client shared-stage defenses.

    With local epochs, ``schedule`` (filled in when given as an empty list) receives the minibatch index
    sets the client stepped on, in order.  ``client``: its index among the aggregated clients (0: the attacked
    one), which per-client defense state is kept under (:func:`~.base.current_client`)."""
    gradient = plan.gradient or mean_gradient
    with contextlib.ExitStack() as stack:
        for wrapper in plan.wrappers:
            stack.enter_context(wrapper(model, generator))
        if plan.local_steps == 0:
            shared = gradient(model, params, x, y, loss_fn, generator)
        else:
            steps = minibatches(int(x.shape[0]), plan.local_steps, plan.local_batch, shuffle=plan.local_shuffle,
                                generator=generator)
            current = dict(params)
            for idx in steps:
                xb, yb = (x, y) if idx.numel() == x.shape[0] and plan.local_batch is None else \
                    (x[idx.to(x.device)], y[idx.to(y.device)])
                grads = gradient(model, current, xb, yb, loss_fn, generator)
                current = {n: (p - plan.local_lr * g).detach() for (n, p), g in zip(current.items(), grads)}
            shared = [current[n] - params[n] for n in params]
            if schedule is not None:
                schedule.extend(steps)
    with client_scope(client):
        for d in plan.before:
            shared = d.apply_gradients(shared, generator=generator)
    return shared


def _population_tensors(population: Any, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(population, "images") and hasattr(population, "labels"):
        images, labels = population.images, population.labels
    elif hasattr(population, "ids") and hasattr(population, "batch"):  # a TextDataset: ids B × T and their targets
        images, labels = population.batch(indices=list(range(len(population))))
    elif isinstance(population, (tuple, list)) and len(population) == 2:
        images, labels = population
    else:
        raise ConfigError("expected population as an ImageDataset or a TextDataset (leakbench.load) or a pair "
                          "(inputs, labels), "
                          f"got {type(population).__name__} (argument population)")
    if not (isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor)
            and images.shape[0] == labels.shape[0]):
        raise ConfigError("expected population images and labels as tensors with one label per image "
                          "(argument population)")
    return images, labels


def other_batches(population: Any, count: int, size: int, *, like_x: torch.Tensor, like_y: torch.Tensor,
                  generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` disjoint batches of ``size`` samples drawn without replacement from ``population``."""
    images, labels = _population_tensors(population, like_x.device, like_x.dtype)
    if tuple(images.shape[1:]) != tuple(like_x.shape[1:]):
        raise ConfigError(f"expected population samples of shape {tuple(like_x.shape[1:])} like x, "
                          f"got {tuple(images.shape[1:])} (argument population)")
    need = count * size
    if images.shape[0] < need:
        raise ConfigError(f"expected a population of at least {need} samples for {count} other clients of "
                          f"{size} samples each, got {images.shape[0]} (argument population)")
    order = torch.randperm(images.shape[0], generator=generator)[:need].to(images.device)
    xs = images[order].to(like_x.device, like_x.dtype)
    ys = labels[order].to(like_y.device, like_y.dtype)
    return [(xs[i * size:(i + 1) * size], ys[i * size:(i + 1) * size]) for i in range(count)]


def share(defense: str | Defense | None, model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
          y: torch.Tensor, loss_fn: LossFn, *, generator: torch.Generator, local_steps: int = 0,
          local_lr: float = 0.1, local_batch: int | None = None, local_shuffle: bool = False,
          population: Any = None) -> Shared:
    """What the server receives when clients train ``model`` at ``params`` on ``(x, y)`` under ``defense``.

    ``params`` maps the names of the trainable parameters to their values θ_0 (the shared
    tensors follow its order).  ``generator`` drives every random choice (noise, masks, the
    other clients' batches).  ``local_steps`` are epochs of ``local_batch`` minibatches (None: one
    full-batch step per epoch), as the ``local:k,lr,b,shuffle`` defense gives them.
    """
    plan = plan_for(defense, local_steps=local_steps, local_lr=local_lr, local_batch=local_batch,
                    local_shuffle=local_shuffle, population=population)
    schedule: list[torch.Tensor] = []
    # a server may send each client its own model (LOKI): client l starts from client_parameters(model, params, l)
    outputs = [client_round(plan, model, client_parameters(model, params, 0), x, y, loss_fn, generator, schedule)]
    xs, ys = [x], [y]
    if plan.clients > 1:
        if plan.population is None:
            raise ConfigError(
                f"defense secagg:{plan.clients} needs the other clients' data: pass population=<ImageDataset> "
                f"(e.g. observe(..., defense='secagg:{plan.clients}', population=data)); the other "
                f"{plan.clients - 1} clients' batches of {x.shape[0]} samples are drawn from it")
        for index, (xo, yo) in enumerate(other_batches(plan.population, plan.clients - 1, int(x.shape[0]), like_x=x,
                                                       like_y=y, generator=generator), start=1):
            outputs.append(client_round(plan, model, client_parameters(model, params, index), xo, yo, loss_fn,
                                        generator, client=index))
            xs.append(xo)
            ys.append(yo)
        sizes = torch.tensor([float(b.shape[0]) for b in xs])
        # Liu et al. Sec. 3.3: G̃ = (1/B) Σ_l B_l G_l (the securely summed Σ_l B_l G_l over the total count);
        # reduce="sum" gives the plain sum Σ_l G_l of the clients' outputs.
        weights = (sizes / sizes.sum()).tolist() if plan.reduce == "mean" else [1.0] * len(outputs)
        shared = [sum(w * out[i] for w, out in zip(weights, outputs)) for i in range(len(outputs[0]))]
    else:
        shared = outputs[0]
    for d in plan.after:
        shared = d.apply_gradients(shared, generator=generator)
    minibatched = plan.local_steps > 0 and plan.local_batch is not None
    return Shared(
        tensors=[s.detach() for s in shared],
        kind="gradient" if plan.local_steps == 0 else "update",
        local_steps=max(len(schedule), 1) if plan.local_steps else 1,
        local_lr=plan.local_lr,
        x=torch.cat(xs) if len(xs) > 1 else x,
        y=torch.cat(ys) if len(ys) > 1 else y,
        clients=plan.clients,
        info=plan.info,
        batches=[idx.tolist() for idx in schedule] if minibatched else None,
        shuffled=minibatched and plan.local_shuffle,
    )


__all__ = ["Shared", "share", "extend_model", "plan_for", "client_round", "mean_gradient", "other_batches", "minibatches"]
