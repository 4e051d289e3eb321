"""Inverting Gradients on *trained* ConvNets, by label layout: does the output-layer feature term help there?

Issue 34, item 3: a trained model is what users audit.  Here a ConvNet is trained (plain SGD, ``RECIPES``)
on images the attacked batches do not hold, its held-out accuracy is printed, and then undefended one-step
gradients of held-out batches at B = 8 are attacked by an informed eavesdropper (labels known) with

* ``fast``          — the preset (500 steps): the per-label output-layer feature term on every label;
* ``fast unique``   — the term only on labels one image carries (``features_labels=unique``);
* ``fast off``      — no term (``features=0``, ``feature_phase=0``);
* ``fast tv=…``     — ``fast`` with a stronger, fixed TV prior (``tv=…, tv_growth=0``), the lever that moved it on
                      trained nets; ``LEAKBENCH_TRAINED_TV=0.03,0.1`` picks the weights (default 0.1, empty: none);
* ``default``       — the paper's preset (4 800 steps) when ``LEAKBENCH_TRAINED_DEFAULT=1`` (minutes per batch
                      on a CPU),

beside the flat grey image at each batch's mean, the chance level.  Layouts (B = 8): ``distinct`` (the first 8
classes of the attack pool: 0–7 on digits; on CIFAR the pool holds classes 5–9, a batch of 5), ``mixed`` (5 6 7 8 9 5 6 7) and ``2x4`` (5 5 5 5 7 7 7 7); three disjoint batches each, stacked in
one call per variant.  Where ``fast`` could not recover the features on any batch (the solve refuses, with its
reason), the other ``fast`` variants are the same run and are not repeated.

Data: CIFAR-10 test images of the shared subset when present (training on the images with index mod 100 < 50,
attacked batches from indices ≥ 500 with index mod 100 ≥ 50: classes 5–9, outside the presets' tuning range),
else bundled photos; and scikit-learn's digits at 28 × 28 (training on images 0–999, attacked batches from
1 000 on).  ``LEAKBENCH_TRAINED_DATA=cifar`` or ``digits`` runs one of them.  ``LEAKBENCH_TRAINED_POOL=tuning``
attacks CIFAR-10 images below index 500 instead (index mod 100 ≥ 50, not trained on: classes 0–4, the presets'
tuning range; the layouts' classes shift by −5), for choosing a setting before the held-out run.
``LEAKBENCH_TRAINED_VARIANTS=fast,fast tv=0.1`` keeps only some variants, ``LEAKBENCH_TRAINED_LAYOUTS=mixed,2x4``
only some layouts.
"""
from __future__ import annotations

import os
import time

import torch

import leakbench as lb
from leakbench.attacks import attack_batch
from leakbench.evaluation.training.utility import loss_and_accuracy, train_model

from .common import benchmark_images, console, env_names, env_pick, pattern_batches, table, tv_variants

MODEL = "convnet-16"
#: (epochs, batch size, lr) of plain SGD per dataset.  CIFAR-10's 500 training images need more: 10 epochs at lr 0.05
#: left the net at chance (0.11); 30 epochs at lr 0.02, batch 32 reach 0.45 held-out (training accuracy 1.0).
RECIPES = {"digits": (10, 16, 0.05), "cifar": (30, 32, 0.02)}
LAYOUTS = {"distinct": [], "mixed": [5, 6, 7, 8, 9, 5, 6, 7], "2x4": [5, 5, 5, 5, 7, 7, 7, 7]}
VARIANTS = {"fast": ("fast", {}), "fast off": ("fast", {"features": 0.0, "feature_phase": 0.0}),
            "fast unique": ("fast", {"features_labels": "unique"})}
DATA_ENV, DEFAULT_ENV = "LEAKBENCH_TRAINED_DATA", "LEAKBENCH_TRAINED_DEFAULT"
TV_ENV, POOL_ENV, VARIANTS_ENV = "LEAKBENCH_TRAINED_TV", "LEAKBENCH_TRAINED_POOL", "LEAKBENCH_TRAINED_VARIANTS"
LAYOUTS_ENV = "LEAKBENCH_TRAINED_LAYOUTS"


def _variants() -> dict[str, tuple[str, dict]]:
    """The attacks to run, from the environment (see the module docstring)."""
    variants = dict(VARIANTS)
    for tv in tv_variants(TV_ENV, "0.1"):
        variants[f"fast tv={tv:g}"] = ("fast", {"tv": tv, "tv_growth": 0.0})
    if os.environ.get(DEFAULT_ENV) == "1":
        variants["default"] = ("default", {})
    picked = env_pick(VARIANTS_ENV, variants)
    if "fast" not in picked:
        raise SystemExit(f"{VARIANTS_ENV}: keep 'fast' (the others are compared with it)")
    return picked


def _data(name: str):
    """(dataset, training indices, attack pool indices, source line)."""
    if name == "cifar":
        ds, source = benchmark_images(1000)
        n = len(ds.labels)
        train = [i for i in range(n) if i % 100 < 50]
        if os.environ.get(POOL_ENV, "") == "tuning":
            pool = [i for i in range(min(500, n)) if i % 100 >= 50]
            return ds, train, pool, source + "; trained on index mod 100 < 50, attacked < 500 (tuning) with mod 100 ≥ 50"
        pool = [i for i in range(500, n) if i % 100 >= 50] or [i for i in range(n) if i % 100 >= 50]
        return ds, train, pool, source + "; trained on index mod 100 < 50, attacked ≥ 500 with mod 100 ≥ 50"
    ds = lb.load("digits", size=28)
    return ds, list(range(1000)), list(range(1000, len(ds.labels))), "digits 28×28; trained on 0–999, attacked 1 000+"


def _batches(labels: torch.Tensor, pool: list[int], layout: list[int], count: int) -> list[list[int]]:
    """``count`` disjoint index lists from ``pool`` with the class pattern ``layout``."""
    return pattern_batches({c: [i for i in pool if int(labels[i]) == c] for c in set(layout)}, layout, count)


def run(*, quick: bool = False, device: str = "cpu") -> None:
    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available here")
    names = env_names(DATA_ENV) or ["cifar", "digits"]
    variants = _variants()
    layouts = env_pick(LAYOUTS_ENV, LAYOUTS)
    iterations = 100 if quick else None
    rows, sources = [], []
    start = time.perf_counter()
    for name in names:
        if name not in ("cifar", "digits"):
            raise SystemExit(f"{DATA_ENV}: unknown data {name!r}; known: cifar, digits")
        ds, train_idx, pool, source = _data(name)
        model = lb.build(MODEL, input_shape=ds.shape, classes=ds.num_classes, seed=0)
        epochs, batch_size, lr = RECIPES[name]
        trained = train_model(model, ds.subset(train_idx), epochs=2 if quick else epochs, batch_size=batch_size,
                              lr=lr, seed=0, device=where)
        sources.append(f"{source}; {epochs} epochs of SGD, lr {lr}, batch {batch_size}")
        model = trained.model.eval().to(where)
        trained_on = set(train_idx)
        test = [i for i in range(len(ds.labels)) if i not in trained_on]
        _, acc = loss_and_accuracy(model, ds.images[test].to(where), ds.labels[test].to(where))
        chance_acc = 1 / ds.num_classes
        present = sorted({int(ds.labels[i]) for i in pool})
        for layout, pattern in layouts.items():
            pattern = pattern or present[:8]       # distinct: the classes the attack pool holds (5 on CIFAR)
            if not set(pattern) <= set(present):   # the tuning pool holds classes 0–4: the same layout, shifted
                pattern = [c - 5 for c in pattern]
            pairs = [ds.batch(indices=idx) for idx in _batches(ds.labels, pool, pattern, 3)]
            observations = [lb.observe(model, x.to(where), y.to(where), labels_known=True) for x, y in pairs]
            grey = [lb.compare(torch.full_like(x, 0.0) + x.mean(), x, y)["psnr"] for x, y in pairs]
            psnr: dict[str, list[float]] = {}
            used_features: list[dict] = []
            for variant, (preset, options) in variants.items():
                if variant in ("fast off", "fast unique") and not any(
                        f.get("used") for f in used_features):
                    # the term was refused on every batch: these variants are the same run as ``fast``
                    console.print(f"[dim]{name} {layout} {variant}: the same run as fast (feature term refused: "
                                  f"{used_features[0].get('reason', '')[:120]})[/dim]", highlight=False)
                    continue
                t0 = time.perf_counter()
                extra = {"iterations": iterations} if iterations else {}
                recs = attack_batch("inverting-gradients", observations, seeds=[0, 1, 2], preset=preset,
                                    **options, **extra)
                bad = [r for r in recs if isinstance(r, Exception)]
                assert not bad, bad[0]
                psnr[variant] = [lb.compare(r.images.cpu(), x, y)["psnr"] for r, (x, y) in zip(recs, pairs)]
                chance_lines = sum(1 for r in recs if r.trace.get("chance"))
                feats = [r.trace.get("features", {}) for r in recs]
                if variant == "fast":
                    used_features = feats
                used = "/".join(str(f.get("labels", 0)) if f.get("used") else "–" for f in feats)
                over = [a - g for a, g in zip(psnr[variant], grey)]
                diff = ("–" if variant == "fast" or "fast" not in psnr else
                        "{:+.2f} ({:+.2f} … {:+.2f})".format(
                            *(lambda d: (sum(d) / 3, min(d), max(d)))(
                                [a - b for a, b in zip(psnr[variant], psnr["fast"])])))
                rows.append([name, f"{acc:.2f} (chance {chance_acc:.2f})", layout, variant,
                             " / ".join(f"{p:.2f}" for p in psnr[variant]),
                             " / ".join(f"{o:+.2f}" for o in over), diff, used, chance_lines,
                             f"{time.perf_counter() - t0:.0f}"])
                console.print(f"[dim]{' | '.join(map(str, rows[-1]))} ({time.perf_counter() - start:.0f} s)[/dim]",
                              highlight=False)
            console.print(f"[dim]{name} {layout}: grey {' / '.join(f'{g:.2f}' for g in grey)}[/dim]")
    table(f"IG on trained {MODEL} at B = 8 by label layout: PSNR (dB) of 3 held-out batches, labels known",
          ["data", "test accuracy", "layout", "attack", "PSNR per batch", "over grey per batch",
           "Δ vs fast: mean (min … max)", "labels matched", "'chance' traces", "s"],
          rows, "; ".join(sources) + " (quick: 2 epochs); "
                f"{time.perf_counter() - start:.0f} s on {where.type}.  'Δ vs fast' is paired per batch; "
                "inside the spread of 3 batches it is a tie.")
