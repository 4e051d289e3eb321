"""Fishing for user data (Wen, Geiping, Fowl, Goldblum & Goldstein, ICML 2022): class fishing, read exactly.

The server ships :func:`leakbench.models.active.fishing`: the final layer keeps the target class's row and
gives every other class a zero row and one large bias, so the gradient that reaches the body of the network is
that of the batch's target-class samples alone (Sec. 3, "gradient magnification": every other sample's share is
scaled by p_target ≤ e^(−margin)).  Wen et al. then invert that gradient by gradient matching; on a model whose
first layer is fully connected (with bias, then a ReLU) we read it exactly instead: a fished sample that alone
among the fished ones activates a row k is ∇W_k / ∇b_k (:mod:`leakbench.attacks.solvers.rows`, the same reading as
``trap-weights``; an honest first layer's rows fire for about half the inputs, so among the few fished samples
many rows single one out).  The lone check tries the target class only.  Every other sample is left out by
construction: the slots beyond the fished ones are mixtures (confidence 0).

Not here: feature fishing (Sec. 3.2, which splits one class by a feature threshold across rounds) and the
gradient-matching inversion on models without a first FC layer (``requirements()`` says so).
"""
from __future__ import annotations

import torch

from ...models.active import first_linear
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..observed import shared_gradient
from ..solvers.rows import RowOptions, read_rows

__all__ = ["Fishing"]


@register
class Fishing(Attack):
    """Class fishing: the target class's samples, read exactly from the first FC layer's rows."""

    name = "fishing"
    tags = ("gradient", "update", "labels", "modified-model")
    Options = RowOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["fishing needs a shared gradient or update, not trained weights"]
        if getattr(obs.model, "fishing_target", None) is None:
            return ["fishing needs the server's class-fishing head: ship leakbench.models.active.fishing(model, "
                    "target=c) and observe that model"]
        found = first_linear(obs.model, obs.input_shape)
        if isinstance(found, str):
            return [f"fishing reads the fished gradient from a first fully connected layer with bias and a ReLU, "
                    f"but {found} (gradient-matching inversion of the fished gradient is not implemented)"]
        if shared_gradient(obs, found[1].weight) is None or shared_gradient(obs, found[1].bias) is None:
            return ["the first layer's weight and bias are not among the shared parameters"]
        return []

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        _, layer = first_linear(obs.model, obs.input_shape)
        target = int(obs.model.fishing_target)
        rec = read_rows(obs, layer, self.options, name=self.name, labels=torch.tensor([target]))
        rec.trace["fished_class"] = target
        if progress is not None:
            progress(1, 1, 0.0)
        return rec
