"""Robbing the Fed (Fowl, Geiping, Czaja, Goldblum & Goldstein, ICLR 2022), the imprint attack.

The server ships the model behind an imprint block (:func:`leakbench.models.malicious.imprint`):
K bins h_k = ReLU(⟨q, x⟩ − c_k) sharing one query q, edges c_k at equal-mass quantiles,
and a layer back to data size whose columns are equal, so every active bin of sample i
receives the same upstream gradient g_i = ∂ℓ_i/∂z_ik (Sec. 3 of the paper).  For the mean
loss over B samples

    ∇W_k = (1/B) Σ_{i: s_i > c_k} g_i x_i,      ∇b_k = (1/B) Σ_{i: s_i > c_k} g_i,

and for a sample alone in bin k (c_k < s_i ≤ c_{k+1})

    x_i = (∇W_k − ∇W_{k+1}) / (∇b_k − ∇b_{k+1})      (∇W_K = 0, ∇b_K = 0),

exactly.  A bin holding several samples returns their g-weighted mixture.  Every bin
with ∇b_k ≠ ∇b_{k+1} is returned (at most B); when fewer than B bins are occupied the
remaining slots repeat them with confidence 0.  The expected number of samples alone
in a bin is :func:`leakbench.analysis.imprint_expected`.

**Which slots are confident (alone in their bin).**  The block's own gradients cannot tell:
per bin they carry only D_k = ∇b_k − ∇b_{k+1} = (1/B)Σ g_i and Σ g_i x_i / B, and a blend
x̂ = Σ g_i x_i / Σ g_i of samples whose g_i share a sign is reproduced exactly by one
virtual sample x̂ with bin gradient D_k (its score ⟨q, x̂⟩ even lies inside the bin).  What
separates one sample from several is the rest of the model, which the server knows: a
lone sample with label y has D_k = g(x̂, y)/B, the bin gradient the shipped model gives
x̂ itself (one forward/backward pass on x̂ for every candidate label).  So a slot is
confident iff (1) D_k = g(x̂_k, y)/B for some label y, (2) x̂_k lies in the data box and
(3) ⟨q, x̂_k⟩ lies in (c_k, c_{k+1}], each up to the round-off of the observation's dtype:
tolerance κ·eps·(√d·|D_k| + |∇b_k| + |∇b_{k+1}|) (the cancellation in D_k and the
prediction's sums over the d pixels; κ = ``consistency``, by default 8 in float32 and 1e4 in
float64; the measured spread of lone bins and blends that sets κ is in docs/feature-attacks.md).
A lone sample passes all three (exact identities).  A bin of ≥ 2 samples passes (1) only
if Σ g_i happens to equal the gradient of their blend for some label — one scalar equation
the data would have to satisfy, almost never within tolerance: in float64 lone bins
mismatch by ≤ 1e-11 (relative) and blends by ≥ 7e-4 (digits and photos, batches 8–64).
In float32 the margin is round-off: a rare blend may pass, and a lone bin with heavy
cancellation is not claimed.  The
check assumes the observation is the clean mean-loss gradient of the shipped model (or a
one-step update) with samples processed independently; otherwise — a defense, several
local steps, batch norm or dropout in training mode — no slot is claimed (confidence 0,
``trace["lone_check"]`` says why).  Labels are the candidates of (1): the batch's labels
when the server knows them, else every class.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import NothingRecovered, expect
from ...losses import get_loss
from ...models.malicious import ImprintBlock, find_module
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..observed import bin_differences, shared_gradient

__all__ = ["RobbingTheFed", "RobbingOptions", "lone_check_reason", "lone_gradients"]


@dataclass
class RobbingOptions:
    """Options of ``robbing-the-fed``."""

    threshold: float = 1e-7   # a bin is occupied when |∇b_k − ∇b_{k+1}| > threshold · max_k |…|
    clamp: bool = True        # clamp reconstructions to the data range (exact ones already lie in it)
    #: lone-sample tolerance in units of eps·(√d·|D_k| + |∇b_k| + |∇b_{k+1}|); None: 8 below float64, 1e4 in float64
    consistency: float | None = None

    def check(self) -> None:
        expect(0 <= self.threshold < 1, f"expected 0 ≤ threshold < 1, got {self.threshold} (option threshold)")
        expect(self.consistency is None or self.consistency > 0,
               f"expected consistency > 0 (or None for the dtype's default), got {self.consistency} (option consistency)")


def lone_check_reason(obs: Observation) -> str | None:
    """Why the lone-sample check cannot be applied to ``obs`` (None when it can)."""
    if obs.defense not in ("none", "", None):
        return f"defense {obs.defense!r} transforms the gradient: no slot is provably alone"
    if obs.kind != "gradient" and obs.local_steps > 1:
        return f"{obs.local_steps} local steps: the per-sample bin gradients are not those of one pass"
    if obs.train_mode and any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout))
                              for m in obs.model.modules()):
        return "batch norm or dropout in training mode couples the samples: no per-sample prediction"
    return None


def lone_gradients(obs: Observation, block: ImprintBlock, images: torch.Tensor, bins: torch.Tensor,
                   labels: torch.Tensor, *, chunk: int = 512) -> torch.Tensor:
    """(n, L): the bias-gradient difference bin ``bins[j]`` would show if ``images[j]`` were alone in it
    with label ``labels[l]``: g(x̂_j, y_l)/B, from forward/backward passes of the shipped model."""
    n, m = images.shape[0], labels.numel()
    flat = images.detach().repeat_interleave(m, 0).reshape(n * m, *obs.input_shape)
    ys = labels.repeat(n)
    cols = bins.repeat_interleave(m)
    loss_fn = get_loss(obs.loss)
    seen: list[torch.Tensor] = []
    handle = block.linear0.register_forward_hook(lambda _m, _i, out: seen.append(out))
    out = []
    try:
        with torch.enable_grad():
            for s in range(0, n * m, chunk):
                seen.clear()
                part = flat[s:s + chunk]
                loss = loss_fn(obs.model(part), ys[s:s + chunk]) * part.shape[0]  # the sum of per-sample losses
                (grad,) = torch.autograd.grad(loss, seen[0])
                out.append(grad.gather(1, cols[s:s + chunk, None])[:, 0])
    finally:
        handle.remove()
    return (torch.cat(out) / obs.batch_size).reshape(n, m)


@register
class RobbingTheFed(Attack):
    """Robbing the Fed: exact recovery of samples alone in a bin of the server's imprint block."""

    name = "robbing-the-fed"
    tags = ("gradient", "labels", "modified-model")
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

    def _lone(self, obs: Observation, block: ImprintBlock, occupied: torch.Tensor, images: torch.Tensor,
              grad_b: torch.Tensor, diff_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """(lone flags, labels (−1 where not lone), mismatch in tolerance units, how it was decided)."""
        n = int(occupied.numel())
        none = (torch.zeros(n, dtype=torch.bool), torch.full((n,), -1, dtype=torch.long), torch.zeros(0))
        reason = lone_check_reason(obs)
        if reason is not None or n == 0:
            return (*none, reason or "no occupied bin")
        eps = torch.finfo(images.dtype).eps
        kappa = self.options.consistency or (1e4 if images.dtype == torch.float64 else 8.0)
        above = torch.cat([grad_b[1:], grad_b.new_zeros(1)])
        d = diff_b[occupied]
        # round-off of D_k (cancellation of the cumulative sums) and of the prediction (sums over d pixels)
        scale = eps * (d.abs() * images.shape[1] ** 0.5 + grad_b[occupied].abs() + above[occupied].abs())
        slack = kappa * scale / d.abs()                          # relative slack
        if obs.labels is not None:
            labels = obs.labels.detach().unique().to(images.device).long()
        else:
            labels = torch.arange(max(obs.num_classes, 2), device=images.device)
        predicted = lone_gradients(obs, block, images, occupied, labels)          # (n, L)
        mismatch = ((predicted - d[:, None]).abs() / scale[:, None]).detach()
        best, which = mismatch.min(dim=1)
        lo, hi = obs.data_range
        span = hi - lo
        in_box = ((images >= lo - slack[:, None] * span) & (images <= hi + slack[:, None] * span)).all(dim=1)
        score = images.to(block.query.dtype) @ block.query
        edges = torch.cat([block.thresholds, block.thresholds.new_full((1,), float("inf"))])
        room = slack.to(score.dtype) * span * images.shape[1] ** 0.5
        in_bin = (score > edges[occupied] - room) & (score <= edges[occupied + 1] + room)
        lone = (best <= kappa) & in_box & in_bin
        labels_out = torch.where(lone, labels[which], torch.full_like(which, -1))
        return lone.cpu(), labels_out.cpu(), best.cpu(), "forward consistency of each bin's gradient"

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
        lone, labels, mismatch, how = self._lone(obs, block, occupied, images, grad_b, diff_b)
        confidence = lone.to(images.dtype).to(images.device)
        if n == 0:
            raise NothingRecovered("robbing-the-fed found no occupied bin (no bin's bias gradient differs from the "
                                   "next one's): it determined nothing from this observation")
        if n < obs.batch_size:
            repeat = torch.arange(obs.batch_size - n, device=images.device) % n
            images = torch.cat([images, images[repeat]])
            confidence = torch.cat([confidence, torch.zeros(obs.batch_size - n, device=images.device)])
        images = images.reshape(obs.batch_size, *obs.input_shape)
        if self.options.clamp:
            images = images.clamp(*obs.data_range)
        if progress is not None:
            progress(1, 1, 0.0)
        trace = {"bins": block.bins, "bins_occupied": n, "occupied": occupied.tolist(),
                 "padded": max(obs.batch_size - n, 0), "lone": lone.tolist(), "lone_labels": labels.tolist(),
                 "lone_mismatch": mismatch.tolist(), "lone_check": how,
                 "confidence": "1 = the slot's sample is alone in its bin (exact); 0 = a blend, or not provable"}
        return Reconstruction(images=images.detach(), confidence=confidence, trace=trace)
