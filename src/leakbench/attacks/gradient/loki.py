"""LOKI (Zhao, Sharma, Elkordy, Ezzeldin, Avestimehr & Bagchi, "LOKI: Large-scale Data Reconstruction Attack
against Federated Learning through Model Manipulation", IEEE S&P 2024): every client's samples from the secure sum.

The server sent client m a model whose convolution copies its image into its own channel set S_m only
(:mod:`leakbench.models.loki`, (L1)–(L3) there).  Under secure aggregation it receives Σ_l ∇θ_l (or Σ_l Δθ_l
under FedAvg), and the imprint FC layer's weight gradient, cut into the clients' column blocks, is

    (L4)  G_k^m := Σ_l ∇W_k|_{S_m} = s Σ_{i ∈ m, ⟨q,x_i⟩ > c_k} g_i x_i,     o_k^m := Σ_l ∇W_k|_{off_m} = s Σ_{…} g_i,

because every other client's convolution is zero on S_m and on off_m.  For each client m and bin k the attack
forms the bin differences D_k^m = G_k^m − G_{k+1}^m, d_k^m = o_k^m − o_{k+1}^m (Robbing the Fed's read-out, per
client) and returns

    (L5)  x̂ = D_k^m / d_k^m     for every bin with |d_k^m| > ``threshold`` · max_k |d_k^m|,

exact for a sample of client m alone in bin k (a g-weighted mixture for a shared bin), at most the client's
batch size per client (the strongest bins).  Slots: the target client's (client 0) first, then the others in
order, padded to the aggregate's L·B by repeating the found ones with confidence 0; ``trace["per_client"]``
counts the bins read per client.  Under FedAvg local steps (L5) holds up to the rows' drift during the local
epochs (:mod:`leakbench.models.loki`).

**Which slots are provably alone** (``confidence`` 1): Robbing the Fed's forward check, per client.  A sample
alone in bin k gives d_k^m = c·s·∂ℓ(x̂, y)/∂z_k for its label y, where c is the weight of one sample's loss in
the sum (1/B_m for ``secagg:L`` with the sum, 1/ΣB_l with the mean, 1/B without secure aggregation) and the
model's z_k are the same for every client's model ((L2)), so one forward/backward pass of x̂ through the
shipped model predicts it; a blend of ≥ 2 samples matches only by accident.  A slot is flagged when that
prediction matches within κ·eps·(√d·|d_k| + |o_k| + |o_{k+1}|) for some candidate label, x̂ lies in the data
box and ⟨q, x̂⟩ in its bin (the tolerances of ``robbing-the-fed``).  The check needs the clean gradient (or a
one-step update) summed by secure aggregation alone; otherwise no slot is claimed (``trace["lone_check"]``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from torch import nn

from ...defenses import SecureAggregation, parse, parts_of
from ...errors import NothingRecovered, expect
from ...models.loki import LokiBlock
from ...models.malicious import find_module
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..observed import bin_differences, output_gradients, shared_gradient

__all__ = ["Loki", "LokiOptions"]


@dataclass
class LokiOptions:
    """Options of ``loki``."""

    threshold: float = 1e-4   # a client's bin is read when |d_k| > threshold · max_k |d_k| (its own bins)
    clamp: bool = True        # clamp reconstructions to the data range (exact ones already lie in it)
    #: lone-sample tolerance in units of eps·(√d·|d_k| + |o_k| + |o_{k+1}|); None: 8 below float64, 1e4 in float64
    consistency: float | None = None

    def check(self) -> None:
        expect(0 <= self.threshold < 1, f"expected 0 ≤ threshold < 1, got {self.threshold} (option threshold)")
        expect(self.consistency is None or self.consistency > 0,
               f"expected consistency > 0 (or None for the dtype's default), got {self.consistency} (option consistency)")


def loss_weight(obs: Observation) -> tuple[float | None, str | None]:
    """(the weight c of one sample's loss in the shared sum, None and the reason when no slot can be proven)."""
    parts = [p for p in parts_of(parse(obs.defense)) if p.spec != "none"]
    if any(not isinstance(p, SecureAggregation) for p in parts):
        return None, f"defense {obs.defense!r} transforms the clients' gradients: no slot is provably alone"
    if obs.kind != "gradient" and obs.local_steps > 1:
        return None, f"{obs.local_steps} local steps: the per-sample bin gradients are not those of one pass"
    if obs.train_mode and any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout)) for m in obs.model.modules()):
        return None, "batch norm or dropout in training mode couples the samples: no per-sample prediction"
    if parts and parts[0].reduce == "sum":
        return 1.0 / int(obs.extras.get("client_batch_size", obs.batch_size)), None
    return 1.0 / obs.batch_size, None


@register
class Loki(Attack):
    """LOKI: every client's samples alone in a bin of its own column block of the imprint layer, under secagg."""

    name = "loki"
    tags = ("gradient", "update", "modified-model")
    Options = LokiOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["loki needs a shared gradient or update, not trained weights"]
        block = find_module(obs.model, LokiBlock)
        if block is None:
            return ["loki needs the server's customised LOKI block in the model: ship "
                    "leakbench.models.loki.loki(model, clients=L, bins=K, calibration=public) and observe that model"]
        if shared_gradient(obs, block.fc0.weight) is None:
            return ["the LOKI block's imprint layer is not among the shared parameters"]
        clients = int(obs.extras.get("clients", 1))
        if clients > block.clients:
            return [f"the observation aggregates {clients} clients but the LOKI model was customised for "
                    f"{block.clients}: build it with clients={clients}"]
        return []

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        block: LokiBlock = find_module(obs.model, LokiBlock)
        found, counts, d, around = self.read(obs, block)
        n = int(found.shape[0])
        if n == 0:
            raise NothingRecovered("loki found no occupied bin in any client's block: it determined nothing from "
                                   "this observation")
        lone, labels, how = self._lone(obs, block, found, d, around)
        slots = max(obs.batch_size, n)
        confidence = lone.to(found.dtype).to(found.device)
        if n < slots:
            found = torch.cat([found, found[torch.arange(slots - n, device=found.device) % n]])
            confidence = torch.cat([confidence, confidence.new_zeros(slots - n)])
        images = found.reshape(slots, *obs.input_shape)
        if self.options.clamp:
            images = images.clamp(*obs.data_range)
        if progress is not None:
            progress(1, 1, 0.0)
        trace = {"bins": block.bins, "clients": block.clients, "per_client": counts, "padded": slots - n,
                 "lone": int(lone.sum()), "lone_labels": labels.tolist(), "lone_check": how,
                 "confidence": "1 = the slot's sample is alone in its client's bin (exact); 0 = a blend, or not "
                               "provable"}
        return Reconstruction(images=images.detach(), confidence=confidence, trace=trace)

    def _lone(self, obs: Observation, block: LokiBlock, images: torch.Tensor, d: torch.Tensor,
              around: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(lone flags, labels (−1 where not lone), how it was decided) of the slots ``images`` (n × d)."""
        n = int(images.shape[0])
        weight, reason = loss_weight(obs)
        if weight is None:
            return torch.zeros(n, dtype=torch.bool), torch.full((n,), -1, dtype=torch.long), reason
        bins, d, around = around[:, 0].long(), d, around[:, 1:]
        eps = torch.finfo(images.dtype).eps
        kappa = self.options.consistency or (1e4 if images.dtype == torch.float64 else 8.0)
        scale = eps * (d.abs() * images.shape[1] ** 0.5 + around.abs().sum(1))
        if obs.labels is not None:
            labels = obs.labels.detach().unique().to(images.device).long()
        else:
            labels = torch.arange(max(obs.num_classes, 2), device=images.device)
        grads, _ = output_gradients(obs, block.fc0, images.detach(), labels)          # (n, L, K)
        predicted = weight * block.scale * grads.gather(2, bins.to(grads.device)[:, None, None].expand(n, len(labels), 1))[..., 0]
        mismatch = (predicted - d[:, None]).abs() / scale[:, None]
        best, which = mismatch.min(dim=1)
        lo, hi = obs.data_range
        slack = kappa * scale / d.abs()
        in_box = ((images >= lo - slack[:, None] * (hi - lo)) & (images <= hi + slack[:, None] * (hi - lo))).all(1)
        score = images.to(block.query.dtype) @ block.query
        edges = torch.cat([block.thresholds, block.thresholds.new_full((1,), float("inf"))])
        room = slack.to(score.dtype) * (hi - lo) * images.shape[1] ** 0.5
        in_bin = (score > edges[bins] - room) & (score <= edges[bins + 1] + room)
        lone = (best <= kappa) & in_box & in_bin
        return lone.cpu(), torch.where(lone, labels[which], torch.full_like(which, -1)).cpu(), \
            "forward consistency of each client's bin gradient"

    def read(self, obs: Observation, block: LokiBlock):
        """(n × d reconstructions by (L4)–(L5), client 0's first; the bins read per client; each slot's d_k^m;
        each slot's (k, o_k^m, o_{k+1}^m))."""
        grad = shared_gradient(obs, block.fc0.weight)
        blocks, offsets = block.split(grad)                      # (K, L, d), (K, L)
        per_client = int(obs.extras.get("client_batch_size", obs.batch_size))
        images, counts, diffs, around = [], [], [], []
        for m in range(int(obs.extras.get("clients", 1))):  # the clients whose updates the observation sums
            diff_w, diff_b = bin_differences(blocks[:, m], offsets[:, m])
            size = diff_b.abs()
            top = float(size.max())
            occupied = (size > self.options.threshold * top).nonzero().reshape(-1) if top > 0 else \
                size.new_zeros(0).long()
            if occupied.numel() > per_client:  # drift can light up empty bins: keep the client's strongest B
                occupied = occupied[size[occupied].argsort(descending=True)[:per_client]].sort().values
            above = torch.cat([offsets[1:, m], offsets.new_zeros(1)])
            images.append(diff_w[occupied] / diff_b[occupied, None])
            diffs.append(diff_b[occupied])
            around.append(torch.stack([occupied.to(grad.dtype), offsets[occupied, m], above[occupied]], 1))
            counts.append(int(occupied.numel()))
        return torch.cat(images), counts, torch.cat(diffs), torch.cat(around)
