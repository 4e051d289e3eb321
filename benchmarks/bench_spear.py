"""SPEAR against the other analytic batch attacks on ReLU MLPs, and under defenses.

1. ``mlp:1000`` and ``mlp:1000-1000`` (ReLU, untrained, eval mode), undefended gradients of digits upsampled to
   28×28, three batches per B: samples recovered exactly (above 60 dB after the best one-to-one matching),
   certified, and certified yet wrong (max-abs error > 1e-4), and seconds, of ``spear``, beside ``exclusivity`` and
   ``cocktail-party`` (first batch) and a grey image (the data-range centre), with the numerical rank of ∂L/∂W
   (SPEAR's factorisation needs rank B; these digits are 8×8 images upsampled, so a batch lives in ~55
   dimensions, and spear's peeling reaches past that).
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


def _spear_counts(obs, x: torch.Tensor) -> tuple[int, int, int, float, int]:
    """exact (> 60 dB), certified, falsely certified (max-abs error > 1e-4 after matching), seconds, rank."""
    rec, seconds = _timed("spear", obs)
    scores = lb.compare(rec, x)
    psnr = torch.tensor(scores["per_sample"]["psnr"])
    order = torch.tensor(scores["order"])
    b = x.shape[0]
    err = (x.reshape(b, -1).double() - rec.images.reshape(b, -1).double()[order]).abs().amax(1)
    certified = rec.confidence.bool()[order]
    return (int((psnr > 60).sum()), int(certified.sum()), int((certified & (err > 1e-4)).sum()), seconds,
            rec.trace["rank"])


def _curve(label: str, batches, model, quick: bool, others: bool) -> list[tuple]:
    """One row per B: spear summed over the batches (n = batches × B), the others on the first batch only."""
    rows = []
    for batch, pairs in batches:
        counts = [_spear_counts(lb.observe(model, x, y), x) for x, y in pairs]
        total = batch * len(pairs)
        exact, cert, false = (sum(c[i] for c in counts) for i in range(3))
        row = [label, batch, len(pairs), "/".join(str(c[4]) for c in counts), f"{exact}/{total}", cert, false,
               max(c[3] for c in counts)]
        x, y = pairs[0]
        if others:
            obs = lb.observe(model, x, y)
            try:
                excl, t_excl = _timed("exclusivity", obs)
                p_excl = _scores(excl, x)
            except NothingRecovered:  # no sample identified: nothing exact
                p_excl, t_excl = torch.zeros(0), math.nan
            cpa, t_cpa = _timed("cocktail-party", obs, preset="quick" if quick else None)
            p_cpa = _scores(cpa.images.clamp(0, 1), x)
            row += [f"{int((p_excl > 60).sum())}/{batch}", t_excl,
                    f"{int((p_cpa > 60).sum())}/{batch} ({float(p_cpa.median()):.1f} dB)", t_cpa]
        row.append(float(_scores(torch.full_like(x, 0.5), x).median()))
        rows.append(tuple(row))
    return rows


COLUMNS = ["data", "B", "batches", "rank ∂W", "spear exact", "certified", "false cert.", "spear s (max)"]
OTHERS = ["exclusivity exact (1st)", "excl. s", "cocktail-party exact (median, 1st)", "CPA s"]


def digits(quick: bool) -> None:
    data = lb.load("digits", size=28)
    rows = []
    for arch in ("mlp:1000",) if quick else ("mlp:1000", "mlp:1000-1000"):
        model = lb.build(arch, input_shape=data.shape, classes=10, seed=0)
        seeds = (0,) if quick else (0, 1, 2)
        sizes = QUICK_BATCHES if quick else (BATCHES if arch == "mlp:1000" else (32, 64))
        batches = [(b, [data.batch(b, seed=100 * k + b) for k in seeds]) for b in sizes]
        rows += _curve(f"digits 28×28, {arch}", batches, model, quick, others=True)
    table("exact samples (> 60 dB, matched) against B: ReLU MLPs, untrained, undefended",
          COLUMNS + OTHERS + ["grey dB"], rows,
          note="batches: data.batch(B, seed=100·k + B), k = 0, 1, 2 (quick: k = 0); exact/certified summed over "
               "them (n = batches × B); false cert.: certified yet more than 1e-4 off (max-abs); exclusivity and "
               "cocktail-party on the first batch; times on this machine, shared with other work")


def cifar(quick: bool) -> None:
    if not CIFAR_NPZ.exists():
        table("CIFAR-10 as 3 072-vectors", ["skipped"], [(f"{CIFAR_NPZ} absent",)])
        return
    from leakbench.data.cifar import CIFAR10_CLASSES

    data = lb.load("npz", path=str(CIFAR_NPZ), classes=list(CIFAR10_CLASSES))
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0)
    batches = []
    for batch in QUICK_BATCHES if quick else BATCHES:
        starts = [500] if quick else [500 + k * batch for k in range(2 if batch <= 64 else 1)]
        batches.append((batch, [(data.images[s:s + batch], data.labels[s:s + batch]) for s in starts]))
    columns = COLUMNS + ([] if quick else OTHERS)
    table("exact samples against B on CIFAR-10 test images 500… (mlp:1000 on 3 072-vectors)", columns + ["grey dB"],
          _curve("CIFAR-10", batches, model, quick, others=not quick),
          note="batches: consecutive test images from 500 (two per B up to 64, one at 128)")


def defended(quick: bool) -> None:
    data = lb.load("digits", size=28)
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0)
    x, y = data.batch(16, seed=7)
    settings = ["none", "clip:1", "noise:1e-7", "noise:1e-6", "noise:1e-4", "dpsgd:1,0.01"] if quick else \
        ["none", "clip:1", "clip:0.01", "noise:1e-7", "noise:1e-6", "noise:1e-5", "noise:1e-4", "noise:1e-3",
         "dpsgd:1,0.001", "dpsgd:1,0.01", "dpsgd:1,0.1", "dpsgd:1,1"]
    grey = float(_scores(torch.full_like(x, 0.5), x).median())
    rows = []
    for defense in settings:
        obs = lb.observe(model, x, y, defense=defense, seed=0)
        rec, seconds = _timed("spear", obs)
        psnr = _scores(rec, x)
        exact, cert, false, _, _ = _spear_counts(obs, x)
        rows.append((defense, f"{exact}/16", cert, false, float(psnr.median()), float(psnr.min()), seconds, grey))
    table("spear under defenses: digits 28×28, B = 16, mlp:1000", ["defense", "exact", "certified", "false cert.",
          "median dB", "min dB", "seconds", "grey dB"], rows,
          note="clipping rescales the whole gradient (zeros and span unchanged); noise and DP-SGD fill the zeros")


def run(quick: bool = False) -> None:
    digits(quick)
    cifar(quick)
    defended(quick)
