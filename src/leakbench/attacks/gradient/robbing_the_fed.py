"""Robbing the Fed (Fowl, Geiping, Czaja, Goldblum & Goldstein, ICLR 2022), the imprint attack.

The server ships the model behind an imprint block (:func:`leakbench.models.malicious.imprint`):
K bins h_k = ReLU(⟨q, x⟩ − c_k) sharing one query q, edges c_k at equal-mass quantiles,
and a layer back to data size whose columns are equal, so every active bin of sample i
receives the same upstream gradient g_i (Sec. 3 of the paper).  Then

    ∇W_k = Σ_{i: s_i > c_k} g_i x_i,      ∇b_k = Σ_{i: s_i > c_k} g_i,

and for a sample alone in bin k (c_k < s_i ≤ c_{k+1})

    x_i = (∇W_k − ∇W_{k+1}) / (∇b_k − ∇b_{k+1})      (∇W_K = 0, ∇b_K = 0),

exactly.  A bin holding several samples returns their g-weighted mixture.  Every bin
with ∇b_k ≠ ∇b_{k+1} is returned (at most B); when fewer than B bins are occupied the
remaining slots repeat them with confidence 0.  The expected number of samples alone
in a bin is :func:`leakbench.analysis.imprint_expected`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import expect
from ...models.malicious import ImprintBlock, find_module
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from .tensor_features import shared_gradient


@dataclass
class RobbingOptions:
    """Options of ``robbing-the-fed``."""

    threshold: float = 1e-7   # a bin is occupied when |∇b_k − ∇b_{k+1}| > threshold · max_k |…|
    clamp: bool = True        # clamp reconstructions to the data range (exact ones already lie in it)

    def check(self) -> None:
        expect(0 <= self.threshold < 1, f"expected 0 ≤ threshold < 1, got {self.threshold} (option threshold)")


def bin_differences(grad_w: torch.Tensor, grad_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(∇W_k − ∇W_{k+1}, ∇b_k − ∇b_{k+1}) for k = 0..K−1, with the (K+1)-th bin zero."""
    zero_w = torch.zeros_like(grad_w[:1])
    zero_b = torch.zeros_like(grad_b[:1])
    return grad_w - torch.cat([grad_w[1:], zero_w]), grad_b - torch.cat([grad_b[1:], zero_b])


@register
class RobbingTheFed(Attack):
    """Robbing the Fed: exact recovery of samples alone in a bin of the server's imprint block."""

    name = "robbing-the-fed"
    Options = RobbingOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["robbing-the-fed needs a shared gradient or update, not trained weights"]
        if find_module(obs.model, ImprintBlock) is None:
            return ["robbing-the-fed needs the server's imprint block in the model: ship "
                    "leakbench.models.malicious.imprint(model, bins=K) and observe that model"]
        block = find_module(obs.model, ImprintBlock)
        if shared_gradient(obs, block.linear0.weight) is None or shared_gradient(obs, block.linear0.bias) is None:
            return ["the imprint block's first layer is not among the shared parameters"]
        return []

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        block: ImprintBlock = find_module(obs.model, ImprintBlock)
        grad_w = shared_gradient(obs, block.linear0.weight)
        grad_b = shared_gradient(obs, block.linear0.bias)
        diff_w, diff_b = bin_differences(grad_w, grad_b)
        size = diff_b.abs()
        top = float(size.max()) if size.numel() else 0.0
        occupied = (size > self.options.threshold * top).nonzero().reshape(-1) if top > 0 else size.new_zeros(0).long()
        if occupied.numel() > obs.batch_size:  # noise can light up empty bins: keep the strongest B
            occupied = occupied[size[occupied].argsort(descending=True)[: obs.batch_size]].sort().values
        images = diff_w[occupied] / diff_b[occupied, None]
        n = int(occupied.numel())
        confidence = torch.ones(n, device=images.device)
        if n == 0:
            lo, hi = obs.data_range
            images = torch.full((obs.batch_size, images.shape[1]), (lo + hi) / 2, device=grad_w.device,
                                dtype=grad_w.dtype)
            confidence = torch.zeros(obs.batch_size, device=grad_w.device)
        elif n < obs.batch_size:
            repeat = torch.arange(obs.batch_size - n, device=images.device) % n
            images = torch.cat([images, images[repeat]])
            confidence = torch.cat([confidence, torch.zeros(obs.batch_size - n, device=images.device)])
        images = images.reshape(obs.batch_size, *obs.input_shape)
        if self.options.clamp:
            images = images.clamp(*obs.data_range)
        if progress is not None:
            progress(1, 1, 0.0)
        trace = {"bins": block.bins, "bins_occupied": n, "occupied": occupied.tolist(),
                 "padded": max(obs.batch_size - n, 0)}
        return Reconstruction(images=images.detach(), confidence=confidence, trace=trace)
