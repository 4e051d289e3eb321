"""Deep Leakage from Gradients (Zhu, Liu & Han, NeurIPS 2019).

Dummy inputs and dummy soft labels drawn from N(0, 1) are optimised with L-BFGS
(lr 1) so that their gradient matches the shared one in squared L2 distance
(eq. 4 of the paper: ‖∇W′ − ∇W‖²), about 300 iterations, on the sigmoid LeNet.
Preset ``idlg`` is iDLG (Zhao et al. 2019): the label is read off the last
layer first and only the input is optimised.
"""
from __future__ import annotations

from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..labels import recover_labels
from ..solvers.batched_matching import solve_observations
from ..solvers.gradient_matching import GradientMatcher
from ..solvers.matching_settings import MatchingSettings

DLG_PAPER = dict(distance="l2", optimizer="lbfgs", lr=1.0, iterations=300, soft_labels=True, init="randn",
                 box=False, signed=False, schedule="none", tv=0.0, trace_every=10)


@register
class DLG(Attack):
    """Deep Leakage from Gradients: L-BFGS on the L2 gradient distance with dummy soft labels."""

    name = "dlg"
    tags = ("gradient", "update", "labels")
    matching = True
    Options = MatchingSettings
    presets = {
        "default": DLG_PAPER,
        "idlg": {**DLG_PAPER, "soft_labels": False},
        "quick": {**DLG_PAPER, "iterations": 40},
    }

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["dlg needs a shared gradient or update, not trained weights"]
        return []

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        labels = None if self.options.soft_labels else recover_labels(obs, seed=seed)
        result = GradientMatcher(obs, self.options).run(labels, seed=seed, callback=callback, progress=progress)
        return Reconstruction(images=result.images, labels=result.labels, trace=result.trace)

    def run_batch(self, observations, seeds, *, progress=None) -> list[Reconstruction | Exception]:
        """Independent problems in one stacked optimisation (:mod:`..batched_matching`)."""
        def prepare(obs, seed):
            return GradientMatcher(obs, self.options), None if self.options.soft_labels else recover_labels(obs, seed=seed)

        return [r if isinstance(r, Exception) else Reconstruction(images=r.images, labels=r.labels, trace=r.trace)
                for r in solve_observations(observations, seeds, prepare, progress=progress)]
