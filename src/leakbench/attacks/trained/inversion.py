"""Model inversion baseline: maximise or minimise the trained network's output from random inputs.

The comparison of Haim et al. (2022), Sec. 5.4 and appendix C.2 (after Fredrikson et al.
2015): starting from random inputs x ~ σ_x N(0, I), half the candidates maximise the
output Φ(x) and half minimise it (for K outputs: maximise the logit of an assigned class,
classes balanced), with the same box prior as the KKT attack.  Haim et al. search
lr log-uniform in [1e-6, 1] and σ_x in [1e-7, 1]; the defaults here are one fixed draw,
and the result is ordered by the network's output, as in their figures 12–13.  It
recovers class averages, not training samples — the point of the comparison.
``rescale`` (off by default, ours, as for ``kkt``) first scales the weights to norm
``rescale``: for a homogeneous network the input-gradient directions are unchanged, while
the output no longer dwarfs the box prior on weights trained far out in norm.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import expect
from ...models.targets import scale_to_norm
from ...threat import Observation
from ..base import Attack, Reconstruction, register

__all__ = ["ModelInversion", "InversionOptions"]


@dataclass
class InversionOptions:
    """``candidates`` inputs, ``iterations`` steps of SGD (momentum 0.9) at ``lr`` from σ_x = ``init_scale``."""

    candidates: int = 100
    iterations: int = 2000
    lr: float = 0.01
    init_scale: float = 0.1
    momentum: float = 0.9
    box: bool = True
    rescale: float | None = None
    trace_every: int = 250


@register
class ModelInversion(Attack):
    """Model inversion baseline: push the output up (half) or down (half) from random inputs (Haim et al. 5.4)."""

    name = "model-inversion"
    tags = ("weights", "queries")
    Options = InversionOptions
    presets = {"default": {}, "quick": {"candidates": 10, "iterations": 200}}

    def validate(self) -> None:
        o = self.options
        for name in ("candidates", "iterations", "trace_every"):
            value = getattr(o, name)
            expect(isinstance(value, int) and value >= 1, f"expected a positive int, got {value!r} (option {name})")
        for name in ("lr", "init_scale"):
            value = getattr(o, name)
            expect(value > 0, f"expected a positive number, got {value!r} (option {name})")
        expect(0 <= o.momentum < 1, f"expected momentum in [0, 1), got {o.momentum!r} (option momentum)")
        expect(o.rescale is None or (isinstance(o.rescale, (int, float)) and o.rescale > 0),
               f"expected a positive norm or None (weights as given), got {o.rescale!r} (option rescale)")

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind != "weights":
            return [f"model-inversion queries the trained model; got a {obs.kind!r} observation "
                    "(use leakbench.threat.observe_weights)"]
        return []

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        o = self.options
        device = obs.device
        net: nn.Module = copy.deepcopy(obs.model).to(device=device, dtype=torch.float64).eval()
        if o.rescale is not None:
            scale_to_norm(net, o.rescale)
        for p in net.parameters():
            p.requires_grad_(False)
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        x = (torch.randn((o.candidates, *obs.input_shape), generator=gen, dtype=torch.float64) * o.init_scale)
        x = x.to(device).requires_grad_(True)
        k = obs.num_classes
        if k == 1:
            sign = torch.ones(o.candidates, dtype=torch.float64, device=device)
            sign[: o.candidates // 2] = -1
            labels = (sign > 0).long()
        else:
            labels = torch.arange(o.candidates, device=device) % k
        lo, hi = obs.data_range
        opt = torch.optim.SGD([x], lr=o.lr, momentum=o.momentum)
        for it in range(o.iterations):
            out = net(x)
            target = out.reshape(-1) * sign if k == 1 else out.gather(1, labels[:, None]).squeeze(1)
            loss = -target.sum()
            if o.box:
                loss = loss + torch.relu(x - hi).pow(2).sum() + torch.relu(lo - x).pow(2).sum()
            (gx,) = torch.autograd.grad(loss, [x])
            x.grad = gx
            opt.step()
            if it % o.trace_every == 0 or it == o.iterations - 1:
                if progress is not None:
                    progress(it + 1, o.iterations, float(loss.detach()))
                if callback is not None:
                    callback(it, x.detach().clone())
        with torch.no_grad():
            out = net(x).reshape(o.candidates, -1)
        score = out[:, 0] if k == 1 else out.gather(1, labels[:, None]).squeeze(1)
        order = torch.argsort(score)
        mean = obs.extras.get("data_mean")
        images = x.detach()[order]
        if mean is not None:
            images = images + mean.to(images.device, images.dtype)
        return Reconstruction(images=images.to(obs.dtype), labels=labels[order], confidence=score[order].to(obs.dtype),
                              trace={"outputs": score[order].cpu()})
