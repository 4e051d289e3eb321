"""GGL: generative gradient leakage (Li, Zhang, Liu & Liu, "Auditing Privacy Defenses in Federated Learning via
Generative Gradient Leakage", CVPR 2022, Sec. 3).

With a generator G pretrained on public data, GGL searches only its latent space (no generator fine-tuning, unlike
GIAS), with a gradient-free optimiser, and makes the simulated gradient pass through the defense the server knows:

    z* = argmin_z  D(T(∇θ L(G(z), ŷ)), ∇θ_obs) + λ·R_KL(z)                                          (eq. 3)

* **R_KL** (Sec. 3.3) keeps the code inside the generator's latent distribution: the entries of each image's code
  z_i are treated as samples, N(μ_i, σ_i²) fitted to them, and KL(N(μ_i, σ_i²) ‖ N(0, 1)) =
  ½(σ_i² + μ_i² − 1 − log σ_i²) is added, with λ = 0.1 (``kl``) as in the authors' code.  GGL attacks one image;
  for a batch (one code per image) the mean over images is taken, so λ means the same at every batch size (ours).
* **T** (Sec. 3.4, "adaptive attack"): the server applies to the simulated gradient the transformation the
  defense applied to the client's.  Here from the observation alone, as the authors' code estimates the defense's
  parameter from the observed gradient: ``adapt="auto"`` masks the simulated gradient to the observed support when
  at least 10 % of the shared entries are exact zeros (gradient pruning / top-k, Soteria's pruned
  representation: the authors' ``compression`` and ``representation`` transforms.  Their compression prunes the
  simulated gradient at the observed percentile of zeros; masking it to the observed support instead makes the true
  batch match the observation exactly, which the percentile approximates), and with the ``l2`` distance also clips
  the simulated gradient to the observed norm (their ``clipping``); additive noise is left alone (zero mean).  ``mask`` always masks,
  ``none`` never does.
* **the optimiser** (Sec. 3.5): CMA-ES (Hansen 2016; :mod:`..solvers.cma_es`), the authors' choice among the
  gradient-free optimisers they compare, from z = 0 (the latent prior's mode) with step size ``sigma``; each
  generation's λ candidates are scored, ``evaluations`` objective evaluations per restart (a later restart starts
  at a random z ~ N(0, I)).  ``optimizer="adam"`` is their gradient-based variant (Adam on z, ``latent_steps`` at
  ``latent_lr``, the same objective).

D: the authors' code uses the squared ℓ2 distance with λ = 0.1; on a trained network the gradient's squared norm
is ~1e-3, so a fixed λ would drown it.  The default here is the scale-free cosine distance of the library's other
generative attacks (``distance="l2"`` is available).  The generator is the same as ``gias``'s (the library's VAE
decoder trained on ``public``, seeded and cached, or the user's ``module:Class``); labels are the observation's
when granted, else recovered (iDLG at B = 1, as GGL; counts from the bias gradient for batches).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ...errors import expect
from ...threat import Observation
from ..base import register
from ..solvers.cma_es import MAX_DIM, CMAES, default_population
from ..solvers.generative import GenerativeAttack, GenerativeOptions, Search, latent_search
from ..solvers.gradient_matching import GradientMatcher, MaskedMatcher
from ..solvers.matching_settings import MatchingSettings

__all__ = ["GGL", "GGLOptions", "kl_prior", "sparse_support"]

OPTIMIZERS = ("cma", "adam")
ADAPT = ("auto", "mask", "none")
#: ``adapt="auto"`` treats an observation as sparsified from this fraction of exact zeros on
SPARSE_FRACTION = 0.1


@dataclass
class GGLOptions(GenerativeOptions):
    """Options of ``ggl``: the latent search by CMA-ES (or Adam), the KL prior, the defense transform."""

    optimizer: str = "cma"
    evaluations: int = 2000        # CMA-ES: objective evaluations per restart (⌊evaluations / λ⌋ generations)
    population: int = 0            # CMA-ES λ; 0: 4 + ⌊3 ln n⌋, n = batch × latent
    sigma: float = 0.5             # CMA-ES initial step size (the latent prior has scale 1)
    kl: float = 0.1                # λ of R_KL
    adapt: str = "auto"
    restarts: int = 1

    def check(self) -> None:
        super().check()
        expect(self.optimizer in OPTIMIZERS,
               f"expected optimizer in {OPTIMIZERS}, got {self.optimizer!r} (option optimizer)")
        expect(self.adapt in ADAPT, f"expected adapt in {ADAPT}, got {self.adapt!r} (option adapt)")
        expect(isinstance(self.evaluations, int) and not isinstance(self.evaluations, bool) and self.evaluations >= 2,
               f"expected an integer evaluations ≥ 2, got {self.evaluations!r} (option evaluations)")
        expect(isinstance(self.population, int) and not isinstance(self.population, bool)
               and (self.population == 0 or 2 <= self.population <= self.evaluations),
               f"expected population 0 (the default) or 2 to evaluations, got {self.population!r} (option population)")
        expect(math.isfinite(self.sigma) and self.sigma > 0, f"expected sigma > 0, got {self.sigma} (option sigma)")
        expect(math.isfinite(self.kl) and self.kl >= 0, f"expected kl ≥ 0, got {self.kl} (option kl)")


def kl_prior(z: torch.Tensor) -> torch.Tensor:
    """R_KL per image: KL(N(μ_i, σ_i²) ‖ N(0, 1)) of the Gaussian fitted to the entries of code z_i (rows of z);
    leading dimensions are kept (…, B) ↦ (…, B)."""
    mean, var = z.mean(-1), z.var(-1, unbiased=False)
    return 0.5 * (var + mean.pow(2) - 1 - torch.log(var + 1e-10))


def sparse_support(obs: Observation) -> float:
    """The fraction of the shared entries that are exact zeros."""
    total = sum(t.numel() for t in obs.shared)
    return sum(int((t == 0).sum()) for t in obs.shared) / max(total, 1)


class DefenseAware(MaskedMatcher):
    """GGL's T: the simulated gradient masked to the observed support and, with ``clip``, scaled to at most the
    observed norm (the authors' clipping transform with the bound read off the observation)."""

    def __init__(self, obs: Observation, settings: MatchingSettings, masks: list[torch.Tensor], *, clip: bool) -> None:
        super().__init__(obs, settings, masks)
        self.bound = float(torch.sqrt(sum(t.double().pow(2).sum() for t in obs.shared))) if clip else math.inf

    def shared_of(self, x, target):
        shared = super().shared_of(x, target)
        if not math.isfinite(self.bound):
            return shared
        norm = torch.sqrt(sum(g.pow(2).sum() for g in shared))
        scale = torch.clamp(self.bound / (norm + 1e-12), max=1.0)
        return [g * scale for g in shared]


@register
class GGL(GenerativeAttack):
    """GGL (Li et al. 2022): a generator's latent space searched by CMA-ES, a KL prior on the code, the defense's
    transform applied to the simulated gradient."""

    name = "ggl"
    Options = GGLOptions
    tags = ("gradient", "update", "labels", "adaptive")
    # ``default``: CMA-ES with λ = 4 + ⌊3 ln n⌋, σ 0.5 from z = 0, 2 000 evaluations, λ_KL 0.1 (the authors'),
    # the cosine distance, the library's VAE generator.  ``adam``: their Adam variant at gias's latent budget.
    preset_revisions = {"default": 0, "quick": 0, "adam": 0}
    presets = {
        "quick": {"prior_steps": 300, "evaluations": 200, "trace_every": 10},
        "adam": {"optimizer": "adam", "latent_steps": 400},
    }

    def _dim(self, obs: Observation) -> int:
        return obs.batch_size * self.options.latent

    def _population(self, obs: Observation) -> int:
        return self.options.population or default_population(self._dim(obs))

    def requirements(self, obs: Observation) -> list[str]:
        needs = super().requirements(obs)
        if not needs and self.options.optimizer == "cma" and self._dim(obs) > MAX_DIM:
            needs.append(f"ggl's CMA-ES searches at most {MAX_DIM} dimensions, this batch needs {self._dim(obs)} "
                         f"(batch × latent): use optimizer='adam'")
        return needs

    def total_steps(self, gen: torch.nn.Module, obs: Observation) -> int:
        o = self.options
        if o.optimizer == "adam":
            return o.restarts * o.latent_steps
        lam = self._population(obs)
        return o.restarts * max(1, o.evaluations // lam) * lam

    def matcher(self, obs: Observation, settings: MatchingSettings) -> GradientMatcher:
        o = self.options
        zeros = sparse_support(obs)
        self._adapted = {"adapt": o.adapt, "zero_fraction": zeros, "masked": False, "clipped": False}
        mask = o.adapt == "mask" or (o.adapt == "auto" and zeros >= SPARSE_FRACTION)
        clip = o.adapt != "none" and o.distance == "l2"
        if not (mask or clip):
            return GradientMatcher(obs, settings)
        masks = [(t != 0).to(t.dtype) if mask else torch.ones_like(t) for t in obs.shared]
        self._adapted.update(masked=mask, clipped=clip)
        return DefenseAware(obs, dataclasses.replace(settings, factorise="off"), masks, clip=clip)

    def first_stage(self, search: Search, gen: torch.nn.Module, rng: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor, float, dict]:
        o = self.options
        if o.optimizer == "adam":
            z, images, match, trace = latent_search(search, gen, o, rng, prior=lambda z: o.kl * kl_prior(z).mean())
        else:
            z, images, match, trace = self._cma(search, gen, rng)
        trace["defense_transform"] = self._adapted
        return z, images, match, trace

    def _cma(self, search: Search, gen: torch.nn.Module, rng: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor, float, dict]:
        o, obs = self.options, search.obs
        shape = (obs.batch_size, o.latent)
        lam = self._population(obs)
        generations = max(1, o.evaluations // lam)
        finals, curves, objectives, best = [], [], [], (math.inf, None)
        for r in range(o.restarts):
            start = torch.zeros(shape) if r == 0 else torch.randn(shape, generator=rng)
            es = CMAES(start, o.sigma, population=lam, generator=rng)
            curve, run_best, objective = [], (math.inf, None), []
            for g in range(generations):
                codes = es.ask().reshape(lam, *shape).to(obs.device, obs.dtype)
                values, matches, images = self._score(search, gen, codes)
                es.tell(values)
                k = int(torch.nan_to_num(values, nan=math.inf).argmin())
                if float(values[k]) < run_best[0]:
                    run_best = (float(values[k]), codes[k].clone(), float(matches[k]))
                if g % max(1, o.trace_every // lam) == 0 or g == generations - 1:
                    curve.append(float(matches[k]))
                    objective.append(float(values[k]))
                search.report(images[k], float(matches[k]), lam)
            if run_best[1] is None:
                continue
            with torch.no_grad():
                match = search.match_of(search.box(gen(run_best[1])))
            finals.append(match)
            curves.append(curve)
            objectives.append((objective, run_best[0]))
            if best[1] is None or match < best[0]:
                best = (match, run_best[1])
        expect(best[1] is not None, "ggl: every CMA-ES candidate's objective was NaN (a non-finite gradient): "
               "check the observation, or use optimizer='adam'")
        match, z_best = best
        with torch.no_grad():
            images = search.box(gen(z_best))
        chosen = finals.index(match)
        # the search keeps the code of least objective (gradient match + KL prior); its match is re-evaluated alone
        trace = {"latent_loss": curves[chosen], "restart_losses": finals, "latent_match": match,
                 "latent_objective": objectives[chosen][0], "objective_best": objectives[chosen][1],
                 "stage": "latent", "optimizer": "cma", "population": lam, "generations": generations}
        return z_best, images, match, trace

    def _score(self, search: Search, gen: torch.nn.Module, codes: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(objective, gradient match, images) of each candidate code batch (λ × B × latent): one simulated gradient
        each."""
        o = self.options
        values, matches = [], []
        with torch.no_grad():
            images = search.box(gen(codes.reshape(-1, codes.shape[-1]))).reshape(len(codes), search.obs.batch_size,
                                                                                *search.obs.input_shape)
            penalty = o.kl * kl_prior(codes).mean(-1) if o.kl else torch.zeros(len(codes))
        for k in range(len(codes)):
            match = search.match_of(images[k])
            matches.append(match)
            values.append(match + float(penalty[k]))
        return torch.tensor(values, dtype=torch.float64), torch.tensor(matches, dtype=torch.float64), images
