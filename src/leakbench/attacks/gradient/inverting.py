"""Inverting Gradients (Geiping, Bauermeister, Dröge & Moeller, NeurIPS 2020).

Minimise 1 − cos(∇θ L(x̂, y), ∇θ L(x, y)) + α_TV·TV(x̂) (eq. 4 of the paper)
over x̂ in the data box, with Adam on the *signed* gradient, lr 0.1 decayed ×0.1
at 3/8, 5/8 and 7/8 of the run, the box constraint enforced after each step, and
several restarts keeping the one whose gradient matches best.  The paper optimises
standardised images, so its step 0.1 and its N(0, 1) start are in units of the data's
σ: a step moves a [0, 1] pixel by about 0.025, not 0.1.  ``step_unit="normalised"``
reproduces this with σ taken as a quarter of the data box.  Labels are
granted or recovered first (iDLG for one sample, counts for batches).  For an
update observation the local steps are simulated (Sec. 5 of the paper).

Presets: ``default`` (the paper's settings: 4 800 iterations, one restart),
``paper-long`` (24 000 iterations, 8 restarts, as for trained ResNets),
``quick`` (a test budget), ``trained`` (``fast`` with a strong fixed TV prior, for confidently trained
networks), ``fast`` (tuned for time-to-quality: a 4× lighter TV weight at B = 1 that grows
as B^(2/3), a cosine step schedule over 500 steps, a quieter start, and — beyond the paper — a term matching
the output layer's inputs, which the paper's Sec. 3 notes a fully connected layer's gradient reveals: with
the labels known, :mod:`~leakbench.attacks.solvers.last_layer` recovers the mean feature vector of each label's
images exactly, and ``features`` weighs ‖mean φ(x̂) − recovered‖²/‖recovered‖² per label, the first
``feature_phase`` of the steps matching those features alone (no simulated gradient, about a third of a
step's cost).  ``benchmarks/bench_inverting.py`` measures its gain, ``benchmarks/bench_peers.py`` compares
it with breaching's Inverting Gradients at B = 1, 4 and 8.)
"""
from __future__ import annotations

import dataclasses

from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..labels import recover_labels
from ..solvers.batched_matching import solve_observations
from ..solvers.gradient_matching import GradientMatcher
from ..solvers.matching_settings import INVERTING_PRESETS, MatchingSettings

@register
class InvertingGradients(Attack):
    """Inverting Gradients: signed Adam on 1 − cosine gradient similarity + TV, box-constrained, restarts."""

    name = "inverting-gradients"
    tags = ("gradient", "update", "labels")
    matching = True
    Options = MatchingSettings
    preset_revisions = {"fast": 5}  # 2: α_TV grows with the batch (tv_growth); 3: output-layer features from B = 2;
    # 4: the feature solve holds its scale at 1 first and starts per label (recovers trained nets' features);
    # 5: the feature term only on labels of at most two images (features_max_images)
    presets = INVERTING_PRESETS

    def requirements(self, obs: Observation) -> list[str]:
        reasons = []
        if obs.kind == "weights":
            reasons.append("inverting-gradients needs a shared gradient or update, not trained weights")
        if len(obs.input_shape) != 3 and self.options.tv > 0:
            reasons.append("the TV prior needs image inputs C×H×W; set tv=0 for vector data")
        return reasons

    def settings_for(self, obs: Observation) -> MatchingSettings:
        """The matching settings this observation is solved with (here the options as given)."""
        return self.options

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        labels = recover_labels(obs, seed=seed)
        result = GradientMatcher(obs, self.settings_for(obs)).run(labels, seed=seed, callback=callback,
                                                                  progress=progress)
        return Reconstruction(images=result.images, labels=result.labels, trace=result.trace)

    def run_batch(self, observations, seeds, *, progress=None) -> list[Reconstruction | Exception]:
        """Independent problems in one stacked optimisation (:mod:`..batched_matching`)."""
        def prepare(obs, seed):
            return GradientMatcher(obs, self.options), recover_labels(obs, seed=seed)

        return [r if isinstance(r, Exception) else Reconstruction(images=r.images, labels=r.labels, trace=r.trace)
                for r in solve_observations(observations, seeds, prepare, progress=progress)]


#: GradInversion's settings (Yin et al. 2021): Inverting Gradients' ``trained`` preset (the strong TV prior for
#: trained networks, the output-layer features) with four groups pulled towards their consensus and the BN prior
#: (used only when the observation grants the batch's statistics; α_BN 0.01 as ``gias``'s tuned BN weight on
#: CIFAR-10).  α_group chosen on the tuning pool of ``benchmarks/bench_learned_prior.py`` (CIFAR-10 16 × 16,
#: convnet-16 at accuracy 0.35, B = 4, labels and BN statistics, four batches, dB over grey): 0 (the best of four
#: independent restarts) −0.97, 0.01 −1.26 (the term ~15× weaker than TV's per pixel: no effect), 1.0 +0.15, higher
#: than 0 on 4 of 4 batches.  The report-pool rows are in docs/cli.md.
GRADINVERSION_PRESETS = {
    "default": {**INVERTING_PRESETS["trained"], "restarts": 4, "group": 1.0, "bn": 0.01},
    "quick": {**INVERTING_PRESETS["quick"], "restarts": 2, "group": 1.0, "bn": 0.01, "iterations": 100},
}


@register
class GradInversion(InvertingGradients):
    """GradInversion (Yin et al. CVPR 2021): gradient matching with fidelity priors (TV, BN statistics) and the group
    consistency of G jointly optimised runs (:mod:`~leakbench.attacks.solvers.group_matching`).  Labels are
    granted or recovered from the output layer (the paper's batch label restoration, :mod:`..labels`)."""

    name = "gradinversion"
    tags = ("gradient", "update", "labels", "bn-stats")
    preset_revisions = {}
    presets = GRADINVERSION_PRESETS

    run_batch = Attack.run_batch    # one problem at a time: a problem's groups are already optimised together

    def settings_for(self, obs: Observation) -> MatchingSettings:
        """The BN prior where the observation grants the batch's statistics, else off."""
        return self.options if obs.bn_stats is not None else dataclasses.replace(self.options, bn=0.0)

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        rec = super().run(obs, seed=seed, callback=callback, progress=progress)
        bn = self.settings_for(obs).bn
        rec.trace["bn_prior"] = bn if bn else "off: the observation grants no BN statistics"
        return rec
