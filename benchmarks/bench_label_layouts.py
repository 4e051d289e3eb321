"""Inverting Gradients ``fast`` at B = 5–8 on the label layouts clients have: does the output-layer feature term help?

Issue 34: the term matches each label's mean input to the output layer, recovered from that layer's gradient. On
a batch with distinct labels each mean is one image's features; on a label-skewed batch (a non-IID client) four
or eight images share one mean, and one such batch measured a 0.8 dB *cost*.  Here, per layout, three disjoint
batches of CIFAR-10 test images with indices below 500 (the tuning range; bundled photos when the subset is
absent), an untrained ``convnet-16`` in eval mode, labels known (an informed eavesdropper), ``fast``
(500 steps; ``--quick``: 100) with

* ``all``    — the term on every label (preset revision 3),
* ``unique`` — the term only on labels one image carries (``features_labels=unique``),
* ``off``    — no term (``features=0``, ``feature_phase=0``),

and the flat grey image at the batch mean as the chance level.  Layouts: ``distinct`` (8 labels), ``mixed``
(0 1 2 3 4 0 1 2: three labels shared by two images, two unique), ``2x4`` (two labels, four images each), ``1x8``
(one label); ``distinct`` is a batch of 5 (the subset's first 500 images hold 5 classes), the others of 8.
The table gives mean PSNR over the three batches and the paired difference to ``off`` (mean, min, max over the
batches); a difference inside the spread of three batches is a tie.  The three batches of one layout and variant
run as one stacked call (:func:`leakbench.attacks.attack_batch`).  ``LEAKBENCH_LAYOUTS=2x4,1x8`` runs some layouts
only; ``LEAKBENCH_LAYOUTS_TV=0.03,0.1`` adds variants ``tv=…`` (``fast`` with a fixed, stronger TV prior:
``tv=…, tv_growth=0``); ``LEAKBENCH_LAYOUTS_VARIANTS=off,tv=0.1`` keeps some variants (``off`` always runs: the
differences are to it).  Since ``fast`` revision 5 ``all`` and ``unique`` are the same run as ``off`` on a batch
whose every label holds three or more images (2 × 4, 1 × 8).
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.attacks import attack_batch

from .common import benchmark_images, console, env_pick, pattern_batches, table, tv_variants

MODEL = "convnet-16"
#: label patterns (the i-th class present below LIMIT); the CIFAR-10 subset's first 500 images hold 5 classes,
#: so ``distinct`` is a batch of 5 and the others of 8
LAYOUTS = {"distinct": [0, 1, 2, 3, 4], "mixed": [0, 1, 2, 3, 4, 0, 1, 2], "2x4": [1, 1, 1, 1, 3, 3, 3, 3],
           "1x8": [2] * 8}
VARIANTS = {"all": {}, "unique": {"features_labels": "unique"}, "off": {"features": 0.0, "feature_phase": 0.0}}
LIMIT = 500  # tuning range: images with index below it
LAYOUTS_ENV = "LEAKBENCH_LAYOUTS"  # e.g. "2x4,1x8": run these layouts only
TV_ENV, VARIANTS_ENV = "LEAKBENCH_LAYOUTS_TV", "LEAKBENCH_LAYOUTS_VARIANTS"


def _variants() -> dict[str, dict]:
    """The variants to run (``off`` always), from the environment (see the module docstring)."""
    variants = dict(VARIANTS)
    for tv in tv_variants(TV_ENV):
        variants[f"tv={tv:g}"] = {"tv": tv, "tv_growth": 0.0}
    picked = env_pick(VARIANTS_ENV, variants)
    return {k: v for k, v in variants.items() if k in picked or k == "off"}


def _batches(labels: torch.Tensor, layout: list[int], count: int) -> list[list[int]]:
    """``count`` disjoint index lists with the label pattern ``layout`` (c: the c-th class present), below LIMIT."""
    head = labels[:LIMIT]
    present = sorted(set(head.tolist()))
    pools = {c: [i for i in range(len(head)) if int(head[i]) == present[c % len(present)]] for c in set(layout)}
    return pattern_batches(pools, layout, count)


def run(*, quick: bool = False, model_name: str = MODEL, device: str = "cpu") -> None:
    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available here")
    data, source = benchmark_images(LIMIT)
    model = lb.build(model_name, input_shape=data.shape, classes=data.num_classes, seed=0).eval().to(where)
    iterations = 100 if quick else 500
    rows = []
    start = time.perf_counter()
    variants = _variants()
    for layout, pattern in env_pick(LAYOUTS_ENV, LAYOUTS).items():
        batches = _batches(data.labels, pattern, 3)
        pairs = [data.batch(indices=idx) for idx in batches]
        observations = [lb.observe(model, x.to(where), y.to(where), labels_known=True) for x, y in pairs]
        grey = [lb.compare(torch.full_like(x, 0.0) + x.mean(), x, y)["psnr"] for x, y in pairs]
        psnr: dict[str, list[float]] = {}
        used: dict[str, str] = {}
        for variant, options in variants.items():
            recs = attack_batch("inverting-gradients", observations, seeds=[0, 1, 2], preset="fast",
                                iterations=iterations, **options)
            bad = [r for r in recs if isinstance(r, Exception)]
            assert not bad, bad[0]
            psnr[variant] = [lb.compare(r.images.cpu(), x, y)["psnr"] for r, (x, y) in zip(recs, pairs)]
            feats = [r.trace.get("features", {}) for r in recs]
            used[variant] = "/".join(str(f.get("labels", 0)) if f.get("used") else "–" for f in feats)
        for variant in variants:
            diff = [a - b for a, b in zip(psnr[variant], psnr["off"])]
            rows.append([layout, variant, " / ".join(f"{p:.2f}" for p in psnr[variant]),
                         "–" if variant == "off" else f"{sum(diff) / 3:+.2f} ({min(diff):+.2f} … {max(diff):+.2f})",
                         used[variant], " / ".join(f"{g:.2f}" for g in grey)])
            console.print(f"[dim]{' | '.join(map(str, rows[-1]))} ({time.perf_counter() - start:.0f} s)[/dim]",
                          highlight=False)
    table(f"IG fast at B = 5 (distinct) and 8 by label layout: PSNR (dB) of 3 batches; {model_name}, {iterations} steps",
          ["layout", "feature term", "PSNR", "Δ vs off: mean (min … max)", "labels matched per batch", "grey"],
          rows, f"{source}; indices < {LIMIT}; labels known; untrained {model_name} in eval mode; "
                f"{time.perf_counter() - start:.0f} s on {where.type}.")
