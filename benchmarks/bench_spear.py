"""SPEAR against the other analytic batch attacks on ReLU MLPs, and under defenses.

1. ``mlp:1000`` (ReLU, untrained, eval mode), undefended gradient of digits upsampled to 28×28: samples
   recovered exactly (above 60 dB after the best one-to-one matching; certified by spear), and seconds, of
   ``spear``, ``exclusivity`` and ``cocktail-party`` against B, beside a grey image (the data-range centre),
   and the numerical rank of ∂L/∂W (SPEAR needs rank B: these digits are 8×8 images upsampled, so every batch
   lives in ~55 dimensions).
2. The same on CIFAR-10 test images as 3 072-vectors when ../shared/data/cifar10-test-1000.npz is present
   (indices ≥ 500 only: below 500 is the tuning range of the gradient-matching presets).
3. Under defenses (digits, B = 16): noise, clipping and DP-SGD — how far SPEAR's exactness degrades.

``--quick`` runs B = 8, 16, 32 and fewer defense settings.
"""
from __future__ import annotations

import math
import time

import torch

import leakbench as lb
from leakbench.errors import NothingRecovered

from .common import CIFAR_NPZ, table

BATCHES = (8, 16, 32, 64, 128)
QUICK_BATCHES = (8, 16, 32)


def _scores(rec_or_images, x: torch.Tensor) -> torch.Tensor:
    """Per-original PSNR after the library's matching (confident-first when the attack flags exact slots)."""
    return torch.tensor(lb.compare(rec_or_images, x)["per_sample"]["psnr"])


def _timed(name: str, obs, **options):
    start = time.perf_counter()
    rec = lb.attack(name, obs, **options)
    return rec, time.perf_counter() - start


def _row(label: str, batch: int, obs, x: torch.Tensor, quick: bool, others: bool) -> tuple:
    spear, t_spear = _timed("spear", obs)
    p_spear = _scores(spear, x)
    row = [label, batch, spear.trace["rank"], f"{int((p_spear > 60).sum())}/{batch}",
           int(spear.confidence.sum()), t_spear]
    if others:
        try:
            excl, t_excl = _timed("exclusivity", obs)
            p_excl = _scores(excl, x)
        except NothingRecovered:  # no sample identified: nothing exact
            p_excl, t_excl = torch.zeros(0), math.nan
        cpa, t_cpa = _timed("cocktail-party", obs, preset="quick" if quick else None)
        p_cpa = _scores(cpa.images.clamp(0, 1), x)
        row += [f"{int((p_excl > 60).sum())}/{batch}", t_excl,
                f"{int((p_cpa > 60).sum())}/{batch} ({float(p_cpa.median()):.1f} dB)", t_cpa]
    grey = torch.full_like(x, 0.5)
    row.append(float(_scores(grey, x).median()))
    return tuple(row)


def digits(quick: bool) -> None:
    data = lb.load("digits", size=28)
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0)
    rows = []
    for batch in QUICK_BATCHES if quick else BATCHES:
        x, y = data.batch(batch, seed=100 + batch)
        rows.append(_row("digits 28×28", batch, lb.observe(model, x, y), x, quick, others=True))
    table("exact samples (> 60 dB, matched) against B: mlp:1000, ReLU, untrained, undefended",
          ["data", "B", "rank ∂W", "spear exact", "certified", "spear s", "exclusivity exact", "excl. s",
           "cocktail-party exact (median)", "CPA s", "grey dB"], rows,
          note="one batch per B (seed 100 + B); times on this machine, shared with other work")


def cifar(quick: bool) -> None:
    if not CIFAR_NPZ.exists():
        table("CIFAR-10 as 3 072-vectors", ["skipped"], [(f"{CIFAR_NPZ} absent",)])
        return
    from leakbench.data.files import CIFAR10_CLASSES

    data = lb.load("npz", path=str(CIFAR_NPZ), classes=list(CIFAR10_CLASSES))
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0)
    rows = []
    for batch in QUICK_BATCHES if quick else BATCHES:
        index = torch.arange(500, 500 + batch)
        x, y = data.images[index], data.labels[index]
        rows.append(_row("CIFAR-10", batch, lb.observe(model, x, y), x, quick, others=not quick))
    columns = ["data", "B", "rank ∂W", "spear exact", "certified", "spear s"]
    if not quick:
        columns += ["exclusivity exact", "excl. s", "cocktail-party exact (median)", "CPA s"]
    table("exact samples against B on CIFAR-10 test images 500… (mlp:1000 on 3 072-vectors)", columns + ["grey dB"],
          rows)


def defended(quick: bool) -> None:
    data = lb.load("digits", size=28)
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0)
    x, y = data.batch(16, seed=7)
    settings = ["none", "clip:1", "noise:1e-6", "noise:1e-4", "dpsgd:1,0.01"] if quick else \
        ["none", "clip:1", "clip:0.01", "noise:1e-7", "noise:1e-6", "noise:1e-5", "noise:1e-4", "noise:1e-3",
         "dpsgd:1,0.001", "dpsgd:1,0.01", "dpsgd:1,0.1", "dpsgd:1,1"]
    grey = float(_scores(torch.full_like(x, 0.5), x).median())
    rows = []
    for defense in settings:
        obs = lb.observe(model, x, y, defense=defense, seed=0)
        rec, seconds = _timed("spear", obs)
        psnr = _scores(rec, x)
        rows.append((defense, f"{int((psnr > 60).sum())}/16", int(rec.confidence.sum()), float(psnr.median()),
                     float(psnr.min()), seconds, grey))
    table("spear under defenses: digits 28×28, B = 16, mlp:1000", ["defense", "exact", "certified", "median dB",
          "min dB", "seconds", "grey dB"], rows,
          note="clipping rescales the whole gradient (zeros and span unchanged); noise and DP-SGD fill the zeros")


def run(quick: bool = False) -> None:
    digits(quick)
    cifar(quick)
    defended(quick)
