"""Closed-form inversion of fully connected layers (Aono et al. 2017; Chen & Campbell 2022, Lemma 3.1).

For a linear layer z = W x + b and one sample, the gradient constraint (eq. 1b) is
∇W = δ xᵀ with δ = ∂L/∂z, and ∇b = δ.  Hence (Lemma 3.1):

* with a bias, eq. (4): x = ∇W[k, :] / ∇b[k] for any k with ∇b[k] ≠ 0 (we take the
  largest |∇b[k]| for stability);
* without a bias, eq. (5): x = ∇W[k, :] / δ[k] with δ obtained by back-propagation
  (eq. 3): δ = σ'(z) ⊙ W_nextᵀ δ_next from the layers above, themselves inverted
  first.  At the output layer δ = ∂ℓ/∂z(logits) depends on the unknown input
  itself: with ∇W = s·u vᵀ (rank one) the input is t·v and δ = s·u / t, and the
  scalar t solves ∂ℓ/∂z(t W v + b) = s·u / t (a one-dimensional search, any loss).

For a batch of B samples ∇W[k]/∇b[k] = Σ_m δ_{m,k} x_m / Σ_m δ_{m,k}: an affine
combination of the batch, not a sample.

An update after several local SGD steps (FedAvg) keeps eq. 4 exact at batch 1: the first layer's
input never changes, so ΔW = −η Σ_t δ_t xᵀ and Δb = −η Σ_t δ_t, and ΔW[k]/Δb[k] = x whatever the
steps, minibatches or epochs (the bias path only: eq. 5 needs δ of one step).  ``fc-inversion`` then returns the B
combinations of the B largest |∇b[k]| and says so in ``trace["recovered"]``.

The algebra (:func:`~leakbench.attacks.solvers.analytic.output_layer`, ``act_derivative``,
``act_inverse``) lives in :mod:`leakbench.attacks.solvers.analytic`, shared with R-GAP, the hybrid attack
and exclusivity; the reading of the observation in :mod:`leakbench.attacks.observed`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ...models.matrices import Chain, layer_chain
from ...threat import Observation
from ..solvers.analytic import (act_derivative, act_inverse, analytic_reasons, chain_or_reason, linear_input,
                                observed_output_layer, output_layer)
from ..base import Attack, Reconstruction, register
from ..labels import recover_labels
from ..observed import layer_gradients, param_index

__all__ = ["FCInversion", "FCOptions", "output_layer", "act_derivative", "act_inverse", "param_index",
           "analytic_reasons", "layer_gradients"]


# --------------------------------------------------------------------------- the attack


@dataclass
class FCOptions:
    """Options of ``fc-inversion``."""

    #: how to read x from ∇W = ∇b xᵀ (batch 1, with bias): the row of the largest |∇b[k]|
    #: ("largest", eq. 4) or the least-squares fit over every row ("all").
    rows: str = "largest"

    def check(self) -> None:
        if self.rows not in ("largest", "all"):
            raise ConfigError(f"expected rows in ('largest', 'all'), got {self.rows!r} (option rows)")


@register
class FCInversion(Attack):
    """Closed-form input of the first fully connected layer from its gradients (Lemma 3.1)."""

    name = "fc-inversion"
    tags = ("gradient", "update", "labels")
    Options = FCOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        reasons = analytic_reasons(obs, attack=self.name, batch_one=False, several_steps=True)
        chain, why = chain_or_reason(obs)
        if chain is None:
            return reasons + [why]
        first = chain.blocks[0]
        if first.kind != "linear":
            reasons.append("fc-inversion rebuilds the input of a first fully connected layer; this model starts "
                           f"with {type(first.layer).__name__} {first.name!r} (use rgap for conv nets)")
            return reasons
        index = param_index(obs)
        if id(first.layer.weight) not in index:
            reasons.append(f"the weight gradient of {first.name!r} is not shared")
        has_bias = first.layer.bias is not None and id(first.layer.bias) in index
        if not has_bias and obs.kind == "update" and obs.local_steps != 1:
            reasons.append(f"without a bias in the first layer fc-inversion needs the gradient of one step; got an "
                           f"update after {obs.local_steps} local steps")
        if not has_bias:
            if obs.batch_size != 1:
                reasons.append("without a bias in the first layer fc-inversion needs batch 1 (eq. 5)")
            if any(b.kind != "linear" for b in chain.blocks):
                reasons.append("without a bias in the first layer every layer must be fully connected (eq. 5)")
            if chain.blocks[-1].act != "identity":
                reasons.append("the last layer must output the logits (no activation after it)")
        return reasons

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        chain = layer_chain(obs.model, obs.input_shape)
        index = param_index(obs)
        grads = obs.gradients
        first = chain.blocks[0]
        gw, gb = layer_gradients(obs, first.layer, grads, index)
        B = obs.batch_size
        if gb is not None:
            order = gb.abs().argsort(descending=True)
            if B == 1 and self.options.rows == "all":
                x = (gb @ gw / gb.dot(gb))[None]  # least squares of ∇W ≈ ∇b xᵀ over every row
                picked = order[:1]
            else:
                picked = order[:B]
                x = gw[picked] / gb[picked, None]
            method = "bias (eq. 4)"
            labels = recover_labels(obs, seed=seed) if B == 1 or obs.labels is not None else None
        else:
            labels = recover_labels(obs, seed=seed)
            x, method = self._no_bias(obs, chain, grads, index, labels)[None], "upstream gradient (eq. 5)"
            picked = None
        images = x.to(obs.dtype).reshape(x.shape[0], *obs.input_shape)
        recovered = ("the batch-1 input, exact" if B == 1 else
                     f"{B} affine combinations Σ_m w_m x_m (Σ_m w_m = 1) of the batch's inputs, one per "
                     "neuron with the largest |∇b|; not individual samples")
        trace = {"method": method, "recovered": recovered, "exact": B == 1,
                 "neurons": None if picked is None else picked.tolist()}
        confidence = torch.ones(images.shape[0]) if B == 1 else torch.zeros(images.shape[0])
        return Reconstruction(images=images, labels=labels, confidence=confidence, trace=trace)

    @staticmethod
    def _no_bias(obs: Observation, chain: Chain, grads, index, labels) -> torch.Tensor:
        """Eq. (5): invert the layers from the output down, δ by back-propagation (eq. 3)."""
        blocks = chain.blocks
        solved = observed_output_layer(obs, chain, grads, index, labels)
        h, delta = solved.inputs, solved.delta
        for i in range(len(blocks) - 2, -1, -1):
            block, above = blocks[i], blocks[i + 1]
            gw_i, gb_i = layer_gradients(obs, block.layer, grads, index)
            upstream = above.layer.weight.detach().double().T @ delta
            delta = gb_i if gb_i is not None else act_derivative(block.act, h, block.slope) * upstream
            h = linear_input(gw_i, delta, block.name)
        return h
