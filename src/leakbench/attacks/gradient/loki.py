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
epochs (:mod:`leakbench.models.loki`); no slot is claimed provably alone (confidence 0 throughout: the
per-bin forward check of ``robbing-the-fed`` is not carried over).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import NothingRecovered, expect
from ...models.loki import LokiBlock
from ...models.malicious import find_module
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..observed import bin_differences, shared_gradient

__all__ = ["Loki", "LokiOptions"]


@dataclass
class LokiOptions:
    """Options of ``loki``."""

    threshold: float = 1e-4   # a client's bin is read when |d_k| > threshold · max_k |d_k| (its own bins)
    clamp: bool = True        # clamp reconstructions to the data range (exact ones already lie in it)

    def check(self) -> None:
        expect(0 <= self.threshold < 1, f"expected 0 ≤ threshold < 1, got {self.threshold} (option threshold)")


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
        images_of, counts = self.read(obs, block)
        found = torch.cat(images_of) if images_of else torch.zeros(0)
        n = int(found.shape[0])
        if n == 0:
            raise NothingRecovered("loki found no occupied bin in any client's block: it determined nothing from "
                                   "this observation")
        slots = max(obs.batch_size, n)
        confidence = torch.zeros(slots, device=found.device, dtype=found.dtype)
        if n < slots:
            found = torch.cat([found, found[torch.arange(slots - n, device=found.device) % n]])
        images = found.reshape(slots, *obs.input_shape)
        if self.options.clamp:
            images = images.clamp(*obs.data_range)
        if progress is not None:
            progress(1, 1, 0.0)
        trace = {"bins": block.bins, "clients": block.clients, "per_client": counts, "padded": slots - n,
                 "confidence": "0 throughout: no slot is proven alone in its bin"}
        return Reconstruction(images=images.detach(), confidence=confidence, trace=trace)

    def read(self, obs: Observation, block: LokiBlock) -> tuple[list[torch.Tensor], list[int]]:
        """(per client: its bins' reconstructions (n_m × d), per client: n_m), by (L4)–(L5)."""
        grad = shared_gradient(obs, block.fc0.weight)
        blocks, offsets = block.split(grad)                      # (K, L, d), (K, L)
        per_client = int(obs.extras.get("client_batch_size", obs.batch_size))
        images_of, counts = [], []
        for m in range(int(obs.extras.get("clients", 1))):  # the clients whose updates the observation sums
            diff_w, diff_b = bin_differences(blocks[:, m], offsets[:, m])
            size = diff_b.abs()
            top = float(size.max())
            if not top > 0:
                counts.append(0)
                continue
            occupied = (size > self.options.threshold * top).nonzero().reshape(-1)
            if occupied.numel() > per_client:  # drift can light up empty bins: keep the client's strongest B
                occupied = occupied[size[occupied].argsort(descending=True)[:per_client]].sort().values
            images_of.append(diff_w[occupied] / diff_b[occupied, None])
            counts.append(int(occupied.numel()))
        return images_of, counts
