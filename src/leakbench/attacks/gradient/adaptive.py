"""Adaptive attacks: gradient matching that knows the defense of :mod:`leakbench.defenses.literature`.

Each carries the threat tag ``adaptive`` and names the defense families it adapts to (``adapts_to``);
it refuses an observation made under another defense (the spec in ``Observation.defense`` is what the
server knows).  All run Inverting Gradients' objective (Geiping et al. 2020, eq. 4) through
:class:`~leakbench.attacks.solvers.gradient_matching.GradientMatcher`; the output-layer feature term is off
(``features=0``), because soteria, topk and the mixing defenses all change the output layer's gradient
it would be read from.

- ``soteria-adaptive`` — Soteria zeroes the columns of the FC weight's gradient that belong to the pruned
  representation elements, leaving every other entry exact.  The attack matches only what Soteria leaves
  intact: the simulated gradient is multiplied by the mask of the FC weight's non-zero columns in the
  observation (the other tensors are matched whole), so the true batch has distance 0.
- ``topk-adaptive`` — masked gradient matching on the support that was sent: the simulated gradient is
  multiplied by the observation's non-zero pattern (what top-k kept), so the matched entries are the sent
  ones.  With error feedback the sent values also hold the residual of earlier rounds, which the server
  does not know; a fresh observation's residual is 0, and then the true batch has distance 0.
- ``mixup-adaptive`` — the mixing coefficients as unknowns.  The gradient of MixUp is the plain gradient
  at the mixed inputs x̃ = M x with soft labels ỹ = M Y (M: B × B, rows of coefficients).  Stage 1 matches
  inputs and soft labels together (labels as softmax logits, DLG's soft labels) and so recovers x̃ and ỹ;
  stage 2 reads the coefficients off the labels, M̂ = ỹ Y⁺ with Y the one-hot labels of the batch (granted
  or recovered), rows clipped to ≥ 0 and renormalised (exact for distinct labels; shared labels split
  their share evenly, the least-squares solution); stage 3 un-mixes, x̂ = argmin ‖M̂ x − x̃‖² + ρ‖x − x̃‖²
  (ρ = ``ridge``: a singular M̂, e.g. λ = ½ on a swapped pair, keeps the mixed images there).
- ``instahide-carlini`` — Carlini, Deng, Garg, Jha, Mahloujifar, Mahmoody, Song, Thakurta & Tramèr
  (IEEE S&P 2021), "Is private learning possible with instance encoding?", the attack on InstaHide.  Their
  attack has three steps over a whole training set: (i) a learned similarity between encodings, (ii) a
  clustering assigning encodings to the private images they share, (iii) recovering each private image
  from the absolute values of its encodings, |x̃ − m| = |Σ_j λ_j (x_j − m)|, which the one-time sign mask
  cannot hide.  At one round's scale, (i)–(ii) are replaced by what the gradient reveals: stage 1 above
  recovers the encodings and their soft labels, and the coefficients M̂ follow from the labels as for MixUp
  (an assignment that Carlini et al. obtain from clustering).  Step (iii) is theirs: minimise
  Σ_i ‖ |M̂_i c| − |x̃_i − m| ‖² over the centred images c by Adam, from the least-squares solution of
  M̂ c = |x̃ − m|.  |M c| = |M(−c)| pixel by pixel, so the sign of each pixel's column of c is not
  identifiable from the encodings; a TV prior (weight ``tv_unmix``, ours) picks the sign that makes the
  images smooth, and the global negative (c → −c, equally smooth) is chosen by the data's mean pixel when the
  attacker knows it (``prior_mean``, from public data of the task).  MixUp's M̂ is further projected on its
  structure (one λ per step, one partner per image: :func:`mixup_structure`).  What is not done: (i) and
  (ii) across rounds, and the cross-dataset variant (public images mixed in).  On images whose pixels sit at
  the box's ends (digits: 0 or 1) the absolute encodings hold almost nothing: |0 − ½| = |1 − ½|.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from ...defenses.literature import representation_layer
from ...errors import expect
from ...threat import Observation
from ..base import Reconstruction, register
from ..solvers.gradient_matching import GradientMatcher, MaskedMatcher
from ..solvers.adaptive_base import MATCH_PRESETS, AdaptiveAttack
from ..solvers.matching_settings import MatchingSettings
from ..labels import recover_labels
from ..solvers.objectives import total_variation

class _Masked(AdaptiveAttack):
    Options = MatchingSettings
    presets = MATCH_PRESETS

    @abc.abstractmethod
    def masks(self, obs: Observation) -> list[torch.Tensor]:
        """Per shared tensor, 1 where the defense sent the entry and 0 where it did not."""

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        labels = recover_labels(obs, seed=seed)
        masks = self.masks(obs)
        result = MaskedMatcher(obs, self.options, masks).run(labels, seed=seed, callback=callback, progress=progress)
        result.trace["matched_entries"] = int(sum(float(m.sum()) for m in masks))
        return Reconstruction(images=result.images, labels=result.labels, trace=result.trace)


@register
class SoteriaAdaptive(_Masked):
    """Matching only the gradient entries Soteria leaves intact (the FC weight's pruned columns masked out)."""

    name = "soteria-adaptive"
    tags = ("gradient", "labels", "adaptive")
    adapts_to = ("soteria",)

    def masks(self, obs):
        name, _ = representation_layer(obs.model, list(obs.param_names))
        masks = [torch.ones_like(t) for t in obs.shared]
        k = list(obs.param_names).index(f"{name}.weight")
        masks[k] = (obs.shared[k] != 0).any(0, keepdim=True).expand_as(obs.shared[k]).to(obs.shared[k].dtype)
        return masks


@register
class TopKAdaptive(_Masked):
    """Masked gradient matching on the support top-k sent (the observation's non-zero entries)."""

    name = "topk-adaptive"
    tags = ("gradient", "labels", "adaptive")
    adapts_to = ("topk",)

    def masks(self, obs):
        return [(t != 0).to(t.dtype) for t in obs.shared]


# --------------------------------------------------------------------------- the mixing defenses


@dataclass
class UnmixSettings(MatchingSettings):
    """Gradient-matching options, with the soft labels on, and the un-mixing's own."""

    soft_labels: bool = True
    #: ρ of the un-mixing's ridge ‖x − x̃‖² (mixup-adaptive)
    ridge: float = 1e-3
    #: Adam steps and step size of Carlini et al.'s recovery from absolute encodings (instahide-carlini)
    unmix_steps: int = 500
    unmix_lr: float = 0.02
    #: the TV weight that picks each pixel's sign in that recovery (instahide-carlini)
    tv_unmix: float = 1e-3
    #: the data's mean pixel, known to the attacker from public data of the task (instahide-carlini): TV cannot tell
    #: the images from their negatives about the box midpoint, this picks the one whose mean is closer (None: off)
    prior_mean: float | None = None

    def check(self) -> None:
        super().check()
        expect(self.soft_labels, "expected soft_labels=True: the mixing coefficients are read off the soft labels "
                                 "(option soft_labels)")
        expect(self.restarts == 1, f"expected restarts = 1 (the soft labels of one run are read), got "
                                   f"{self.restarts} (option restarts)")
        expect(self.ridge > 0, f"expected ridge > 0, got {self.ridge} (option ridge)")
        expect(self.unmix_steps >= 0 and self.unmix_lr > 0 and self.tv_unmix >= 0,
               "expected unmix_steps ≥ 0, unmix_lr > 0, tv_unmix ≥ 0 (options unmix_steps, unmix_lr, tv_unmix)")


UNMIX_PRESETS = {name: {**values, "soft_labels": True, "restarts": 1} for name, values in MATCH_PRESETS.items()}
#: InstaHide's encodings carry a random sign per pixel: a smoothness prior on them is wrong, so stage 1 runs without TV
#: (the TV prior acts in the recovery from their absolute values instead)
ENCODING_PRESETS = {name: {**values, "tv": 0.0, "tv_growth": 0.0} for name, values in UNMIX_PRESETS.items()}


class SoftLabelMatcher(GradientMatcher):
    """Gradient matching whose soft labels mix the batch's own labels only (the mixing defenses mix labels of the
    client's batch: a class no image carries gets no mass), keeping those of its last objective (ỹ)."""

    soft: torch.Tensor | None = None
    present: torch.Tensor | None = None

    def targets(self, labels, label_logits):
        if label_logits is None:
            return labels
        if self.present is None:
            self.present = torch.zeros(label_logits.shape[-1], dtype=torch.bool, device=label_logits.device)
            self.present[labels.long().unique()] = True
        out = torch.softmax(label_logits.masked_fill(~self.present, float("-inf")), dim=-1)
        self.soft = out.detach()
        return out


def coefficients(soft: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    """M̂ = ỹ Y⁺, rows clipped to ≥ 0 and renormalised (B × B): each encoding's share of each labelled slot."""
    onehot = torch.nn.functional.one_hot(labels.long(), classes).to(torch.float64)
    m = soft.to(torch.float64) @ torch.linalg.pinv(onehot)
    m = m.clamp_min(0)
    return m / m.sum(1, keepdim=True).clamp_min(1e-12)


def mixup_structure(m: torch.Tensor) -> tuple[torch.Tensor, float]:
    """M̂ projected on MixUp's structure (one λ ≥ ½ per step, each encoding its own image and one partner): each
    row keeps its two largest entries as λ̂ and 1 − λ̂, λ̂ the mean over rows of top₁/(top₁ + top₂)."""
    top = m.topk(min(2, m.shape[1]), dim=1)
    if top.values.shape[1] < 2:
        return torch.ones_like(m), 1.0
    lam = float((top.values[:, 0] / top.values.sum(1).clamp_min(1e-12)).mean())
    out = torch.zeros_like(m)
    rows = torch.arange(m.shape[0])
    out[rows, top.indices[:, 0]] = lam
    out[rows, top.indices[:, 1]] += 1 - lam
    return out, lam


def unmix(mixed: torch.Tensor, m: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_x ‖M x − x̃‖² + ρ‖x − x̃‖² for every pixel (x̃, x: B × …)."""
    b = m.shape[0]
    flat = mixed.reshape(b, -1).to(torch.float64)
    lhs = m.T @ m + ridge * torch.eye(b, dtype=torch.float64)
    return torch.linalg.solve(lhs, m.T @ flat + ridge * flat).reshape(mixed.shape).to(mixed.dtype)


def recover_from_absolute(encodings: torch.Tensor, m: torch.Tensor, mid: float, box: tuple[float, float], *,
                          steps: int, lr: float, tv: float, ridge: float) -> torch.Tensor:
    """Carlini et al.'s step (iii): centred images c with |M c| ≈ |x̃ − m|, by Adam from lstsq(M, |x̃ − m|)."""
    a = (encodings - mid).abs()
    c = unmix(a, m, ridge).clone().requires_grad_(True)
    mm = m.to(encodings.dtype)
    lo, hi = box[0] - mid, box[1] - mid
    opt = torch.optim.Adam([c], lr=lr)
    b = m.shape[0]
    for _ in range(steps):
        mixed = (mm @ c.reshape(b, -1)).reshape(a.shape)
        loss = (mixed.abs() - a).pow(2).sum() / b
        if tv:
            loss = loss + tv * total_variation(c + mid)
        grad, = torch.autograd.grad(loss, [c])
        c.grad = grad
        opt.step()
        with torch.no_grad():
            c.clamp_(lo, hi)
    return (c.detach() + mid).clamp(*box)


class _Unmixing(AdaptiveAttack):
    Options = UnmixSettings
    presets = UNMIX_PRESETS

    def encodings(self, obs, seed, callback, progress):
        """Stage 1: (x̃, ỹ, labels Y, trace) — the mixed inputs and their soft labels from the gradient."""
        labels = recover_labels(obs, seed=seed)
        matcher = SoftLabelMatcher(obs, self.options)
        result = matcher.run(labels, seed=seed, callback=callback, progress=progress)
        return result.images, matcher.soft, labels, result.trace


@register
class MixUpAdaptive(_Unmixing):
    """MixUp's coefficients as unknowns: match mixed inputs and soft labels, read M off the labels, un-mix."""

    name = "mixup-adaptive"
    tags = ("gradient", "labels", "adaptive")
    adapts_to = ("mixup",)

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        mixed, soft, labels, trace = self.encodings(obs, seed, callback, progress)
        m, lam = mixup_structure(coefficients(soft, labels, obs.num_classes))
        images = unmix(mixed, m, self.options.ridge).clamp(*obs.data_range)
        trace.update(coefficients=m.tolist(), mixing=lam,
                     encodings="mixed inputs from stage 1, un-mixed by the coefficients")
        return Reconstruction(images=images, labels=labels, trace=trace)


@register
class InstaHideCarlini(_Unmixing):
    """Carlini et al. 2021 on InstaHide: encodings from the gradient, then images from their absolute values."""

    name = "instahide-carlini"
    tags = ("gradient", "labels", "adaptive")
    adapts_to = ("instahide",)
    presets = ENCODING_PRESETS

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        encodings, soft, labels, trace = self.encodings(obs, seed, callback, progress)
        m = coefficients(soft, labels, obs.num_classes)
        lo, hi = obs.data_range
        s = self.options
        images = recover_from_absolute(encodings, m, (lo + hi) / 2, (lo, hi), steps=s.unmix_steps, lr=s.unmix_lr,
                                       tv=s.tv_unmix, ridge=s.ridge)
        if s.prior_mean is not None and abs(float((lo + hi - images).mean()) - s.prior_mean) < \
                abs(float(images.mean()) - s.prior_mean):
            images = lo + hi - images  # the negative about the midpoint: the same absolute encodings
        trace.update(coefficients=m.tolist(), encodings="InstaHide encodings from stage 1; images from their "
                     "absolute values (Carlini et al. step iii)")
        return Reconstruction(images=images, labels=labels, trace=trace)


__all__ = ["SoteriaAdaptive", "TopKAdaptive", "MixUpAdaptive", "InstaHideCarlini", "MaskedMatcher",
           "SoftLabelMatcher", "coefficients", "unmix", "recover_from_absolute", "UnmixSettings"]
