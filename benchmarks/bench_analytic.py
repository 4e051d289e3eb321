"""Analytic attacks against Inverting Gradients, exclusivity on MLP batches, security-metric timing.

1. Batch 1, 32×32 images, the same observation for every attack in this process:
   ``fc-inversion`` on an MLP and ``rgap`` / ``hybrid`` on Chen & Campbell's CNN2 Variant 1
   (full rank) and Variant 2 (rank-deficient), each against ``inverting-gradients``
   (``quick`` preset, 300 iterations) on the same observation: seconds, MSE, PSNR.
2. ``exclusivity`` on ReLU MLP batches (digits upsampled to 28×28) against
   ``inverting-gradients`` (quick) on the same batch: seconds, samples determined uniquely,
   PSNR after Hungarian matching.
3. ``security_metric`` on the architectures of Table 1: seconds, rank deficiencies, metric.

PSNR is the standard one on [0, 1] images (the paper's Appendix E adds 48.13 dB: peak 255).
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.analysis import security_metric

from .common import benchmark_images, table

TABLE1 = {
    "CNN2 V1": "cnn:3-6-1-0", "CNN2 V2": "cnn:4-6-2-0", "CNN3 V1": "cnn:3-6-1-0,4-3-2-0",
    "CNN3 V2": "cnn:4-6-2-0,3-3-2-0", "CNN3 V3": "cnn:3-6-1-0,3-9-1-0", "CNN3 V4": "cnn:3-1-1-0,3-6-1-0",
    "CNN4 V1": "cnn:3-6-1-0,4-5-2-0,4-3-1-0", "CNN4 V2": "cnn:5-16-1-0,5-6-2-0,5-32-1-2",
}


def _score(name: str, obs, x, y, **options) -> tuple[float, float, float]:
    start = time.perf_counter()
    rec = lb.attack(name, obs, **options)
    seconds = time.perf_counter() - start
    images = rec.images.float().clamp(0, 1)
    scores = lb.compare(images, x.float(), match=True)
    return seconds, float(scores["mse"]), float(scores["psnr"])


def single_image(quick: bool) -> None:
    ds, source = benchmark_images(4)
    x, y = ds.batch(1, seed=0)
    x64 = x.double()
    hybrid = {"preset": "quick"} if quick else {"iters_1": 2000, "iters_2": 1000, "iters_rest": 500, "lr": 1e-2}
    rows = []
    mlp = lb.build("mlp:1000", input_shape=ds.shape, classes=ds.num_classes, seed=0, dtype=torch.float64)
    obs = lb.observe(mlp, x64, y)
    rows.append(("MLP 3072-1000", "fc-inversion", *_score("fc-inversion", obs, x, y)))
    rows.append(("MLP 3072-1000", "inverting-gradients (quick)",
                 *_score("inverting-gradients", obs, x, y, preset="quick")))
    for label in ("CNN2 V1", "CNN2 V2"):
        model = lb.build(TABLE1[label], input_shape=ds.shape, classes=ds.num_classes, act="tanh",
                         bias={"conv": False, "linear": True}, init="uniform", seed=0, dtype=torch.float64)
        obs = lb.observe(model, x64, y)
        rows.append((label, "rgap", *_score("rgap", obs, x, y)))
        rows.append((label, "hybrid (" + ("quick" if quick else "2000/1000/500 it") + ")",
                     *_score("hybrid", obs, x, y, **hybrid)))
        rows.append((label, "inverting-gradients (quick)", *_score("inverting-gradients", obs, x, y, preset="quick")))
    table("analytic vs optimisation attacks, batch 1, same observation (float64 model)",
          ["model", "attack", "seconds", "MSE", "PSNR dB"], rows, note=source)


def batches(quick: bool) -> None:
    ds = lb.load("digits", size=28)
    configs = [("mlp:1000", 8), ("mlp:1000-1000", 16)] if quick else [("mlp:1000", 8), ("mlp:1000", 16),
                                                                      ("mlp:1000-1000", 16), ("mlp:2000-500", 32)]
    rows = []
    for spec, batch in configs:
        x, y = ds.batch(batch, seed=0)
        model = lb.build(spec, input_shape=ds.shape, classes=10, seed=0)
        obs = lb.observe(model, x, y)
        start = time.perf_counter()
        rec = lb.attack("exclusivity", obs)
        seconds = time.perf_counter() - start
        unique = sum(rec.trace["unique"])
        scores = lb.compare(rec.images.clamp(0, 1), x, match=True)
        ig_s, _, ig_psnr = _score("inverting-gradients", obs, x, y, preset="quick", tv=0.0)
        rows.append((spec, batch, seconds, f"{unique}/{batch}", float(scores["psnr"]), ig_s, ig_psnr))
    table("exclusivity on ReLU MLP batches (digits 28×28, float32) vs inverting-gradients quick (tv=0)",
          ["model", "batch", "exclusivity s", "unique", "exclusivity PSNR", "IG s", "IG PSNR"], rows,
          note="PSNR: mean over the batch after Hungarian matching; unique samples are exact (PSNR > 100 dB)")


def security(quick: bool) -> None:
    names = ["CNN2 V2", "CNN3 V1", "CNN3 V2", "CNN3 V4", "CNN4 V1"] if quick else list(TABLE1)
    rows = []
    for name in names:
        report = security_metric(TABLE1[name], (3, 32, 32))
        rows.append((name, TABLE1[name], report.seconds, str(report.rank_deficiencies), round(report.metric)))
    table("security metric (Chen & Campbell eq. 12) on Table 1 architectures, 3×32×32",
          ["variant", "spec", "seconds", "rank deficiencies", "metric"], rows)


def run(quick: bool = False) -> None:
    single_image(quick)
    batches(quick)
    security(quick)
