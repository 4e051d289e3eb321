"""The tensor method of Wang, Lee & Lei (2023) as used by Liu et al. (2024, Sec. 3, App. B.1, B.4).

For a two-layer block f(z) = Σ_j a_j σ(w_jᵀz) with w_j ~ N(0, I), the gradients g(w_j) with respect to
the a_j give, by Stein's lemma (eq. 5), empirical moments P̂ (eq. 6) and T̂ (eq. 8) whose low-rank
factors are the block's unit-norm inputs z_i (eqs. 7, 9).  The maths (moments, Hermite orders, the
decomposition, the sign) is in :mod:`leakbench.attacks.solvers.tensor_moments`, whose docstring gives the steps: (1) the span of the features
from the top-B eigenvectors of P̂, (2) Jennrich's simultaneous diagonalisation of the projected slices
refined by L-BFGS, (3) unit-norm features with their sign from the first-order moment where k₂ = 2.
The block and feature inversion are in :mod:`leakbench.attacks.solvers.feature_blocks`.  The error grows as
B·sqrt(d/m) (Theorem 3.1).

Blocks: a :class:`~leakbench.models.TwoLayer` model without hidden bias and with Gaussian
first-layer weights (``init="gaussian"``) — the features are the inputs, and the attack
returns them as images — or the :class:`~leakbench.models.malicious.RandomFeatureHead` of
Liu et al.'s App. F inside a deeper model (``random_head``) — the features are the head's
inputs and the images come from feature inversion (1 − cos² between f(x̂_i) and ẑ_i, + TV).
Features are in ``rec.trace["features"]``; :func:`block_input` gives the true ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import expect
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..solvers.feature_blocks import TensorBlock, block_requirements, find_block, invert_features
from ..observed import attacker_model, block_input, shared_gradient
from ..solvers.tensor_moments import TensorFeatureResult, hermite_coefficients, hermite_orders, tensor_features

__all__ = ["TensorBlock", "find_block", "shared_gradient", "block_input", "hermite_coefficients",
           "hermite_orders", "tensor_features", "TensorFeatureResult", "invert_features", "attacker_model",
           "block_requirements", "TensorFeatures", "TensorOptions"]


@dataclass
class TensorOptions:
    """Options of ``tensor-features``."""

    trials: int = 16              # Jennrich draws (best fit kept)
    refine: int = 100             # L-BFGS iterations polishing the decomposition
    directions: int = 3           # random contraction vectors for a fourth-order tensor (ReLU)
    inversion_iterations: int = 500   # feature inversion inside a deeper model
    inversion_lr: float = 0.1
    tv: float = 1e-2

    def check(self) -> None:
        expect(self.trials >= 1, f"expected trials ≥ 1, got {self.trials} (option trials)")
        expect(self.refine >= 0 and self.directions >= 1 and self.inversion_iterations >= 0,
               "expected refine ≥ 0, directions ≥ 1, inversion_iterations ≥ 0")
        expect(self.inversion_lr > 0 and self.tv >= 0, "expected inversion_lr > 0 and tv ≥ 0")


@register
class TensorFeatures(Attack):
    """Tensor method (Wang et al. 2023): unit-norm features of a random two-layer block by tensor decomposition."""

    name = "tensor-features"
    tags = ("gradient", "update", "modified-model")
    Options = TensorOptions
    presets = {"quick": {"trials": 8, "refine": 50, "inversion_iterations": 200}}

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["tensor-features needs a shared gradient or update, not trained weights"]
        return block_requirements(obs, self.name)

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        block = find_block(obs.model)
        o = self.options
        result = tensor_features(block.first, shared_gradient(obs, block.second), block.act, obs.batch_size,
                                 seed=seed, trials=o.trials, refine=o.refine, directions=o.directions)
        trace = {"features": result.features, "feature_orders": result.orders,
                 "decomposition_residual": result.residual, "span_eigenvalues": result.eigenvalues.tolist(),
                 "feature_signs": "first moment" if result.signed else "positive sum"}
        if block.on_input:
            images = result.features.reshape(obs.batch_size, *obs.input_shape)
        else:
            images = invert_features(obs, block.feature_module, result.features, iterations=o.inversion_iterations,
                                     lr=o.inversion_lr, tv=o.tv, seed=seed, progress=progress)
        return Reconstruction(images=images, trace=trace)
