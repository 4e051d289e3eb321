"""What the attacks on a fishing head share (Wen, Geiping, Fowl, Goldblum & Goldstein, ICML 2022;
:mod:`leakbench.attacks.gradient.fishing` and :mod:`~leakbench.attacks.gradient.fishing_rounds`): the read-out
options, the count of fished samples from the head's bias gradient, the B = 1 observation of a fished gradient and
its inversion, and the base class choosing the read-out (rows of a first FC layer, or gradient matching)."""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch

from ...errors import NothingRecovered, expect
from ...models.active import first_linear
from ...threat import Observation
from ..base import Attack
from ..observed import shared_gradient
from .gradient_matching import GradientMatcher
from .matching_settings import INVERTING_PRESETS, MatchingSettings, MatchResult
from .rows import RowOptions

__all__ = ["FishingOptions", "FishedAttack", "READOUTS", "TARGETED", "PIN", "per_client", "fished_count",
           "fished_observation", "invert_fished", "feature_trace"]

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


def per_client(obs: Observation) -> int:
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
    return float(-per_client(obs) * grad.detach().double().reshape(-1)[target])


def fished_observation(obs: Observation, *, target: int, head: str) -> tuple[Observation, str]:
    """The B = 1 observation of the fished sample: the layers below ``head``, rescaled to one sample's gradient
    (see the module docstring), label ``target``; and a sentence on how exact that is."""
    skip = {f"{head}.weight", f"{head}.bias"}
    keep = [i for i, n in enumerate(obs.param_names) if n not in skip]
    expect(bool(keep), "fishing's matching read-out needs shared parameters below the final layer; only the "
           "final layer's are shared")
    per = per_client(obs)
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


def feature_trace(model) -> dict:
    """The feature-fishing head's choice (feature, threshold, quantile), or nothing for class fishing."""
    if getattr(model, "fishing_feature", None) is None:
        return {}
    return {"fished_feature": int(model.fishing_feature), "fished_threshold": float(model.fishing_threshold),
            "fished_quantile": float(model.fishing_quantile)}


class FishedAttack(Attack):
    """An attack on a fishing head: the read-out it takes and what that read-out needs."""

    Options = FishingOptions

    def _readout(self, obs: Observation) -> tuple[str, object]:
        """(``rows`` or ``matching``, the first FC layer or why there is none)."""
        found = first_linear(obs.model, obs.input_shape)
        if self.options.readout == "auto":
            return ("matching" if isinstance(found, str) else "rows"), found
        return self.options.readout, found

    def requirements(self, obs: Observation) -> list[str]:
        """The fishing head's and the chosen read-out's needs (each attack adds its own before these)."""
        if obs.kind == "weights":
            return [f"{self.name} needs a shared gradient or update, not trained weights"]
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
