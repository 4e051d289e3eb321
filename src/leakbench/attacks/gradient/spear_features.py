"""SPEAR inside a ConvNet: a hidden ReLU FC layer's inputs (the batch's features) exactly, then the images.

SPEAR (Dimitrov, Baader, Müller & Vechev, NeurIPS 2024, Sec. 3) holds for *any* ReLU linear layer Z = X Wᵀ + b:
∂L/∂W = Δᵀ X has rank B (Theorem 3.1), ∂L/∂W = L R gives X = Q⁻¹ R (Theorem 3.2) and the ReLU's zeros fix the
columns of Q (Theorem 3.3) — X is whatever the layer receives.  In a ConvNet whose convolutions are followed by a
ReLU fully connected layer, X is the batch's features: :class:`~.spear.Spear` runs unchanged (through the registry) on the model from
that layer on (its weights and the shared gradients of those weights), with the features' range bounded by
interval arithmetic through the known convolutions (:func:`~..solvers.feature_inversion.feature_bounds`).  Its
certificates carry over: a certified feature vector is exact to the observation's precision.

The images then come from the features through the known layers before (issue 46; Cocktail Party, Kariyappa et al.
ICML 2023, and Liu et al. 2024 invert features by optimisation): :func:`~..solvers.feature_inversion.invert_features`
solves each layer's rows exactly by least squares where they determine its input (full column rank), and matches
features by Adam where they do not.  A sample's ``confidence`` is 1 only when its features are certified *and* its
image is exact (full rank at every layer, features reproduced to ``tol``); ``trace`` holds the feature-level
certificates (``features_certified``) and each layer's solve.

Limits, said in ``requirements``: the layer must be the first fully connected layer with a ReLU after at least one
convolution (a first-layer FC is :class:`~.spear.Spear`'s case), with its weight and bias gradients shared; the
features must span rank B (B ≤ their dimension) and the layer needs ≥ 2B neurons; the gradient of one step
(after several local steps the convolutions moved, so the layer saw several feature batches).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


from ...errors import expect
from ...models.matrices import Chain
from ...threat import Observation
from ..base import Attack, Reconstruction, create, register
from ..observed import param_index
from ..solvers.analytic import analytic_reasons, chain_or_reason
from ..solvers.feature_inversion import feature_bounds, invert_features
from ..solvers.spear_options import SpearOptions

__all__ = ["SpearFeatures", "SpearFeaturesOptions", "feature_observation"]


@dataclass
class SpearFeaturesOptions(SpearOptions):
    """``spear``'s options for the features, then the image inversion's."""

    #: Adam steps matching features for samples whose image the least squares does not determine (0 = none).
    steps: int = 500
    #: Adam's step, as a fraction of the data range.
    lr: float = 0.05
    #: relative feature residual below which an image of full-rank layers counts as exact.
    image_tol: float = 1e-6

    def check(self) -> None:
        super().check()
        expect(self.steps >= 0, f"expected steps ≥ 0, got {self.steps} (option steps)")
        expect(self.lr > 0, f"expected lr > 0, got {self.lr} (option lr)")
        expect(0 < self.image_tol < 1, f"expected 0 < image_tol < 1, got {self.image_tol} (option image_tol)")


def _hidden_fc(chain: Chain) -> int | None:
    """The index of the first Linear block with a ReLU that follows a convolution, or None."""
    for i, block in enumerate(chain.blocks):
        if block.kind == "linear":
            return i if i > 0 and block.act == "relu" else None
    return None


def feature_observation(obs: Observation, chain: Chain, block: int) -> Observation:
    """The observation as the model from ``block`` on sees it: its inputs are the features, its parameters (the
    same tensors) and their shared gradients are those of the layers from ``block`` on."""
    tail = chain.tail(block)
    index = param_index(obs)
    names, shared = [], []
    for name, p in tail.named_parameters():
        if id(p) in index:
            names.append(name)
            shared.append(obs.shared[index[id(p)]])
    return dataclasses.replace(obs, model=tail, shared=shared, param_names=names,
                               input_shape=tuple(chain.blocks[block].input_shape),
                               data_range=feature_bounds(chain, block, obs.data_range), bn_stats=None,
                               extras={**obs.extras, "features_of": chain.blocks[block].name})


@register
class SpearFeatures(Attack):
    """SPEAR on a ConvNet's hidden ReLU FC layer: the batch's features exactly, then the images through the convs."""

    name = "spear-features"
    tags = ("gradient", "update")
    Options = SpearFeaturesOptions
    presets = {"quick": {"rounds": 2, "steps": 200}}
    preset_revisions = {"default": 6, "quick": 6}  # 1: spear's revision 2 inside (an update's round-off); 2: its 3;
    # 3: its 4; 4: its 5; 5: its 6; 6: its 7

    def requirements(self, obs: Observation) -> list[str]:
        reasons = analytic_reasons(obs, attack=self.name, batch_one=False)
        chain, why = chain_or_reason(obs)
        if chain is None:
            return reasons + [why]
        block = _hidden_fc(chain)
        if block is None:
            first = next((b for b in chain.blocks if b.kind == "linear"), None)
            where = ("its first fully connected layer is the model's first layer (use spear)" if chain.blocks[0].kind
                     == "linear" else f"its first fully connected layer {first.name!r} has activation {first.act!r}"
                     if first is not None else "it has no fully connected layer")
            return reasons + [f"spear-features needs a ReLU fully connected layer after the convolutions; {where}"]
        if reasons:
            return reasons
        sub = feature_observation(obs, chain, block)
        return [f"at the features of {chain.blocks[block].name!r}: {r}" for r in create("spear", **self._spear()).requirements(sub)]

    def _spear(self) -> dict:
        return {f.name: getattr(self.options, f.name) for f in dataclasses.fields(SpearOptions)}

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        o = self.options
        chain = chain_or_reason(obs)[0]
        block = _hidden_fc(chain)
        sub = feature_observation(obs, chain, block)
        feats = create("spear", **self._spear()).run(sub, seed=seed, progress=progress)
        z = feats.images.reshape(obs.batch_size, -1).double()
        certified = feats.confidence.bool()
        inv = invert_features(chain, block, z, obs.data_range, tol=o.image_tol, steps=o.steps, lr=o.lr, seed=seed)
        trace = dict(feats.trace)
        trace.update({"features_of": chain.blocks[block].name, "feature_range": list(sub.data_range),
                      "features_certified": certified.tolist(), "inversion": inv.layers,
                      "feature_residual": inv.residual.tolist(), "image_exact": inv.exact.tolist()})
        confidence = (certified & inv.exact).to(obs.dtype)
        images = inv.images.reshape(obs.batch_size, *obs.input_shape).to(obs.dtype)
        return Reconstruction(images=images, labels=feats.labels, confidence=confidence, trace=trace)
