"""What a gradient-matching attack is told and what it returns: :class:`MatchingSettings` (the optimiser,
step, schedule, initialisation, regularisers; checked in one place), :class:`MatchResult`, the initial images
and step schedules, and Inverting Gradients' presets (:data:`INVERTING_PRESETS`), which the attacks built on it
share."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...errors import expect
from .objectives import DISTANCES

OPTIMIZERS = ("adam", "lbfgs", "sgd")
STEP_UNITS = ("data", "normalised")
SCHEDULES = ("multistep", "cosine", "none")
INITS = ("gaussian", "uniform", "grey", "randn")
FACTORISE = ("auto", "on", "off")
#: how an update observation's local steps are simulated (``MatchingSettings.local_model``)
LOCAL_MODELS = ("exact", "first-order")
#: ``factorise="auto"`` factorises linear layers with at least this many weights whose input rows n are
#: fewer than half of min(v, d) (measured on a bare linear layer: ×0.7–0.8 at 12–50k weights, ×1.0 at
#: 200k, ×2–2.8 at 790k; docs/feature-attacks.md).
FACTORISE_MIN = 1 << 18


@dataclass
class MatchingSettings:
    """Options of a gradient-matching attack (every field is an attack option)."""

    iterations: int = 4800
    distance: str = "cosine"
    weights: str = "equal"
    tv: float = 0.0
    #: α_TV grows with the batch: the objective weighs TV by ``tv · B^tv_growth`` (0: the same at every B)
    tv_growth: float = 0.0
    bn: float = 0.0
    optimizer: str = "adam"
    lr: float = 0.1
    step_unit: str = "data"
    signed: bool = True
    schedule: str = "multistep"
    restarts: int = 1
    batched_restarts: bool = False
    init: str = "gaussian"
    init_std: float = 1.0
    box: bool = True
    soft_labels: bool = False
    lbfgs_max_iter: int = 20
    trace_every: int = 50
    factorise: str = "auto"
    #: weight of a term matching each label's mean input to the output layer, recovered from that layer's
    #: gradient (:mod:`.last_layer`; 0: off; off with the reason in ``trace["features"]`` when not recoverable)
    features: float = 0.0
    #: the share of the iterations, at the start, that match those features (and the priors) only, without
    #: simulating the gradient: one forward and backward a step instead of a double backward
    feature_phase: float = 0.0
    #: the smallest batch the feature term is used at (at B = 1 the output layer's gradient is δ zᵀ: the cosine
    #: already pins the one image's features, and the term only reweighs the objective)
    features_from: int = 2
    #: which labels' features the term matches: ``all``, or ``unique`` — only labels that one image of the batch
    #: carries (a shared label's feature is the mean of several images', a weak pull that measured a cost on
    #: label-skewed batches; issue 34)
    features_labels: str = "all"
    #: the term matches only labels carried by at most this many images of the batch (0: any number).  A label
    #: of four images pins only their mean: measured (issue 34, 500 steps, Δ PSNR over the term off) on 2 × 4
    #: batches +0.31 and +0.34 dB (held-out, convnet-32) but −0.14 dB on average, down to −0.51, on three tuning
    #: batches (convnet-16), a tie that can cost; on labels of one or two images (the mixed layout) a gain
    features_max_images: int = 0
    #: how an update's local steps are simulated: ``exact`` — each step at the weights the previous steps reached
    #: (Geiping et al. 2020 Sec. 5; Dimitrov et al. 2022); ``first-order`` — every step's minibatch gradient at the
    #: received weights, Δθ ≈ −η Σ_s ∇L_{b_s}(θ₀) (the expansion to first order in η; the same for one step).  On a
    #: trained network a candidate far from the data has a large gradient, the simulated first step moves θ far
    #: and the exact simulation's later steps blow up, so the search sees a chaotic objective until its candidates
    #: are close (module docstring of :mod:`.gradient_matching`)
    local_model: str = "exact"
    #: α_group of GradInversion's group consistency (:mod:`.group_matching`; 0: off): the ``restarts`` runs are
    #: optimised jointly, each pulled towards their pixel-wise mean, refreshed every ``group_every`` steps from
    #: ``group_from`` of the run on
    group: float = 0.0
    group_every: int = 50
    group_from: float = 0.25

    def check(self) -> None:
        expect(self.iterations >= 1, f"expected iterations ≥ 1, got {self.iterations}")
        expect(self.restarts >= 1, f"expected restarts ≥ 1, got {self.restarts}")
        expect(self.lr > 0, f"expected lr > 0, got {self.lr}")
        expect(self.tv >= 0 and self.bn >= 0, f"expected tv, bn ≥ 0, got tv={self.tv}, bn={self.bn}")
        expect(math.isfinite(self.tv_growth) and self.tv_growth >= 0,
               f"expected tv_growth ≥ 0, got {self.tv_growth} (option tv_growth)")
        expect(self.init_std > 0, f"expected init_std > 0, got {self.init_std} (option init_std)")
        expect(self.trace_every >= 1, f"expected trace_every ≥ 1, got {self.trace_every}")
        expect(math.isfinite(self.features) and self.features >= 0,
               f"expected features ≥ 0, got {self.features} (option features)")
        expect(self.features_labels in ("all", "unique"),
               f"expected features_labels 'all' or 'unique', got {self.features_labels!r} (option features_labels)")
        expect(isinstance(self.features_max_images, int) and self.features_max_images >= 0,
               f"expected features_max_images an integer ≥ 0 (0: any number), got {self.features_max_images!r} "
               "(option features_max_images)")
        expect(self.features_from >= 1, f"expected features_from ≥ 1, got {self.features_from} (option features_from)")
        expect(0 <= self.feature_phase < 1, f"expected 0 ≤ feature_phase < 1, got {self.feature_phase} (option feature_phase)")
        expect(not (self.batched_restarts and self.features > 0),
               "option features works with batched_restarts=False (the feature term is not vmapped)")
        for name, value, allowed in (("distance", self.distance, DISTANCES), ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("schedule", self.schedule, SCHEDULES), ("init", self.init, INITS),
                                     ("step_unit", self.step_unit, STEP_UNITS),
                                     ("factorise", self.factorise, FACTORISE),
                                     ("local_model", self.local_model, LOCAL_MODELS)):
            expect(value in allowed, f"expected {name} in {allowed}, got {value!r} (option {name})")
        expect(math.isfinite(self.group) and self.group >= 0, f"expected group ≥ 0, got {self.group} (option group)")
        expect(isinstance(self.group_every, int) and self.group_every >= 1,
               f"expected an integer group_every ≥ 1, got {self.group_every!r} (option group_every)")
        expect(0 <= self.group_from < 1, f"expected 0 ≤ group_from < 1, got {self.group_from} (option group_from)")
        if self.group > 0:
            expect(self.restarts >= 2, f"option group needs restarts ≥ 2 (the groups whose consensus is formed), "
                   f"got restarts={self.restarts}")
            expect(self.optimizer != "lbfgs" and not self.batched_restarts and not self.soft_labels,
                   "option group works with adam or sgd, batched_restarts=False and soft_labels=False")
        expect(not (self.batched_restarts and self.optimizer == "lbfgs"),
               "batched_restarts works with adam or sgd, not lbfgs (option batched_restarts)")


@dataclass
class MatchResult:
    images: torch.Tensor
    labels: torch.Tensor
    trace: dict


def initial_images(shape: Sequence[int], kind: str, data_range: tuple[float, float], *,
                   generator: torch.Generator, device, dtype, std: float = 1.0) -> torch.Tensor:
    """Starting images: ``gaussian`` (box centre + ``std``·N(0, 1) in normalised units, i.e. times a
    quarter of the box width — N(0, 1) of normalised data, as Geiping et al. start), ``uniform`` in
    the box, ``grey`` (box centre), ``randn`` (N(0, 1) in the data's units, as DLG)."""
    lo, hi = data_range
    if kind == "randn":
        x = torch.randn(tuple(shape), generator=generator)
    elif kind == "gaussian":
        x = (lo + hi) / 2 + std * (hi - lo) / 4 * torch.randn(tuple(shape), generator=generator)
    elif kind == "uniform":
        x = lo + (hi - lo) * torch.rand(tuple(shape), generator=generator)
    else:
        x = torch.full(tuple(shape), (lo + hi) / 2)
    return x.to(device=device, dtype=dtype)


def step_schedule(opt: torch.optim.Optimizer, kind: str, iterations: int):
    """The learning-rate schedule ``kind`` (multistep ×0.1 at 3/8, 5/8, 7/8; cosine; none → None)."""
    if kind == "multistep":
        marks = sorted({max(1, int(iterations * f)) for f in (3 / 8, 5 / 8, 7 / 8)})
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=marks, gamma=0.1)
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iterations)
    return None


# α_TV: the authors' reference implementation (inversefed, ConvNet on CIFAR-10) weighs TV by 1e-4
# on standardised images.  TV of standardised images is TV/σ, so on [0, 1] pixels (σ = 0.25, the
# same σ as step_unit="normalised") the same objective has α_TV = 1e-4/0.25 = 4e-4; with signed
# Adam the trajectories are identical.
IG_PAPER = dict(distance="cosine", optimizer="adam", lr=0.1, step_unit="normalised", signed=True,
                schedule="multistep", iterations=4800, tv=4e-4, init="gaussian", box=True, restarts=1)

#: the presets of Inverting Gradients (Geiping et al. 2020), shared by the attacks that build on it.
INVERTING_PRESETS = {
    "default": IG_PAPER,
    "paper-long": {**IG_PAPER, "iterations": 24000, "restarts": 8},
    # A test budget: 300 steps are too few for the paper's step, so this one moves 0.1 in the
    # data's own units (0.4 normalised), which reaches ≥ 20 dB on a small ConvNet in 300 steps.
    "quick": {**IG_PAPER, "iterations": 300, "step_unit": "data", "tv": 1e-2},
    # Tuned for time-to-quality (benchmarks/bench_inverting.py measures it against "default"):
    # the same objective form, but (1) twice the paper's step decayed by a cosine over 500 steps
    # instead of a constant step for 1 800 steps; (2) a start 0.4 σ around grey instead of
    # N(0, σ²): the paper's noisy start costs tens of steps of TV flow; (3) α_TV 1e-4 instead of
    # 4e-4: with signed Adam only the sign of each pixel's gradient counts, and the TV gradient
    # outweighs the match gradient on most pixels early on (~80 % at 1e-3, measured), so the
    # first steps mostly smooth (1e-5 is too weak: noisy and slower; 3e-4 slower; lr 0.3-0.4 helps
    # one image and hurts another).  Measured (bench_inverting.py, convnet-32, CIFAR-10 images 0-2),
    # steps to 18/20 dB as a fraction of the paper preset's: 0.47, 0.17, 0.38, 0.27, 0.23; held-out
    # images 4 and 5: 0.15 and 0.46 at 18 dB, and 20 dB reached where the paper's 1 000 steps do not.
    # (4) α_TV grows as B^(2/3) (2.5e-4 at B = 4, 4e-4 at B = 8): a batch's gradient pins each image
    # less, and the prior has to carry more.  Tuned on CIFAR-10 batches of classes 0-4 (indices < 500),
    # convnet-32, 500 steps, matched PSNR: B = 4 15.25 → 15.60 dB, B = 8 13.78 → 14.75 dB (grey
    # images 12.45 and 12.94); B = 8 at α_TV 1e-3 gave 14.76, lr 0.1 14.11; 1 000 steps instead of
    # 500 did not help (B = 4: 16.98 against 17.10 dB on held-out images 500-800).  The held-out
    # comparison with breaching is benchmarks/bench_peers.py.  At B = 8 (batches of indices 0/10/20,
    # classes 0-4): α_TV 1e-2, 1e-1 and breaching's 0.8 give the same images (the TV sign wins wherever
    # it is non-zero from ~1e-2 on); lr 0.1 with the paper's step decay over 1 000 steps gains 0.05 and
    # 0.61 dB on two batches (13.69 against 13.27 dB held-out) at twice the time; the paper's N(0, 1)
    # start loses 0.65 dB; neither reaches breaching's 2 000-step PSNR on the held-out batch.
    # (5) from B = 2 on, the per-label features of the output layer (option ``features``, weight 1), the
    # first half of the steps matching them alone.  Tuned on the same batches (500 steps, matched PSNR,
    # fast without → with): B = 4 16.27 → 17.96 dB (all steps with the gradient as well: 18.30; a fifth
    # feature-only: 17.73); B = 8 14.75/14.46/12.80 → 16.04/15.01/13.73 dB (all steps: 15.90/15.53/13.84;
    # a fifth: 15.75/14.94/14.30; weight 10: 15.86/14.88/13.46); the half phase costs about 0.6× the time.
    # At B = 1 the term cost 0.7 and 3.5 dB on two of three images (18.77/22.18/16.97 →
    # 18.05/22.68/13.50 with a fifth feature-only), so it starts at B = 2 (``features_from``).
    # (6) the term only on labels of at most two images (``features_max_images``, revision 5): on 2 × 4
    # batches it was a tie that cost up to 0.51 dB on a tuning batch (see the option), so a label-skewed batch
    # whose labels all hold three or more images runs exactly as ``features=0``.
    "fast": {**IG_PAPER, "iterations": 500, "schedule": "cosine", "lr": 0.2, "init_std": 0.4, "tv": 1e-4,
             "tv_growth": 2 / 3, "features": 1.0, "feature_phase": 0.5, "features_max_images": 2},
}
# ``trained``: ``fast`` with a 250× stronger TV prior that does not grow with B (α_TV 0.1), for networks trained
# to classify their inputs confidently.  There a one-step gradient pins the images weakly (the loss gradient at
# the logits is near zero for confident images) and ``fast`` ends 2–4 dB *below* a grey image; the prior is the
# lever that moved it (benchmarks/bench_trained_layouts.py).  Chosen on one digits batch (tv 0.01 / 0.1, four
# restarts, the L2 distance); then above ``fast`` on 18 of 18 held-out batches at B = 8, paired: digits (convnet-16,
# accuracy 0.96) +1.1 … +2.9 dB, CIFAR-10 (accuracy 0.45) +0.65 … +1.48 dB, three label layouts each (docs/cli.md,
# "On a trained network"), and above the paper's ``default`` on 11 of 12 in a tenth of its time.  It lifts the
# attack towards the grey image's level, not above it.
INVERTING_PRESETS["trained"] = {**INVERTING_PRESETS["fast"], "tv": 0.1, "tv_growth": 0.0}

__all__ = ["IG_PAPER", "INVERTING_PRESETS", "MatchingSettings", "MatchResult", "initial_images", "step_schedule", "OPTIMIZERS", "SCHEDULES", "INITS", "STEP_UNITS", "LOCAL_MODELS"]
