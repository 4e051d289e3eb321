"""The random-feature block the feature-level attacks target, and inverting recovered features to inputs.

Blocks: a :class:`~leakbench.models.TwoLayer` model without hidden bias and with Gaussian
first-layer weights (``init="gaussian"``) — the features are the inputs — or the
:class:`~leakbench.models.malicious.RandomFeatureHead` of Liu et al. (2024, App. F) inside a deeper
model — the features are the head's inputs, and :func:`invert_features` finds images whose
features match (1 − cos² between f(x̂_i) and ẑ_i, + TV).  :func:`block_requirements` says why
the tensor method of Wang et al. (2023; :mod:`leakbench.attacks.solvers.tensor_moments`) cannot run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...models.malicious import RandomFeatureHead, find_module
from ...models.zoo import TwoLayer
from ...threat import Observation
from .objectives import total_variation
from ..observed import attacker_model, block_input, shared_gradient
from .tensor_moments import hermite_orders

__all__ = ["TensorBlock", "find_block", "invert_features", "block_requirements"]


# ----------------------------------------------------------------------------- the two-layer block
@dataclass
class TensorBlock:
    """Where the two-layer block sits: W (m×d), the output weight A (K×m), σ, and the module whose input is z."""

    first: torch.Tensor
    second: torch.Tensor
    act: nn.Module
    feature_module: nn.Module
    bias: torch.Tensor | None
    on_input: bool  # the features are the model's (flattened) inputs


def find_block(model: nn.Module) -> TensorBlock | None:
    """The random-feature block of ``model``: a RandomFeatureHead, else a TwoLayer net; None otherwise."""
    head = find_module(model, RandomFeatureHead)
    if head is not None:
        return TensorBlock(head.random.weight, head.out.weight, head.act, head.random, None, False)
    two = find_module(model, TwoLayer)
    if two is not None:
        return TensorBlock(two.first.weight, two.second.weight, two.act1, two.first, two.first.bias,
                           two is model or _first_module_is(model, two))
    return None


def _first_module_is(model: nn.Module, target: nn.Module) -> bool:
    children = list(model.children())
    return bool(children) and children[0] is target


# ----------------------------------------------------------------------------- feature inversion
def invert_features(obs: Observation, module: nn.Module, features: torch.Tensor, *, iterations: int,
                    lr: float = 0.1, tv: float = 1e-2, squared: bool = True, seed: int = 0,
                    progress=None) -> torch.Tensor:
    """Images x̂ whose features at ``module``'s input match ``features`` (B×d), one slot per feature.

    Minimises mean_i [1 − cos(f(x̂_i), ẑ_i)] (squared cosine if ``squared``: sign-free) + tv·TV(x̂)
    with Adam on the signed gradient, lr decayed ×0.1 at 3/8, 5/8, 7/8, inside the data box.
    """
    model = attacker_model(obs)
    target_module = dict(obs.model.named_modules())
    name = next(n for n, m in target_module.items() if m is module)
    copy_module = model.get_submodule(name) if name else model
    lo, hi = obs.data_range
    gen = torch.Generator().manual_seed(int(seed))
    x = (lo + hi) / 2 + (hi - lo) / 4 * torch.randn((features.shape[0], *obs.input_shape), generator=gen)
    x = x.to(obs.device, obs.dtype).clamp(lo, hi).requires_grad_(True)
    target = features.detach().to(obs.device, obs.dtype)
    target = target / target.norm(dim=1, keepdim=True).clamp_min(1e-12)
    opt = torch.optim.Adam([x], lr=lr)
    marks = sorted({max(1, int(iterations * f)) for f in (3 / 8, 5 / 8, 7 / 8)})
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=marks, gamma=0.1)
    for step in range(iterations):
        z = block_input(model, copy_module, x)
        cos = (z * target).sum(1) / z.norm(dim=1).clamp_min(1e-12)
        loss = (1 - (cos.pow(2) if squared else cos)).mean()
        if tv and x.dim() == 4:
            loss = loss + tv * total_variation(x)
        (grad,) = torch.autograd.grad(loss, [x])
        x.grad = grad.sign()
        opt.step()
        sched.step()
        with torch.no_grad():
            x.clamp_(lo, hi)
        if progress is not None and (step % 50 == 0 or step == iterations - 1):
            progress(step + 1, iterations, float(loss.detach()))
    return x.detach()


# ----------------------------------------------------------------------------- requirements
def _excess_kurtosis(w: torch.Tensor) -> float:
    v = w.detach().double().reshape(-1)
    v = (v - v.mean()) / v.std().clamp_min(1e-300)
    return float(v.pow(4).mean() - 3.0)


def block_requirements(obs: Observation, attack: str) -> list[str]:
    """Why the tensor method cannot run on ``obs`` (shared by tensor-features and liu2024)."""
    block = find_block(obs.model)
    if block is None:
        return [f"{attack} needs a two-layer block with random Gaussian weights: a TwoLayer model built "
                "with init='gaussian', or a model shipped through leakbench.models.malicious.random_head(model)"]
    reasons = []
    if block.bias is not None and bool((block.bias.detach() != 0).any()):
        reasons.append("the tensor method needs the hidden layer without bias (build with bias=False or zero it)")
    if shared_gradient(obs, block.second) is None:
        reasons.append("the block's output weight is not among the shared parameters")
    numel = block.first.numel()
    kurt = _excess_kurtosis(block.first) if numel >= 8 else float("nan")
    if not (numel >= 100 and abs(kurt) < 0.5):
        reasons.append(f"the block's hidden weights do not look i.i.d. Gaussian (excess kurtosis {kurt:.2f}, "
                       f"{numel} entries; need ≥ 100 entries and |kurtosis| < 0.5): build with init='gaussian'")
    if hermite_orders(block.act) is None:
        reasons.append("the block's activation has no usable Hermite coefficients (k₂ ≤ 3, k₃ ≤ 4), "
                       "e.g. it is linear")
    d = block.first.shape[1]
    if obs.batch_size > d:
        reasons.append(f"batch {obs.batch_size} exceeds the feature dimension {d}")
    return reasons
