"""GIFD: gradient inversion over a generator's feature domains (Fang, Chen, Wang, Zhu & Xia, "GIFD: A Generative
Gradient Inversion Method with Feature Domain Optimization", ICCV 2023, Sec. 3).

A generator is a composition G = G_N ∘ … ∘ G_1.  GIFD first searches its latent space, as GIAS does
(:mod:`.gias`, stage 1: z* = argmin_z D(∇θ L(G(z), y), ∇θ_obs) + λ_z‖z‖², the best of several starts), then moves
*into* the generator one stage at a time.  For k = 1 … N − 1 the intermediate feature h_k is the unknown:

    h_k* = argmin_{h_k}  D(∇θ L(G_N ∘ … ∘ G_{k+1}(h_k), y), ∇θ_obs)    subject to  ‖h_k − h_k⁰‖₁ ≤ r_k,

started from h_k⁰ = G_k(h_{k−1}*) (h_0* = z*), the constraint kept by projecting onto the ℓ1 ball around h_k⁰ after
every step (the projection of Duchi, Shalev-Shwartz, Singer & Chandra, ICML 2008, per image).  The ball keeps the
search near the generator's range (the paper's answer to over-fitting the gradient with unnatural images) while
letting later stages produce images the latent space cannot.  The output is that of the stage — latent or
feature k — whose images match the gradient best (the paper keeps the best-matching layer's result).

Ours, not the paper's: the radius is relative, r_k = ``radius``·‖h_k⁰‖₁ per image (the paper sets absolute radii per
layer of its BigGAN / StyleGAN2); D is Inverting Gradients' 1 − cos over the whole gradient (the library's
matching objective, as for ``gias``), and the latent stage is ``gias``'s with its options.  The paper's label-space
search for out-of-distribution data is not implemented (the library's generators are trained on the client's kind
of data).

The generator must come in stages: the library's :class:`~leakbench.models.prior.ConvDecoder` (z → fc → conv1 →
conv2 → image: three feature spaces), or a user's ``nn.Sequential`` / a class with a ``stages()`` method
(:func:`~leakbench.models.prior.generator_stages`).  Every stage must map each image on its own (no batch norm in
training mode), as for ``gias``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import expect
from ...models.prior import generator_stages
from ...threat import Observation
from ..base import register
from ..solvers.generative import GenerativeAttack, GenerativeOptions, Search

__all__ = ["GIFD", "GIFDOptions", "project_l1_ball"]


def project_l1_ball(v: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Each row of ``v`` (n × d) projected onto the ℓ1 ball of its ``radius`` (n) around 0 (Duchi et al. 2008,
    Fig. 1: sort, the largest ρ with u_ρ > (Σ_{j ≤ ρ} u_j − r)/ρ, soft threshold θ); rows inside stay as they are."""
    u = v.abs()
    inside = u.sum(1) <= radius
    s, _ = torch.sort(u, dim=1, descending=True)
    css = s.cumsum(1)
    k = torch.arange(1, v.shape[1] + 1, device=v.device, dtype=v.dtype)
    count = (s > (css - radius[:, None]) / k).sum(1).clamp(min=1)
    theta = ((css.gather(1, (count - 1)[:, None]).squeeze(1) - radius) / count.to(v.dtype)).clamp(min=0)
    w = torch.sign(v) * (u - theta[:, None]).clamp(min=0)
    return torch.where(inside[:, None], v, w)


@dataclass
class GIFDOptions(GenerativeOptions):
    """Options of ``gifd``: the latent stage ``gias`` runs too, then ``feature_steps`` per feature space."""

    feature_steps: int = 70        # steps per intermediate feature space
    feature_lr: float = 0.01
    radius: float = 0.3            # r_k = radius · ‖h_k⁰‖₁ per image
    last_stage: int = 0            # search feature spaces 1 … last_stage (0: all of them)

    def check(self) -> None:
        super().check()
        expect(isinstance(self.feature_steps, int) and not isinstance(self.feature_steps, bool)
               and self.feature_steps >= 1, f"expected an integer feature_steps ≥ 1, got {self.feature_steps!r} "
               "(option feature_steps)")
        expect(math.isfinite(self.feature_lr) and self.feature_lr > 0,
               f"expected feature_lr > 0, got {self.feature_lr} (option feature_lr)")
        expect(math.isfinite(self.radius) and self.radius > 0,
               f"expected radius > 0 (a fraction of each feature's ℓ1 norm), got {self.radius} (option radius)")
        expect(isinstance(self.last_stage, int) and not isinstance(self.last_stage, bool) and self.last_stage >= 0,
               f"expected an integer last_stage ≥ 0 (0: every feature space), got {self.last_stage!r} "
               "(option last_stage)")


def _compose(stages):
    def run(h):
        for stage in stages:
            h = stage(h)
        return h
    return run


@register
class GIFD(GenerativeAttack):
    """GIFD (Fang et al. 2023): GIAS's latent search, then the generator's intermediate features in ℓ1 balls."""

    name = "gifd"
    Options = GIFDOptions
    # ``default``: 2 restarts × 200 latent steps (``gias``'s), then 70 steps in each of the library decoder's three
    # feature spaces (610 steps of the simulated gradient, about ``gias``'s 600), Adam lr 0.01, radius 0.3.
    presets = {"quick": {"prior_steps": 300, "latent_steps": 60, "restarts": 1, "feature_steps": 20,
                         "trace_every": 10}}

    def _spaces(self, gen) -> tuple[list, int]:
        """The generator's stages and the last feature space searched."""
        stages = generator_stages(gen)
        last = self.options.last_stage or len(stages) - 1
        expect(last <= len(stages) - 1, f"expected last_stage ≤ {len(stages) - 1} (the generator's feature spaces), "
               f"got {last} (option last_stage)")
        return stages, last

    def total_steps(self, gen: torch.nn.Module, obs: Observation) -> int:
        return super().total_steps(gen, obs) + self.options.feature_steps * self._spaces(gen)[1]

    def refine(self, search: Search, gen: torch.nn.Module, z_best: torch.Tensor, images: torch.Tensor,
               latent_match: float, trace: dict) -> tuple[torch.Tensor, float]:
        o = self.options
        stages, last = self._spaces(gen)
        best_images, best_match, best_stage = images, latent_match, "latent"
        matches, curves = [], []
        with torch.no_grad():
            h = stages[0](z_best)
        for k in range(1, last + 1):
            anchor = h.detach()
            radius = o.radius * anchor.flatten(1).abs().sum(1)
            feature = anchor.clone().requires_grad_(True)
            rest = _compose(stages[k:])

            def project(feature=feature, anchor=anchor, radius=radius):
                delta = (feature - anchor).flatten(1)
                feature.copy_(anchor + project_l1_ball(delta, radius).reshape(anchor.shape))

            curve = search.descend([feature], lambda feature=feature, rest=rest: search.box(rest(feature)),
                                   o.feature_steps, o.feature_lr, None, project)
            with torch.no_grad():
                x = search.box(rest(feature))
                h = stages[k](feature)
            match = search.match_of(x)
            matches.append(match)
            curves.append(curve)
            if math.isfinite(match) and match < best_match:
                best_images, best_match, best_stage = x, match, f"feature {k}"
        trace.update(feature_matches=matches, feature_loss=curves, stage=best_stage, loss=curves[-1],
                     radius=o.radius)
        return best_images, best_match
