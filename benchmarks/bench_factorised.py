"""Gradient matching through a wide random head: seconds per step against width, dense δᵀz vs factorised.

The models are the ConvNet of Inverting Gradients (width 8, BN in training mode, 288 features) and a
one-hidden-layer MLP (256 features, where the head dominates a step) at 32×32, each with Liu et al.'s
partly random head (:func:`leakbench.models.malicious.random_head`) of 1k–40k neurons; batch 4
CIFAR-10 images.  One step = the matching objective (IG's cosine, or liu2024's
per-tensor cosine with ℓ0 weights) and its gradient with respect to the images — what every
iteration of ``inverting-gradients`` / ``liu2024`` pays.  ``factorise="off"`` (the dense path) and
``"auto"`` (factorised: the random layer's δᵀz is never formed) run alternately in this process; the
best of three rounds is kept.  "head" = s/step minus the same step without the random head: the part
that should grow linearly with the width.
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.attacks.solvers.gradient_matching import GradientMatcher
from leakbench.attacks.solvers.matching_settings import MatchingSettings
from leakbench.models.malicious import random_head

from .common import benchmark_images, table


def _step_seconds(obs, y, distance: str, weights: str, factorise: str, steps: int) -> float:
    matcher = GradientMatcher(obs, MatchingSettings(distance=distance, weights=weights, factorise=factorise))
    x = torch.rand((obs.batch_size, *obs.input_shape), generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    total, _ = matcher.objective(x, y)  # warm-up (and the factorised path's one check)
    torch.autograd.grad(total, x)
    start = time.perf_counter()
    for _ in range(steps):
        total, _ = matcher.objective(x, y)
        torch.autograd.grad(total, x)
    return (time.perf_counter() - start) / steps


def run(quick: bool = False) -> None:
    ds, source = benchmark_images(8)
    x, y = ds.batch(4, seed=0)
    widths = (1000, 5000, 20000) if quick else (1000, 5000, 20000, 40000)
    steps, rounds = (3, 2) if quick else (5, 3)
    for spec in ("convnet-8", "mlp:256"):
        model = lb.build(spec, input_shape=ds.shape, classes=ds.num_classes, seed=0)
        train = spec.startswith("convnet")
        observations = {0: lb.observe(model, x, y, labels_known=True, train=train)}
        for width in widths:
            observations[width] = lb.observe(random_head(model, width=width, seed=0), x, y, labels_known=True,
                                             train=train)
        for distance, weights, label in (("cosine", "equal", "IG cosine"),
                                         ("cosine-layer", "l0", "liu2024 per-tensor cosine, ℓ0")):
            _table(spec, label, observations, y, distance, weights, steps, rounds, source)


def _table(spec, label, observations, y, distance, weights, steps, rounds, source) -> None:
    best = {(w, mode): float("inf") for w in observations for mode in ("off", "auto")}
    for _ in range(rounds):  # every configuration once per round, so load drifts hit them alike
        for (width, mode) in best:
            best[width, mode] = min(best[width, mode],
                                    _step_seconds(observations[width], y, distance, weights, mode, steps))
    base = min(best[0, "off"], best[0, "auto"])
    rows = [("no head", best[0, "off"], best[0, "auto"], best[0, "off"] / best[0, "auto"], "", "")]
    for width in [w for w in observations if w]:
        off, auto = best[width, "off"], best[width, "auto"]
        rows.append((width, off, auto, off / auto, f"{1e6 * (off - base) / width:.3g}",
                     f"{1e6 * (auto - base) / width:.3g}"))
    what = "BN in training mode" if spec.startswith("convnet") else "features 256"
    table(f"s/step vs random-head width — {label} ({spec}, {what}, batch 4, 32×32)",
          ["width", "dense", "factorised", "ratio", "dense ms/1k", "fact. ms/1k"], rows,
          note=f"{source}; s/step, best of {rounds} rounds of {steps} steps, all configurations in each round, "
               f"one process; threads={torch.get_num_threads()}; ms/1k = head cost (s/step − no head) per 1 000 "
               "neurons: constant = linear growth")
