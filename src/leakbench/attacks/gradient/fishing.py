"""Fishing for user data (Wen, Geiping, Fowl, Goldblum & Goldstein, ICML 2022): class fishing and its read-outs.

The server ships :func:`leakbench.models.active.fishing`: the final layer keeps the target class's row and
gives every other class a zero row and one large bias, so the gradient that reaches the body of the network is
that of the batch's target-class samples alone (Sec. 3, "gradient magnification": every other sample's share is
scaled by p_target ≤ e^(−margin)).  Two read-outs of that gradient:

- ``rows`` — on a model whose first layer is fully connected (with bias, then a ReLU) we read it exactly: a
  fished sample that alone among the fished ones activates a row k is ∇W_k / ∇b_k
  (:mod:`leakbench.attacks.solvers.rows`, the same reading as ``trap-weights``).  The lone check tries the
  target class only; the slots beyond the fished ones are mixtures (confidence 0).
- ``matching`` — what Wen et al. do themselves (Sec. 3–4): the magnified gradient is ≈ the gradient of the
  target-class sample alone, so it is inverted by gradient matching as a batch of one, label = the target class
  (the server chose it).  The engine is Inverting Gradients' (:mod:`..solvers.gradient_matching`, preset
  ``engine``).  The final layer's gradient is left out of the match: its non-target rows still get
  (p_j − 1[y = j])·z from every sample of the batch (their weights are zero, not their gradients), so only the
  layers below it carry the target sample alone.  The observed gradient of the mean loss over B samples is
  (1/B)·∇ℓ(x_target): it is scaled by B (for an update, the local step by 1/B) so that the B = 1 simulation
  matches it exactly up to the e^(−margin) shares.  Slot 0 is the fished sample (confidence 1); the other
  slots are not claimed (the grey image, confidence 0).

``auto`` picks ``rows`` when the model has the first FC layer, else ``matching``.  How many target-class samples
the batch holds the server does not see (the labels are the client's); it is estimated from the fished head:
every sample has p_target ≤ e^(−margin), so the target bias gradient of the mean loss is
∂L/∂b_t = (1/B)·Σ_i (p_t,i − 1[y_i = t]) = −n_t/B + O(e^(−margin)), and n̂_t = −B·∂L/∂b_t (B per client under
summed secure aggregation).  This follows from the construction, not from a claim of the paper.  With n̂_t > 1
the B = 1 inversion fits one image to the sum of several samples' gradients (a mixture, as Wen et al. note).

Feature fishing (Sec. 3.2, :func:`leakbench.models.active.feature_fishing`, the single-round variant) ships a head
whose target gradient passes only for target-class samples with feature φ_j below a threshold; both read-outs
apply (the gradient below the head is then m·(p_t − 1[y = t])·∇φ_j; the matching read-out simulates candidates
with p_t pinned at ≈ 0, the side the fished sample passed on, so that a candidate above the threshold is not
left without a gradient), and n̂ counts the passing target samples minus the other-class samples above the
threshold (the construction's leak).  The paper's multi-round search on the threshold is
:mod:`leakbench.attacks.gradient.fishing_rounds`.
"""
from __future__ import annotations

import torch

from ...threat import Observation
from ..base import Reconstruction, register
from ..solvers.batched_matching import solve_observations
from ..solvers.fishing_base import (TARGETED, FishedAttack, FishingOptions, feature_trace, fished_count,
                                    fished_observation, invert_fished)
from ..solvers.gradient_matching import GradientMatcher
from ..solvers.matching_settings import MatchResult
from ..solvers.rows import read_rows

__all__ = ["Fishing", "FishingOptions", "fished_count", "fished_observation", "invert_fished"]


@register
class Fishing(FishedAttack):
    """Class fishing: the target class's samples, read from the first FC layer's rows or by gradient matching."""

    name = "fishing"
    tags = ("gradient", "update", "labels", "modified-model")
    Options = FishingOptions
    preset_revisions = {"default": 2, "quick": 2}  # 1: the matching read-out's options (engine, readout, …);
    # 2: trials scored on the fished (claimed) slots, trace["targeted"]
    presets = {"quick": {"engine": "quick"}}

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        target = int(obs.model.fishing_target)
        readout, found = self._readout(obs)
        if readout == "rows":
            rec = read_rows(obs, found[1], self.options, name=self.name, labels=torch.tensor([target]))
            rec.trace.update(fished_class=target, readout="rows", targeted=TARGETED, **feature_trace(obs.model))
            if progress is not None:
                progress(1, 1, 0.0)
            return rec
        result, note = invert_fished(obs, target=target, head=obs.model.fishing_head,
                                     settings=self.options.matching(obs.input_shape), seed=seed, callback=callback,
                                     progress=progress)
        return self._package(obs, result, note)

    def run_batch(self, observations, seeds, *, progress=None) -> list[Reconstruction | Exception]:
        """The matching read-outs of observations of one fished model in one stacked optimisation
        (:mod:`..solvers.batched_matching`); row read-outs one after the other."""
        out: list[Reconstruction | Exception | None] = [None] * len(observations)
        stacked = [i for i, o in enumerate(observations) if self._readout(o)[0] == "matching"]
        for i, (obs, seed) in enumerate(zip(observations, seeds)):
            if i not in stacked:
                out[i] = super().run_batch([obs], [seed], progress=progress)[0]
        notes: dict[int, str] = {}

        def prepare(obs, seed):
            sub, notes[id(obs)] = fished_observation(obs, target=int(obs.model.fishing_target),
                                                     head=obs.model.fishing_head)
            return GradientMatcher(sub, self.options.matching(obs.input_shape)), sub.labels

        chosen = [observations[i] for i in stacked]
        solved = solve_observations(chosen, [seeds[i] for i in stacked], prepare, progress=progress)
        for i, obs, result in zip(stacked, chosen, solved):
            out[i] = result if isinstance(result, Exception) else self._package(obs, result, notes[id(obs)])
        return out  # type: ignore[return-value]

    def _package(self, obs: Observation, result: MatchResult, note: str) -> Reconstruction:
        """Slot 0 the inverted fished sample, the others the grey image (not claimed); the trace."""
        target, head = int(obs.model.fishing_target), obs.model.fishing_head
        lo, hi = obs.data_range
        images = torch.full((obs.batch_size, *obs.input_shape), (lo + hi) / 2, dtype=result.images.dtype,
                            device=result.images.device)
        images[0] = result.images[0]
        confidence = torch.zeros(obs.batch_size, dtype=obs.dtype, device=obs.device)
        confidence[0] = 1.0
        trace = dict(result.trace)
        trace.update(
            fished_class=target, readout="matching", engine=self.options.engine, match=note, targeted=TARGETED,
            fished_count_estimate=fished_count(obs, head, target),
            fished_count_note="the server does not see the labels: n̂ = −B·∂L/∂b_target from the fished head "
                              "(exact up to e^(−margin) per sample); with n̂ > 1 slot 0 fits a mixture",
            confidence="slot 0: the fished sample, inverted at B = 1; the others are not claimed (grey, 0)",
            **feature_trace(obs.model))
        if "fished_feature" in trace:
            trace["fished_count_note"] = ("feature fishing: n̂ = −B·∂L/∂b_target = (target samples below the "
                                          "threshold) − (other-class samples above it), each weighted by its share")
        if obs.labels is not None:
            hard = obs.labels if obs.labels.dim() == 1 else obs.labels.argmax(-1)
            trace["fished_count_granted"] = int((hard == target).sum())
        return Reconstruction(images=images.detach(), confidence=confidence, trace=trace)
