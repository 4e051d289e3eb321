"""Several training seeds of one (model, defense, batch size) trained together: :func:`train_seeds`.

The k models (one per seed, same architecture) are stacked with ``torch.func.stack_module_state`` and every
step runs ``vmap`` over them (``functional_call``): the plain client gradient is one autograd pass through
the vmapped forward (each seed's loss depends on its own parameters only), DP-SGD's per-sample gradients ``vmap(vmap(grad))`` over seeds and samples, each clipped to C on its
own.  What each seed draws — its data order, its DP noise, its defense's noise or masks — comes from that
seed's own generators in the order :func:`~.utility.train_model` draws them (order ``seed``, defense
``seed + 7919``), so each seed's run equals its sequential run up to float rounding (tested).  The
shared-stage defenses (prune, clip, noise, graddrop, quantize) act on each seed's tensors with its generator;
ε comes from the same Opacus accountant call.

Not stacked (:func:`seeds_refusal` says why; the caller trains those seeds one after the other): dropout (its
masks are drawn inside the forward pass), local steps and secure aggregation (a round of several steps or
several clients), and batch-norm models (running statistics are updated in place).
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from ...data import ImageDataset
from ...defenses import DPSGD, Defense, parts_of
from ...defenses.gradient import randn_like
from ...defenses.pipeline import plan_for
from ...budget import check_time
from ...errors import ConfigError
from ...losses import get_loss


def seeds_refusal(defense: Defense, model: nn.Module) -> str | None:
    """Why seeds of ``model`` under ``defense`` cannot train stacked (None when they can)."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return "batch-norm running statistics are updated in place: seeds train one after the other"
    plan = plan_for(defense)
    if plan.wrappers:
        return "dropout draws its masks inside the forward pass: seeds train one after the other"
    if plan.local_steps:
        return "local steps run several client steps a round: seeds train one after the other"
    if plan.clients > 1:
        return "secure aggregation draws the other clients' batches: seeds train one after the other"
    if plan.after:
        return "defenses after an aggregation: seeds train one after the other"
    if plan.gradient is not None and not any(isinstance(p, DPSGD) for p in parts_of(defense)):
        return f"{plan.gradient_owner} computes the step's gradient its own way: seeds train one after the other"
    return None


def _stacked_loss_accuracy(model, params, buffers, images, labels, loss_fn, *, chunk: int = 1024):
    """(mean loss, accuracy) per seed, in evaluation mode; images (k, n, ...), labels (k, n)."""
    was = model.training
    model.eval()
    k, n = images.shape[0], images.shape[1]
    total = torch.zeros(k, dtype=torch.float64)
    correct = torch.zeros(k, dtype=torch.long)

    def one(p, b, x, y):
        out = functional_call(model, (p, b), (x,))
        pred = (out.reshape(-1) > 0).long() if out.shape[-1] == 1 else out.argmax(-1)
        return loss_fn(out, y) * out.shape[0], (pred == y).sum()

    with torch.no_grad():
        for i in range(0, n, chunk):
            losses, hits = vmap(one)(params, buffers, images[:, i:i + chunk], labels[:, i:i + chunk])
            total += losses.double().cpu()
            correct += hits.cpu()
    model.train(was)
    return [float(v) / max(n, 1) for v in total], [int(c) / max(n, 1) for c in correct]


def train_seeds(models: Sequence[nn.Module], datas: Sequence[ImageDataset], *, seeds: Sequence[int],
                defense: Defense, epochs: int, batch_size: int, lr: float, device: str | torch.device = "cpu",
                loss: str = "ce") -> list[dict]:
    """Train ``models[t]`` on ``datas[t]`` with ``seeds[t]``'s generators, all together, in place.

    Returns per seed a dict of :class:`~.utility.TrainResult`'s fields (the model written back)."""
    reason = seeds_refusal(defense, models[0])
    if reason:
        raise ConfigError(reason)
    k = len(models)
    n = int(datas[0].images.shape[0])
    if any(int(d.images.shape[0]) != n for d in datas):
        raise ConfigError("stacked seeds need training sets of one size (a split of one dataset)")
    plan = plan_for(defense)
    dp = next((p for p in parts_of(defense) if isinstance(p, DPSGD)), None)
    loss_fn = get_loss(loss)
    for m in models:
        m.to(device)
    named = [name for name, p in models[0].named_parameters() if p.requires_grad]
    params, buffers = stack_module_state(list(models))
    params = {name: params[name].detach() for name in named}
    frozen = {name: v for name, v in stack_module_state(list(models))[0].items() if name not in params}
    buffers = {**buffers, **{name: v.detach() for name, v in frozen.items()}}
    images = torch.stack([d.images for d in datas]).to(device)
    labels = torch.stack([d.labels for d in datas]).to(device)
    order_gens = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
    defense_gens = [torch.Generator(device="cpu").manual_seed(int(s) + 7919) for s in seeds]
    template = models[0]

    def batch_loss(p, b, x, y):
        return loss_fn(functional_call(template, (p, b), (x,)), y)

    def sample_loss(p, b, x, y):
        return loss_fn(functional_call(template, (p, b), (x.unsqueeze(0),)), y.unsqueeze(0))

    def per_batch(p, b, x, y):
        """Each seed's batch gradient: one autograd pass through the stacked forward (measured faster on a CPU
        than ``vmap(grad)``, whose batched convolutions are grouped ones)."""
        live = {name: v.detach().requires_grad_(True) for name, v in p.items()}
        with torch.enable_grad():
            per_seed = vmap(batch_loss, in_dims=(0, 0, 0, 0))(live, b, x, y)
            grads = torch.autograd.grad(per_seed.sum(), [live[name] for name in named])
        return dict(zip(named, grads))

    per_sample = vmap(vmap(grad(sample_loss), in_dims=(None, None, 0, 0)))
    rows = torch.arange(k, device=device)[:, None]
    start = time.perf_counter()
    losses: list[list[float]] = [[] for _ in range(k)]
    steps = seen = 0
    rounds = math.ceil(epochs * math.ceil(n / batch_size))
    template.train()
    for _ in range(epochs):
        orders = torch.stack([torch.randperm(n, generator=g) for g in order_gens]).to(device)
        for i in range(0, n, batch_size):
            if steps >= rounds:
                break
            check_time(f"training {k} seeds ({steps:,} of {rounds:,} steps)")
            idx = orders[:, i:i + batch_size]
            x, y = images[rows, idx], labels[rows, idx]
            seen += int(idx.shape[1])
            if dp is None:
                g = per_batch(params, buffers, x, y)
                shared = [g[name] for name in named]
            else:
                g = per_sample(params, buffers, x, y)
                flat = [g[name] for name in named]
                norms = torch.sqrt(sum(t.flatten(2).pow(2).sum(2) for t in flat))
                factors = torch.clamp(dp.C / norms, max=1.0)
                summed = [torch.einsum("kb,kb...->k...", factors, t) for t in flat]
                std, b = dp.sigma * dp.C, x.shape[1]
                if std:  # each seed's noise from its own generator, tensor after tensor as alone
                    noise = [[randn_like(s[t], defense_gens[t]) for s in summed] for t in range(k)]
                    shared = [(s + std * torch.stack([noise[t][j] for t in range(k)])) / b
                              for j, s in enumerate(summed)]
                else:
                    shared = [s / b for s in summed]
            if plan.before:
                per_seed = [[s[t] for s in shared] for t in range(k)]
                for t in range(k):
                    for d in plan.before:
                        per_seed[t] = d.apply_gradients(per_seed[t], generator=defense_gens[t])
                shared = [torch.stack([per_seed[t][j] for t in range(k)]) for j in range(len(named))]
            params = {name: params[name] - lr * s for name, s in zip(named, shared)}
            steps += 1
        epoch_losses, _ = _stacked_loss_accuracy(template, params, buffers, images, labels, loss_fn)
        for t in range(k):
            losses[t].append(epoch_losses[t])
    seconds = time.perf_counter() - start
    train_losses, train_accs = _stacked_loss_accuracy(template, params, buffers, images, labels, loss_fn)
    eps = dp.epsilon(sample_rate=min(1.0, batch_size / n), steps=steps) if dp is not None else None
    out = []
    for t, model in enumerate(models):
        with torch.no_grad():
            for name in named:
                model.get_parameter(name).copy_(params[name][t])
        out.append(dict(model=model, defense=defense.spec, epochs=epochs, steps=steps, batch_size=batch_size,
                        lr=float(lr), losses=losses[t], train_loss=train_losses[t], train_accuracy=train_accs[t],
                        epsilon=eps, seconds=seconds / k, samples_seen=seen))
    return out


__all__ = ["train_seeds", "seeds_refusal"]
