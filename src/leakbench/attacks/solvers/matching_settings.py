"""What a gradient-matching attack is told and what it returns: :class:`MatchingSettings` (the optimiser,
step, schedule, initialisation, regularisers; checked in one place), :class:`MatchResult`, the initial images
and the step schedules."""
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
                                     ("factorise", self.factorise, FACTORISE)):
            expect(value in allowed, f"expected {name} in {allowed}, got {value!r} (option {name})")
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


__all__ = ["MatchingSettings", "MatchResult", "initial_images", "step_schedule", "OPTIMIZERS", "SCHEDULES", "INITS", "STEP_UNITS"]
