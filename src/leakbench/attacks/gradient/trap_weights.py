"""Trap weights (Boenisch, Dziedzic, Schuster, Shamsabadi, Shumailov & Papernot, "When the Curious Abandon
Honesty: Federated Learning Is Not Private", EuroS&P 2023).

**The observation the attack reads (Sec. 4.1).**  For a fully connected layer z = W x + b followed by a ReLU,
the gradient of one sample's loss ℓ with respect to row k of W and to b_k is

    (1)  ∂ℓ/∂W_k = (∂ℓ/∂b_k) · xᵀ,             ∂ℓ/∂b_k = ∂ℓ/∂z_k = 1[z_k > 0] · (upstream gradient)_k,

so x = (∂ℓ/∂W_k) / (∂ℓ/∂b_k) whenever ∂ℓ/∂b_k ≠ 0.  For the mean loss over a batch of B samples

    (2)  ∇W_k = (1/B) Σ_i (∂ℓ_i/∂b_k) x_iᵀ,     ∇b_k = (1/B) Σ_i ∂ℓ_i/∂b_k,

and a sample that is the only one of the batch to activate neuron k (the ReLU zeroes every other term) is

    (3)  x_i = ∇W_k / ∇b_k           exactly.

A neuron activated by several samples gives their ∂ℓ/∂b-weighted mixture instead.  (The equations are the
paper's Sec. 4.1 argument; the numbering here is ours — the paper's text is not in ``papers/``.)

**The server's move (Sec. 4.2, :func:`leakbench.models.active.trap_weights`).**  An honest layer's rows fire
for about half the inputs, so (3) almost never applies at B > 1.  The trap rows have a random negative half and a
positive half scaled by s, so that on non-negative data each neuron fires for few inputs and many samples are
alone on at least one neuron.

**What is returned.**  Every row with |∇b_k| above ``threshold``·max|∇b| gives a candidate (3).  Rows that give the
same input (within ``merge``·(hi − lo) RMS per pixel) are one cluster: a lone sample typically owns several rows.
A cluster is *provably alone* (``confidence`` 1) when the model the server shipped reproduces its bias gradients:
for some label y, ∂ℓ(x̂, y)/∂z_k · c = ∇b_k on every row k of the cluster (c = 1/B; 1/B_client under
``secagg:L`` with the sum; one forward pass of x̂ and one backward pass per candidate label), x̂ lies in the data
box and fires each of its rows.  A mixture of ≥ 2 samples passes only if a vector identity over its rows holds by
accident.  The check needs the clean gradient of the shipped model (or a one-step update, or secure aggregation's
sum); under several local steps (FedAvg), another defense, or batch norm/dropout in training mode, no slot is
claimed (``trace["lone_check"]`` says why) — the candidates are still returned, clusters with more rows first,
since (3) stays exact under FedAvg for a sample that alone activates a row in every local step (the first layer's
input never changes: ΔW_k / Δb_k = x).

Slots: provably alone clusters first (largest |∇b| first), then the others (more rows, then larger |∇b|), at
most ``obs.batch_size`` (under secure aggregation the whole aggregate's L·B: the server cannot tell the target
client's samples from the others'); when fewer exist, slots repeat them with confidence 0.  Labels of the lone
slots are in ``trace["lone_labels"]``.
"""
from __future__ import annotations

from torch import nn

from ...models.active import TrapBlock, first_linear
from ...models.malicious import find_module
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..observed import shared_gradient
from ..solvers.rows import RowOptions, read_rows

__all__ = ["TrapWeights", "trap_layer"]


def trap_layer(model: nn.Module, input_shape) -> nn.Linear | str:
    """The layer the attack reads: a :class:`TrapBlock`'s first layer, else the model's first FC layer (a reason
    string when there is neither)."""
    block = find_module(model, TrapBlock)
    if block is not None:
        return block.linear0
    found = first_linear(model, input_shape)
    return found if isinstance(found, str) else found[1]


@register
class TrapWeights(Attack):
    """Trap weights: exact recovery of every sample that alone activates a neuron of the first FC layer."""

    name = "trap-weights"
    tags = ("gradient", "update", "labels", "modified-model")
    Options = RowOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["trap-weights needs a shared gradient or update, not trained weights"]
        layer = trap_layer(obs.model, obs.input_shape)
        if isinstance(layer, str):
            return [f"trap-weights reads a first fully connected layer with bias followed by a ReLU, or a trap "
                    f"block: {layer}; ship leakbench.models.active.trap_weights(model, ...) (neurons=K for any "
                    "model) and observe that model"]
        if shared_gradient(obs, layer.weight) is None or shared_gradient(obs, layer.bias) is None:
            return ["the trap layer's weight and bias are not among the shared parameters"]
        return []

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        rec = read_rows(obs, trap_layer(obs.model, obs.input_shape), self.options, name=self.name)
        if progress is not None:
            progress(1, 1, 0.0)
        return rec
