"""The machinery of the generative gradient-inversion attacks (``gias``, ``gifd``): their shared options, the
gradient-matching context every stage runs in (:class:`Search`), the latent search (stage 1 of both: one code per
image, several random starts z ~ N(0, I), the best gradient match kept; Jeon et al. 2021, Sec. 3.1), and the attack
base class that builds the generator and runs the stages (:class:`GenerativeAttack`).

``consensus`` = K > 1 runs the whole attack K times from independent starts (one random stream: run 1 is the
``consensus=1`` result) and returns their mean, registered by label (:func:`~.group_matching.registered_mean`).  This
is GradInversion's consensus E(x̂_g) (Yin et al. 2021, eq. 8) returned as the result rather than used as a penalty:
where a gradient pins an image the runs agree and the mean keeps it; where it leaves details open each run fills
them from the prior differently and the mean averages them out — an estimate of the posterior mean, which minimises
the expected squared error (so PSNR), where one run is a posterior sample (ours; the result is the mean even when a
single run matches the gradient better, since the match does not rank runs by their error: docs/cli.md)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ...errors import ConfigError, expect
from ...models.custom import is_class_spec
from ...models.prior import PUBLIC, PriorConfig, learned_generator, user_generator
from ...threat import Observation
from ..base import Attack, Reconstruction
from ..labels import recover_labels
from .gradient_matching import GradientMatcher
from .group_matching import registered_mean
from .matching_settings import LOCAL_MODELS, SCHEDULES, MatchingSettings, step_schedule
from .objectives import DISTANCES

__all__ = ["GenerativeOptions", "GenerativeAttack", "Search", "latent_search"]


#: the most independent runs one attack averages (option ``consensus``; each is a whole run)
MAX_CONSENSUS = 32


@dataclass
class GenerativeOptions:
    """Options every generative attack shares: the generator, its latent search, the matching objective."""

    generator: str = "auto"        # "auto": the library's VAE decoder trained on ``public``; or "module:Class"
    generator_file: str = ""       # a module:Class generator's weights (a state dict file)
    latent: int = 16               # the code size (the auto generator's latent; a user generator's input size)
    public: str = "digits"         # the auto generator's data: digits (index 0–999), photos, a folder or a .npz
    prior_steps: int = 1200        # the auto generator's VAE training steps (part of its cache key)
    prior_width: int = 8
    prior_seed: int = 0
    cache: bool = True             # keep the auto generator on disk (cache_dir, or $LEAKBENCH_CACHE/generators)
    cache_dir: str = ""
    latent_steps: int = 200        # stage 1 per restart
    latent_lr: float = 0.1
    latent_prior: float = 1e-4     # λ_z
    restarts: int = 2
    #: independent whole runs whose registered mean is the result (1: the single run)
    consensus: int = 1
    distance: str = "cosine"
    schedule: str = "cosine"
    tv: float = 0.0
    bn: float = 0.0
    #: how an update's local steps are simulated (:class:`~..solvers.matching_settings.MatchingSettings`):
    #: ``first-order`` by default — on the tuning pool the exact simulation left the latent search stalled
    #: (docs/cli.md, "B = 4 after one local epoch")
    local_model: str = "first-order"
    trace_every: int = 25

    def check(self) -> None:
        expect(self.generator == "auto" or is_class_spec(self.generator),
               f"expected generator 'auto' or 'module.path:ClassName', got {self.generator!r} (option generator)")
        expect(not self.generator_file or self.generator != "auto",
               "option generator_file goes with generator='module:Class' (the auto generator is trained and cached "
               "by the library)")
        expect(self.generator != "auto" or self.public in PUBLIC or self.public.endswith(".npz")
               or "/" in self.public or self.public.startswith("~"),
               f"expected public {', '.join(PUBLIC)}, a folder path or a .npz file, got {self.public!r} (option public)")
        for name in ("latent", "prior_steps", "prior_width", "latent_steps", "restarts", "trace_every"):
            value = getattr(self, name)
            expect(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"expected an integer {name} ≥ 1, got {value!r} (option {name})")
        expect(isinstance(self.consensus, int) and not isinstance(self.consensus, bool)
               and 1 <= self.consensus <= MAX_CONSENSUS,
               f"expected an integer consensus from 1 to {MAX_CONSENSUS}, got {self.consensus!r} (option consensus)")
        for name in ("latent_lr",):
            value = getattr(self, name)
            expect(math.isfinite(value) and value > 0, f"expected {name} > 0, got {value} (option {name})")
        for name in ("latent_prior", "tv", "bn"):
            value = getattr(self, name)
            expect(math.isfinite(value) and value >= 0, f"expected {name} ≥ 0, got {value} (option {name})")
        expect(self.distance in DISTANCES, f"expected distance in {DISTANCES}, got {self.distance!r} (option distance)")
        expect(self.schedule in SCHEDULES, f"expected schedule in {SCHEDULES}, got {self.schedule!r} (option schedule)")
        expect(self.local_model in LOCAL_MODELS,
               f"expected local_model in {LOCAL_MODELS}, got {self.local_model!r} (option local_model)")


class Search:
    """One run's gradient-matching context: the matcher, the labels, the data box, progress, and the Adam loop that
    every stage of a generative attack runs (:func:`latent_search`, GIAS's generator stage, GIFD's feature stages)."""

    def __init__(self, obs: Observation, matcher: GradientMatcher, labels: torch.Tensor, *, total: int,
                 trace_every: int, schedule: str, callback=None, progress=None) -> None:
        self.obs, self.matcher, self.labels = obs, matcher, labels
        self.lo, self.hi = obs.data_range
        self.total, self.trace_every, self.schedule = total, trace_every, schedule
        self.callback, self.progress, self.done = callback, progress, 0

    def box(self, unit: torch.Tensor) -> torch.Tensor:
        """Generator output in [0, 1] ↦ the data box [lo, hi]."""
        return self.lo + (self.hi - self.lo) * unit

    def match_of(self, x: torch.Tensor) -> float:
        with torch.enable_grad():
            return float(self.matcher.objective(x, self.labels)[1].detach())

    def report(self, x: torch.Tensor, value: float, steps: int = 1) -> None:
        """Count ``steps`` steps of the simulated gradient, the current images ``x`` at match ``value``."""
        for _ in range(steps):
            self._report(x, value)

    def _report(self, x: torch.Tensor, value: float) -> None:
        self.done += 1
        if self.callback is not None and (self.done % self.trace_every == 0 or self.done == self.total):
            self.callback(self.done, x.detach())
        if self.progress is not None:
            self.progress(self.done, self.total, value)

    def descend(self, params, render, steps: int, lr: float, penalty=None, project=None) -> list[float]:
        """Adam on ``params`` against the gradient match of ``render()`` (+ ``penalty()``), ``project()`` after each
        step (a constraint, in place): the match curve."""
        opt = torch.optim.Adam(params, lr=lr)
        sched = step_schedule(opt, self.schedule, steps)
        curve, value = [], math.inf
        for step in range(steps):
            x = render()
            total, match = self.matcher.objective(x, self.labels)
            if penalty is not None:
                total = total + penalty()
            for p, g in zip(params, torch.autograd.grad(total, params)):
                p.grad = g
            opt.step()
            if project is not None:
                with torch.no_grad():
                    project()
            if sched is not None:
                sched.step()
            if step % self.trace_every == 0 or step == steps - 1:
                value = float(match.detach())
                curve.append(value)
            self._report(x, value)
        return curve


def latent_search(search: Search, gen: torch.nn.Module, o: GenerativeOptions, rng: torch.Generator, *,
                  prior=None) -> tuple[torch.Tensor, torch.Tensor, float, dict]:
    """Stage 1: one code per image, ``o.restarts`` random starts z ~ N(0, I), Adam on the gradient match plus the
    latent prior (``prior(z)``; default λ_z·mean_i ‖z_i‖²), the best gradient match kept: (codes, images, match,
    trace)."""
    obs = search.obs
    if prior is None and o.latent_prior:
        def prior(z):
            return o.latent_prior * z.pow(2).sum(1).mean()
    finals, curves, best = [], [], (math.inf, None)
    for _ in range(o.restarts):
        z = torch.randn((obs.batch_size, o.latent), generator=rng).to(obs.device, obs.dtype).requires_grad_(True)
        curve = search.descend([z], lambda z=z: search.box(gen(z)), o.latent_steps, o.latent_lr,
                               (lambda z=z: prior(z)) if prior is not None else None)
        with torch.no_grad():
            x = search.box(gen(z))
        finals.append(search.match_of(x))
        curves.append(curve)
        if best[1] is None or finals[-1] < best[0]:
            best = (finals[-1], z.detach().clone())
    latent_match, z_best = best
    with torch.no_grad():
        images = search.box(gen(z_best))
    trace = {"latent_loss": curves[finals.index(latent_match)], "restart_losses": finals,
             "latent_match": latent_match, "stage": "latent"}
    return z_best, images, latent_match, trace


class GenerativeAttack(Attack):
    """A generative attack (:mod:`leakbench.attacks.gradient.gias`, :mod:`~leakbench.attacks.gradient.gifd`): the
    generator (the library's, trained and cached, or the user's), the latent search, then the subclass's
    :meth:`refine` stage; the better match kept, compared with a grey image's."""

    matching = True
    tags = ("gradient", "update", "labels")  # a gradient or a multi-step update; labels used when granted

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return [f"{self.name} needs a shared gradient or update, not trained weights"]
        if len(obs.input_shape) != 3:
            return [f"{self.name} generates images C×H×W, the observation's inputs have shape {tuple(obs.input_shape)}"]
        return []

    def _generator(self, obs: Observation) -> tuple[torch.nn.Module, dict]:
        o = self.options
        if o.generator == "auto":
            config = PriorConfig(latent=o.latent, width=o.prior_width, steps=o.prior_steps, seed=o.prior_seed)
            gen, info = learned_generator(obs.input_shape, public=o.public, config=config, cache=o.cache,
                                          cache_dir=o.cache_dir or None)
            info = {k: v for k, v in info.items() if k != "vae_loss"}
        else:
            gen = user_generator(o.generator, obs.input_shape, latent=o.latent, weights=o.generator_file or None)
            info = {"generator": o.generator, "generator_file": o.generator_file or None}
        gen = gen.to(device=obs.device, dtype=obs.dtype).eval()
        for p in gen.parameters():
            p.requires_grad_(False)
        return gen, info

    def total_steps(self, gen: torch.nn.Module, obs: Observation) -> int:
        """Steps of the simulated gradient one run with generator ``gen`` on ``obs`` takes (what ``progress`` counts
        to): here the latent search's; a subclass adds its :meth:`refine` stage's."""
        o = self.options
        return o.restarts * o.latent_steps

    def matcher(self, obs: Observation, settings: MatchingSettings) -> GradientMatcher:
        """The gradient-matching engine of every stage (a defense-aware subclass may transform its gradient)."""
        return GradientMatcher(obs, settings)

    def first_stage(self, search: Search, gen: torch.nn.Module, rng: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor, float, dict]:
        """Stage 1, the search over codes: (codes, images, match, trace); here :func:`latent_search`."""
        return latent_search(search, gen, self.options, rng)

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        o = self.options
        start = time.perf_counter()
        labels = recover_labels(obs, seed=seed)
        gen, info = self._generator(obs)
        bn = o.bn if obs.bn_stats is not None else 0.0
        matcher = self.matcher(obs, MatchingSettings(iterations=o.latent_steps, distance=o.distance, tv=o.tv, bn=bn,
                                                     restarts=o.restarts, trace_every=o.trace_every,
                                                     local_model=o.local_model))
        search = Search(obs, matcher, labels, total=self.total_steps(gen, obs) * o.consensus,
                        trace_every=o.trace_every, schedule=o.schedule, callback=callback, progress=progress)
        rng = torch.Generator(device="cpu").manual_seed(int(seed))
        runs = []
        for _ in range(o.consensus):
            z, images, latent_match, trace = self.first_stage(search, gen, rng)
            images, final = self.refine(search, gen, z, images, latent_match, trace)
            runs.append((final, images, z, trace))
        best = min(range(len(runs)), key=lambda k: runs[k][0] if math.isfinite(runs[k][0]) else math.inf)
        final, images, z_best, trace = runs[best]
        if o.consensus > 1:
            images = registered_mean([run[1] for run in runs], labels, reference=best)
            final = search.match_of(images)
            trace.update(consensus=o.consensus, run_matches=[run[0] for run in runs], best_run=best,
                         best_run_match=runs[best][0])
        grey = torch.full_like(images, sum(obs.data_range) / 2)
        grey_match = search.match_of(grey)
        trace.update(final_match=final, grey_match=grey_match, latent=z_best.cpu(), restarts=o.restarts,
                     trace_every=o.trace_every, generator_info=info, seconds=time.perf_counter() - start)
        trace.setdefault("loss", trace["latent_loss"])
        if math.isfinite(grey_match) and not final < grey_match:
            trace["chance"] = (f"ended no better than a grey image: gradient distance {final:.4g}, a grey image's "
                               f"{grey_match:.4g}; these images are no evidence of leakage")
        if not bool(torch.isfinite(images).all()):
            raise ConfigError(f"{self.name} produced non-finite images: lower its learning rates")
        return Reconstruction(images=images.detach(), labels=labels, trace=trace)

    def refine(self, search: Search, gen: torch.nn.Module, z_best: torch.Tensor, images: torch.Tensor,
               latent_match: float, trace: dict) -> tuple[torch.Tensor, float]:
        """The stage after the latent search: (images, their match), the latent ones when it does not improve.
        Here none: the latent search's images are the result (GIAS's and GIFD's second stages override this)."""
        return images, latent_match
