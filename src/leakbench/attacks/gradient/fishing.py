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
threshold (the construction's leak).  Not here: the paper's
multi-round binary search on the threshold (one round per observation in this library).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch

from ...errors import NothingRecovered, expect
from ...models.active import first_linear
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..observed import shared_gradient
from ..solvers.batched_matching import solve_observations
from ..solvers.gradient_matching import GradientMatcher
from ..solvers.matching_settings import INVERTING_PRESETS, MatchingSettings, MatchResult
from ..solvers.rows import RowOptions, read_rows

__all__ = ["Fishing", "FishingOptions", "fished_count", "fished_observation", "invert_fished"]

READOUTS = ("auto", "rows", "matching")
#: what a sweep scores (``trace["targeted"]``): the slots fishing claims (confidence > 0), not the whole batch —
#: the attack recovers the target class's samples and claims nothing about the rest
TARGETED = "the fished samples (the claimed slots), not the batch"
#: how far (in logits) the feature-fishing simulator lowers the target logit: p_target ≤ e^(−PIN + m·(φ_j − τ))
PIN = 1000.0


@dataclass
class FishingOptions(RowOptions):
    """Options of ``fishing``: the row read-out's (:class:`RowOptions`) and the matching read-out's."""

    #: ``auto`` (rows when the model starts with a ReLU FC layer, else matching), ``rows`` or ``matching``
    readout: str = "auto"
    #: the Inverting Gradients preset (``inverting-gradients``) that inverts the fished gradient at B = 1
    engine: str = "fast"
    #: overrides of that preset's iterations and restarts (None: the preset's)
    iterations: int | None = None
    restarts: int | None = None

    def check(self) -> None:
        super().check()
        expect(self.readout in READOUTS, f"expected readout in {READOUTS}, got {self.readout!r} (option readout)")
        expect(self.engine in INVERTING_PRESETS,
               f"expected engine one of {sorted(INVERTING_PRESETS)} (an inverting-gradients preset), got "
               f"{self.engine!r} (option engine)")
        for name in ("iterations", "restarts"):
            value = getattr(self, name)
            expect(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                   f"expected {name} an integer ≥ 1 or None (the preset's), got {value!r} (option {name})")

    def matching(self, input_shape: tuple[int, ...]) -> MatchingSettings:
        """The engine's settings: preset ``engine`` with the overrides (no TV prior on non-image inputs)."""
        chosen = dict(INVERTING_PRESETS[self.engine])
        chosen.update({k: v for k, v in (("iterations", self.iterations), ("restarts", self.restarts))
                       if v is not None})
        if len(input_shape) != 3:
            chosen["tv"] = 0.0
        return MatchingSettings(**chosen)


def _per_client(obs: Observation) -> int:
    """The B whose mean the shared gradient of one client is (its own batch under summed secure aggregation)."""
    secagg = (obs.extras.get("defense") or {}).get("secagg")
    if secagg is not None and secagg.get("reduce", "sum") == "sum":
        return int(obs.extras.get("client_batch_size", obs.batch_size))
    return int(obs.batch_size)


def fished_count(obs: Observation, head: str, target: int) -> float:
    """n̂_t = −B·∂L/∂b_target: the number of target-class samples the fished head's bias gradient implies."""
    bias = dict(obs.model.named_parameters()).get(f"{head}.bias")
    grad = None if bias is None else shared_gradient(obs, bias)
    if grad is None:
        return math.nan
    return float(-_per_client(obs) * grad.detach().double().reshape(-1)[target])


def fished_observation(obs: Observation, *, target: int, head: str) -> tuple[Observation, str]:
    """The B = 1 observation of the fished sample: the layers below ``head``, rescaled to one sample's gradient
    (see the module docstring), label ``target``; and a sentence on how exact that is."""
    skip = {f"{head}.weight", f"{head}.bias"}
    keep = [i for i, n in enumerate(obs.param_names) if n not in skip]
    expect(bool(keep), "fishing's matching read-out needs shared parameters below the final layer; only the "
           "final layer's are shared")
    per = _per_client(obs)
    names = [obs.param_names[i] for i in keep]
    note = "exact up to the e^(-margin) shares of the other samples"
    if obs.kind == "gradient":
        shared, lr, kind, steps = [obs.shared[i] * per for i in keep], 0.0, "gradient", 1
    elif not obs.local_batches or all(len(b) == obs.batch_size for b in obs.local_batches):
        # k full-batch steps of lr on the mean over B: the fished sample's own steps of lr/B
        shared, lr, kind, steps = [obs.shared[i] for i in keep], obs.local_lr / per, "update", obs.local_steps
    else:
        # minibatch epochs: the fished sample's minibatch is unknown, so the update is taken as the mean gradient
        grads = obs.gradients
        shared, lr, kind, steps = [grads[i] * per for i in keep], 0.0, "gradient", 1
        note = "approximate: minibatch epochs, matched as the mean gradient of the local steps"
    if obs.train_mode and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in obs.model.modules()):
        note = "approximate: batch norm in training mode normalises the batch together, the B = 1 simulation alone"
    if all(not bool(t.any()) for t in shared):
        raise NothingRecovered("fishing: the gradient below the fished head is exactly zero — no sample of the "
                               "batch passed the head (no target-class sample, or none below the feature threshold)")
    model = obs.model
    if getattr(model, "fishing_feature", None) is not None:
        # feature fishing: the fished sample passed because its p_target ≈ 0; the simulator pins p_target ≈ 0 for
        # every candidate (target bias lowered by PIN), so a candidate above the threshold still gets the gradient
        # −m·∇φ_j it must match instead of none (the shipped head would flatten the objective there)
        model = copy.deepcopy(model)
        with torch.no_grad():
            dict(model.named_parameters())[f"{head}.bias"][int(target)] -= PIN
        note += "; feature fishing: simulated with p_target pinned at ≈ 0 (the side the fished sample passed on)"
    sub = dataclasses.replace(
        obs, model=model, kind=kind, shared=shared, param_names=names, batch_size=1,
        labels=torch.tensor([int(target)], device=obs.device), bn_stats=None, local_steps=steps, local_lr=lr,
        local_batches=None, extras={k: v for k, v in obs.extras.items() if k not in ("client_batch_size",)})
    return sub, note


def invert_fished(obs: Observation, *, target: int, head: str, settings: MatchingSettings, seed: int = 0,
                  callback=None, progress=None) -> tuple[MatchResult, str]:
    """Invert ``obs``'s gradient below ``head`` as one sample of class ``target`` (Wen et al.'s read-out)."""
    sub, note = fished_observation(obs, target=target, head=head)
    result = GradientMatcher(sub, settings).run(sub.labels, seed=seed, callback=callback, progress=progress)
    return result, note


def _feature_trace(model) -> dict:
    """The feature-fishing head's choice (feature, threshold, quantile), or nothing for class fishing."""
    if getattr(model, "fishing_feature", None) is None:
        return {}
    return {"fished_feature": int(model.fishing_feature), "fished_threshold": float(model.fishing_threshold),
            "fished_quantile": float(model.fishing_quantile)}


@register
class Fishing(Attack):
    """Class fishing: the target class's samples, read from the first FC layer's rows or by gradient matching."""

    name = "fishing"
    tags = ("gradient", "update", "labels", "modified-model")
    Options = FishingOptions
    preset_revisions = {"default": 2, "quick": 2}  # 1: the matching read-out's options (engine, readout, …);
    # 2: trials scored on the fished (claimed) slots, trace["targeted"]
    presets = {"quick": {"engine": "quick"}}

    def _readout(self, obs: Observation) -> tuple[str, object]:
        """(``rows`` or ``matching``, the first FC layer or why there is none)."""
        found = first_linear(obs.model, obs.input_shape)
        if self.options.readout == "auto":
            return ("matching" if isinstance(found, str) else "rows"), found
        return self.options.readout, found

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["fishing needs a shared gradient or update, not trained weights"]
        if getattr(obs.model, "fishing_target", None) is None:
            return ["fishing needs the server's class-fishing head: ship leakbench.models.active.fishing(model, "
                    "target=c) and observe that model"]
        readout, found = self._readout(obs)
        if readout == "rows":
            if isinstance(found, str):
                return [f"fishing's row read-out needs a first fully connected layer with bias and a ReLU, but "
                        f"{found} (option readout='matching' inverts the fished gradient instead)"]
            if shared_gradient(obs, found[1].weight) is None or shared_gradient(obs, found[1].bias) is None:
                return ["the first layer's weight and bias are not among the shared parameters"]
            return []
        head = getattr(obs.model, "fishing_head", None)
        if head is None:
            return ["fishing's matching read-out needs the fished head's name: ship the model with "
                    "leakbench.models.active.fishing (it records shipped.fishing_head)"]
        if not [n for n in obs.param_names if n not in (f"{head}.weight", f"{head}.bias")]:
            return ["fishing's matching read-out needs shared parameters below the final layer"]
        return []

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        target = int(obs.model.fishing_target)
        readout, found = self._readout(obs)
        if readout == "rows":
            rec = read_rows(obs, found[1], self.options, name=self.name, labels=torch.tensor([target]))
            rec.trace.update(fished_class=target, readout="rows", targeted=TARGETED, **_feature_trace(obs.model))
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
            **_feature_trace(obs.model))
        if "fished_feature" in trace:
            trace["fished_count_note"] = ("feature fishing: n̂ = −B·∂L/∂b_target = (target samples below the "
                                          "threshold) − (other-class samples above it), each weighted by its share")
        if obs.labels is not None:
            hard = obs.labels if obs.labels.dim() == 1 else obs.labels.argmax(-1)
            trace["fished_count_granted"] = int((hard == target).sum())
        return Reconstruction(images=images.detach(), confidence=confidence, trace=trace)
