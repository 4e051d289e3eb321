"""``ats-adaptive``: the attack that knows the ATS policy (:mod:`leakbench.defenses.ats`).

Under ATS (Gao et al., CVPR 2021) the client shares ∇θ ℓ(f(T(x)), y): the gradient of the *transformed* image.
A plain attack recovers T(x) at best.  The adaptive attacker knows the policy (its operations and magnitudes: the
spec) but not the client's per-image random choices (the sign ± of each translation, shear and blend).  Balunović,
Dimitrov, Jovanović & Vechev (ICLR 2022, "Bayesian Framework for Gradient Leakage", Sec. 6) show that ATS's
protection disappears under an attack run to convergence that accounts for the transformation; we follow that
idea with three stages:

1. Inverting Gradients (Geiping et al. 2020, eq. 4; the output-layer feature term off) recovers x̃ ≈ T(x);
2. for every image and every sign combination s (2^m of them, m the policy's signed operations) the preimage
   x_s = argmin ‖T_s(x) − x̃‖² + α·TV(x) (Adam from a flat image at x̃'s mean); the combination of least
   objective is taken — a MAP choice under the TV prior.  Under a hybrid policy (one of several per image) the
   candidates are every (policy, signs) pair of every policy, and the fit chooses the policy too.  The gradient
   depends on x only through T(x), so what T discards (pixels shifted out, contrast clipped) is not identifiable
   and comes from the prior, and a sign that two preimages explain equally well is a guess;
3. gradient matching of T_ŝ(x) with x the unknown (T differentiable almost everywhere), from x_ŝ, for
   ``refine`` × ``iterations`` steps: the reconstruction is of the original image, not of T(x).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch.func import functional_call

from ...defenses import parse, parts_of
from ...defenses.ats import ATS, hybrid_transform, signed_count, transform
from ...errors import expect
from ...threat import Observation
from ..base import Reconstruction, register
from ..labels import recover_labels
from ..solvers.gradient_matching import GradientMatcher
from ..solvers.matching_settings import MatchingSettings
from ..solvers.adaptive_base import MATCH_PRESETS, AdaptiveAttack

#: the most sign combinations per image stage 2 tries (2^6)
MAX_SIGNED = 6


@dataclass
class ATSSettings(MatchingSettings):
    """Gradient-matching options, and the preimage search's own."""

    #: stage 3's iterations as a fraction of ``iterations`` (0: the preimage of stage 2 is the result)
    refine: float = 0.5
    #: Adam steps, step size and TV weight α of stage 2's preimage fit
    invert_steps: int = 300
    invert_lr: float = 0.05
    tv_invert: float = 0.01

    def check(self) -> None:
        super().check()
        expect(0 <= self.refine <= 4, f"expected refine in [0, 4], got {self.refine} (option refine)")
        expect(self.invert_steps >= 1 and self.invert_lr > 0 and self.tv_invert >= 0,
               "expected invert_steps ≥ 1, invert_lr > 0, tv_invert ≥ 0 (options invert_steps, invert_lr, tv_invert)")


def policy_of(obs: Observation) -> ATS:
    """The ATS part of the observation's defense (what the server knows)."""
    return next(p for p in parts_of(parse(obs.defense)) if isinstance(p, ATS))


def sign_combinations(m: int) -> torch.Tensor:
    """All 2^m vectors in {−1, +1}^m (S × m)."""
    return torch.tensor(list(itertools.product((-1.0, 1.0), repeat=m))).reshape(2 ** m, m)


def _tv_each(x: torch.Tensor) -> torch.Tensor:
    return ((x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(1)
            + (x[..., 1:, :] - x[..., :-1, :]).abs().flatten(1).mean(1))


def hybrid_preimages(encoded: torch.Tensor, policies: tuple[tuple[int, ...], ...], *, steps: int, lr: float,
                     tv: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2 over every policy of a hybrid: (x B×…, each image's policy B, its signs B × max m, the objective of
    every (policy, signs) candidate B × Σ 2^m_p, policy by policy)."""
    b = encoded.shape[0]
    m = max(signed_count(p) for p in policies)
    fits = [preimages(encoded, p, steps=steps, lr=lr, tv=tv) for p in policies]
    values = torch.cat([f[2] for f in fits], dim=1)
    best = torch.stack([f[2].min(1).values for f in fits], dim=1).argmin(1)
    rows = torch.arange(b, device=best.device)
    images = torch.stack([f[0] for f in fits], dim=1)[rows, best]
    signs = torch.ones(b, m)
    for i, p in enumerate(best.tolist()):
        chosen = fits[p][1][i]
        signs[i, :len(chosen)] = chosen
    return images, best.cpu(), signs, values


def preimages(encoded: torch.Tensor, indices: tuple[int, ...], *, steps: int, lr: float,
              tv: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2: (x_ŝ B×…, ŝ B×m, the objective of every combination B×S) for the transformed images ``encoded``."""
    b, m = encoded.shape[0], signed_count(indices)
    combos = sign_combinations(m)
    s = combos.shape[0]
    target = encoded.detach().repeat_interleave(s, 0)
    signs = combos.repeat(b, 1)
    x = target.mean((1, 2, 3), keepdim=True).expand_as(target).clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)

    def objective():
        return (transform(x, indices, signs) - target).pow(2).flatten(1).sum(1) + tv * _tv_each(x)

    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        objective().sum().backward()
        opt.step()
        with torch.no_grad():
            x.clamp_(0, 1)
    with torch.no_grad():
        values = objective().reshape(b, s)
    best = values.argmin(1)
    chosen = x.detach().reshape(b, s, *encoded.shape[1:])[torch.arange(b, device=best.device), best]
    return chosen, combos[best.cpu()], values


class TransformedMatcher(GradientMatcher):
    """Gradient matching of the client's gradient at T_s(x): the unknown is the original image x (under a hybrid,
    image i by policy ``choice[i]``)."""

    def __init__(self, obs: Observation, settings: MatchingSettings, indices: tuple[int, ...],
                 signs: torch.Tensor, *, policies: tuple[tuple[int, ...], ...] | None = None,
                 choice: torch.Tensor | None = None) -> None:
        super().__init__(obs, dataclasses.replace(settings, factorise="off"))
        self.signs = signs.to(obs.device)
        self.policies = policies or (indices,)
        self.choice = choice if choice is not None else torch.zeros(len(signs), dtype=torch.long)

    def forward(self, params, x):
        encoded = hybrid_transform(x, self.policies, self.choice, self.signs)
        return functional_call(self.model, params, (encoded,), strict=False)


@register
class ATSAdaptive(AdaptiveAttack):
    """Recover T(x), choose each image's signs by the preimage fit, then match gradients of T_ŝ(x) for x."""

    name = "ats-adaptive"
    tags = ("gradient", "labels", "adaptive")
    adapts_to = ("ats",)
    Options = ATSSettings
    presets = MATCH_PRESETS

    def requirements(self, obs: Observation) -> list[str]:
        reasons = super().requirements(obs)
        if not reasons:
            m = max(signed_count(p) for p in policy_of(obs).policies)
            if m > MAX_SIGNED:
                reasons.append(f"ats-adaptive tries every sign combination of the policy: at most {MAX_SIGNED} signed "
                               f"operations, got {m}")
            if len(obs.input_shape) != 3:
                reasons.append("ATS transforms images: it needs image inputs C×H×W")
        return reasons

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        s = self.options
        policies = policy_of(obs).policies
        indices = policies[0]
        labels = recover_labels(obs, seed=seed)
        stage1 = GradientMatcher(obs, dataclasses.replace(s, factorise="off")).run(labels, seed=seed,
                                                                                   progress=progress)
        start, choice, signs, values = hybrid_preimages(stage1.images.to(obs.device, obs.dtype), policies,
                                                        steps=s.invert_steps, lr=s.invert_lr, tv=s.tv_invert)
        trace = {"stage1": stage1.trace, "signs": signs.tolist(), "preimage_objective": values.tolist(),
                 "encodings": "T(x) from stage 1; signs by the preimage fit; gradients of T_s(x) matched for x"}
        if len(policies) > 1:
            trace["policies"] = choice.tolist()
        images, out_labels = start, stage1.labels
        refine = int(round(s.refine * s.iterations))
        if refine:
            matcher = TransformedMatcher(obs, dataclasses.replace(s, iterations=refine), indices, signs,
                                         policies=policies, choice=choice)
            result = matcher.run(labels, seed=seed, init=start, callback=callback)
            images, out_labels = result.images, result.labels
            trace.update(result.trace)
        return Reconstruction(images=images.clamp(*obs.data_range), labels=out_labels, trace=trace)


__all__ = ["ATSAdaptive", "ATSSettings", "TransformedMatcher", "preimages", "hybrid_preimages", "sign_combinations",
           "policy_of"]
