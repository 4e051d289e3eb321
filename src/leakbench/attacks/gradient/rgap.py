"""R-GAP (Zhu & Blaschko, ICLR 2021) as framed by Chen & Campbell (2022, Sec. 3): the attack.

The recursion from the output layer to the image — activation inversion (eq. 2), upstream
gradients (eq. 3), Lemma 3.1 for fully connected layers, the minimum-norm least-squares solution
of the stacked weight and gradient constraints for convolutions (eqs. 6–8) — is in
:mod:`leakbench.attacks.solvers.rgap_solver`, shared with the hybrid attack.  ``trace["layers"]`` records
each layer's rank; rank < dim(x_i) is where R-GAP must guess, and ``confidence`` is 1 only when no
layer is rank-deficient.
"""
from __future__ import annotations

import torch

from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..labels import recover_labels
from ..solvers.rgap_solver import (INVERTIBLE, SOLVERS, LayerSystem, LeastSquares, RGAPOptions, least_squares,
                                   rgap_reasons, solve)

__all__ = ["RGAP", "RGAPOptions", "LayerSystem", "LeastSquares", "solve", "least_squares", "INVERTIBLE", "SOLVERS"]


@register
class RGAP(Attack):
    """R-GAP: per-layer weight + gradient linear systems from the output to the input (batch 1)."""

    name = "rgap"
    tags = ("gradient", "update", "labels")
    Options = RGAPOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        return rgap_reasons(obs, self.name)[0]

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        labels = recover_labels(obs, seed=seed)
        x, trace = solve(obs, self.options, labels=labels)
        images = x.reshape(1, *obs.input_shape).to(obs.dtype)
        if callback is not None:
            callback(0, images)
        deficient = sum(layer.get("rank_deficiency", 0) for layer in trace["layers"])
        trace["exact"] = deficient == 0
        return Reconstruction(images=images, labels=labels, confidence=torch.tensor([float(deficient == 0)]),
                              trace=trace)
