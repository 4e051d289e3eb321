"""The literature's defenses against their adaptive attacks, beside noise and prune (issue 45, part 2).

One table per dataset: each defense at two strengths; per cell the non-adaptive Inverting Gradients (``fast``,
without the output-layer feature term, which every defense here corrupts) and, for soteria, topk, mixup,
instahide, precode and ats, the attack that knows the defense (:mod:`leakbench.attacks.gradient.adaptive`); the strongest of them
by mean PSNR is named (``adaptive`` when it is the adaptive one).  PSNR and SSIM after Hungarian matching, n batch
draws, 95 % t-intervals, against the grey image (a flat image at the tuning split's mean pixel) on the same
batches: a Δ whose interval holds 0 is written as a tie with chance, and an adaptive-vs-plain difference whose
paired interval holds 0 as a tie.  Utility: test accuracy after a short training with the defense in every step,
mean ± sd over training seeds, beside the undefended model's.

The attacked network is the freshly initialised one (round 0 of training, accuracy at chance ≈ 0.1): the table's
accuracies belong to the utility runs, not to the attacked model.  ``LEAKBENCH_LIT_TRAINED=E`` attacks instead the
same network trained for E epochs without a defense on the utility split (batch 16, lr 0.1, seed 0; its held-out
accuracy on the tuning split in the table's note): a later round of training, with each defense applied to the
attacked round only (PRECODE's bottleneck is then inserted untrained into the trained network, as at round 0).

Splits: digits — attack batches from indices 1300–1796, the grey level and the InstaHide attacker's prior mean
pixel from 1000–1299 (tuning), utility trained on 0–999 (a quarter held out for accuracy); CIFAR-10 (the
1000-image test file, at 16 × 16, split by index mod 100: :func:`_data`) — attack batches from 500–999 with mod 100 ≥ 50,
tuning pixels from 0–499 with mod 100 ≥ 50, utility on mod 100 < 50.
``LEAKBENCH_LIT_DATA=digits`` (or ``cifar``) runs one dataset; ``LEAKBENCH_LIT_ITERATIONS`` sets the attack budget
(120 on digits, 500 on CIFAR-10, whose images run at 16 × 16: :data:`SETUPS` says why); ``LEAKBENCH_LIT_SPECS=precode:256,ats:3-1-7``
(specs joined by commas; ``none`` is always run) runs a subset of the rows; ``LEAKBENCH_LIT_BATCH`` sets B (2), ``LEAKBENCH_LIT_DRAWS`` the batch draws per row (3 on digits, 8 on CIFAR-10).
"""
from __future__ import annotations

import math
import os
import statistics
import time

import torch

import leakbench as lb
from leakbench.evaluation.training.utility import loss_and_accuracy, train_model, utility_seeds

from .common import benchmark_images, console, interval, resized, table

ADAPTIVE = {"soteria": "soteria-adaptive", "topk": "topk-adaptive", "mixup": "mixup-adaptive",
            "instahide": "instahide-carlini", "precode": "precode-adaptive", "ats": "ats-adaptive"}
SPECS = ["none", "noise:0.01", "noise:0.1", "prune:0.9", "prune:0.99", "soteria:0.4", "soteria:0.8",
         "topk:0.1", "topk:0.01", "mixup:0.2", "mixup:1", "instahide:2", "instahide:4", "precode:256",
         "precode:16,0.01", "ats:43-18-18", "ats:3-1-7", "ats:3-1-7/43-18-18"]
QUICK_SPECS = ["none", "noise:0.1", "soteria:0.8", "topk:0.01", "mixup:1", "instahide:4", "precode:16,0.01",
               "ats:3-1-7"]
#: (model, act, batch, draws, utility epochs, attack iterations, image size in px (None: the dataset's own)).
#: CIFAR-10 runs at 16 × 16 on the digits' stride-1 CNN with 500 iterations: at 32 × 32 on
#: ``cnn:3-8-2-1,3-16-2-1`` (two stride-2 layers) the attack matched the gradient to a cosine distance of 1e-5 and
#: still stayed at the grey image's PSNR on three tuning batches (−0.2 / +0.8 / +0.8 dB at 500 iterations):
#: that network's gradient does not pin a 32 × 32 batch of two.  At 16 × 16 the stride-1 CNN was +1.2 / +3.3 / +3.6
#: dB above grey on the same tuning batches (B = 2), and exact at B = 1 (51 dB).
SETUPS = {"digits": ("cnn:3-8-1-1,3-8-2-1", "tanh", 2, 3, 3, 120, None),
          "cifar": ("cnn:3-8-1-1,3-8-2-1", "tanh", 2, 8, 2, 500, 16)}


def fmt(values: list[float]) -> str:
    mean, half = interval(values)
    return f"{mean:.2f} ± {half:.2f}"


def verdict(diffs: list[float], above: str, below: str) -> str:
    mean, half = interval(diffs)
    if not math.isfinite(half) or abs(mean) <= half:
        return "tie"
    return above if mean > 0 else below


def _data(name: str):
    """(dataset, attack pool, tuning indices, utility indices, source).  CIFAR-10's 1 000 test images (100 per class,
    in class order) are split by index mod 100, so that the utility runs and a trained attacked model see every class:
    attacked from 500 on with mod 100 ≥ 50, tuning below 500 with mod 100 ≥ 50, trained on mod 100 < 50 (the split
    of bench_learned_prior).  (A split by index would train on classes 0–4 only and test on one class.)"""
    if name == "cifar":
        ds, source = benchmark_images(1000)
        size = SETUPS[name][6]
        if size:
            ds, source = resized(ds, size), f"{source} at {size}×{size} (bilinear, antialiased)"
        n = len(ds.labels)
        return (ds, [i for i in range(n // 2, n) if i % 100 >= 50], [i for i in range(n // 2) if i % 100 >= 50],
                [i for i in range(n) if i % 100 < 50], source)
    ds = lb.load("digits")
    return ds, list(range(1300, len(ds.labels))), list(range(1000, 1300)), list(range(1000)), "sklearn digits 8×8"


def attack_cell(ds, model, pool, spec, batch, draws, iterations, grey, prior) -> dict[str, dict[str, list[float]]]:
    """attack → {"psnr", "ssim", "chance"} over ``draws`` batches of the pool."""
    family = spec.partition(":")[0]
    names = ["inverting-gradients"] + ([ADAPTIVE[family]] if family in ADAPTIVE else [])
    out = {name: {"psnr": [], "ssim": [], "chance": []} for name in names}
    gen = torch.Generator().manual_seed(0)
    for d in range(draws):
        idx = [pool[int(i)] for i in torch.randperm(len(pool), generator=gen)[:batch]]
        x, y = ds.images[idx], ds.labels[idx]
        obs = lb.observe(model, x, y, labels_known=True, defense=spec, seed=d)
        for name in names:
            options = {"iterations": iterations}
            if name == "inverting-gradients":
                options["features"] = 0.0
            if name == "instahide-carlini":
                options["prior_mean"] = prior
            rec = lb.attack(name, obs, preset="fast", seed=d, **options)
            score = lb.compare(rec, x, y, chance_level=grey)
            out[name]["psnr"].append(float(score["psnr"]))
            out[name]["ssim"].append(float(score["ssim"]))
            out[name]["chance"].append(float(score["chance_psnr"]))
    return out


def run(quick: bool = False) -> None:
    width = console.width
    console.width = max(width, 170)
    try:
        for name in [n for n in os.environ.get("LEAKBENCH_LIT_DATA", "digits,cifar").split(",") if n]:
            if name not in SETUPS:
                raise SystemExit(f"LEAKBENCH_LIT_DATA: unknown data {name!r}; known: {', '.join(SETUPS)}")
            _run(name, quick)
    finally:
        console.width = width


def _run(name: str, quick: bool) -> None:
    model_spec, act, batch, draws, epochs, iterations, _ = SETUPS[name]
    batch = int(os.environ.get("LEAKBENCH_LIT_BATCH", batch))
    draws = int(os.environ.get("LEAKBENCH_LIT_DRAWS", draws))
    if batch < 1 or draws < 1:
        raise SystemExit(f"LEAKBENCH_LIT_BATCH and LEAKBENCH_LIT_DRAWS: expected ≥ 1, got {batch} and {draws}")
    iterations, seeds = (60, [0]) if quick else (int(os.environ.get("LEAKBENCH_LIT_ITERATIONS", iterations)), [0, 1])
    specs = QUICK_SPECS if quick else SPECS
    chosen = [s.strip() for s in os.environ.get("LEAKBENCH_LIT_SPECS", "").split(",") if s.strip()]
    if chosen:  # a spec's own commas (precode:16,0.01) are rejoined: a piece without ':' continues the last spec
        joined: list[str] = []
        for piece in chosen:
            if ":" not in piece and joined and piece != "none":
                joined[-1] += "," + piece
            else:
                joined.append(piece)
        specs = ["none"] + [s for s in joined if s != "none"]
    draws = 1 if quick else draws
    trained = int(os.environ.get("LEAKBENCH_LIT_TRAINED", "0"))
    if trained < 0:
        raise SystemExit(f"LEAKBENCH_LIT_TRAINED: expected epochs ≥ 0, got {trained}")
    ds, pool, tuning, train_idx, source = _data(name)
    grey = prior = float(ds.images[tuning].mean())
    model = lb.build(model_spec, input_shape=ds.shape, classes=ds.num_classes, act=act, seed=0)
    if trained:
        model = train_model(model, ds.subset(train_idx), epochs=trained, batch_size=16, lr=0.1, seed=0).model.eval()
    # accuracy on images the attacked model never trained on (the tuning split: every class)
    attacked_acc = loss_and_accuracy(model, ds.images[tuning], ds.labels[tuning])[1]
    attacked = (f"trained {trained} epochs undefended (held-out accuracy {attacked_acc:.3f})" if trained
                else f"freshly initialised (accuracy {attacked_acc:.3f})")
    console.print(f"[dim]{name}: attacked {model_spec} {attacked}[/dim]")
    start = time.perf_counter()
    cells = {}
    for spec in specs:
        cells[spec] = attack_cell(ds, model, pool, spec, batch, draws, iterations, grey, prior)
        console.print(f"[dim]{name} {spec}: " + ", ".join(f"{a} {fmt(v['psnr'])} dB" for a, v in cells[spec].items())
                      + f" (grey {fmt(next(iter(cells[spec].values()))['chance'])} dB)[/dim]")
    t_attack = time.perf_counter() - start
    start = time.perf_counter()
    train = ds.subset(train_idx)
    util = {}
    for spec in specs:
        runs = utility_seeds(model_spec, train, spec, seeds=seeds, epochs=epochs, batch_size=16, lr=0.1,
                             model_options={"act": act}, cache_dir=False)
        util[spec] = [r.test_accuracy for r in runs if not isinstance(r, Exception)]
    t_util = time.perf_counter() - start
    base_acc = statistics.mean(util["none"]) if util["none"] else math.nan
    rows = []
    for spec in specs:
        cell = cells[spec]
        strongest = max(cell, key=lambda a: statistics.mean(cell[a]["psnr"]))
        best = cell[strongest]
        chance = best["chance"]
        delta = [p - c for p, c in zip(best["psnr"], chance)]
        plain = cell["inverting-gradients"]["psnr"]
        adaptive = [a for a in cell if a != "inverting-gradients"]
        if adaptive:
            ad = cell[adaptive[0]]["psnr"]
            versus = verdict([a - b for a, b in zip(ad, plain)], "adaptive wins", "plain wins")
            ad_cell = f"{fmt(ad)} ({versus})"
        else:
            ad_cell = "—"
        acc = util[spec]
        acc_cell = (f"{statistics.mean(acc):.3f} ± {statistics.stdev(acc):.3f}" if len(acc) > 1
                    else (f"{acc[0]:.3f}" if acc else "failed"))
        label = strongest + (" (adaptive)" if strongest != "inverting-gradients" else "")
        rows.append([spec, label, fmt(best["psnr"]), fmt(best["ssim"]), len(best["psnr"]), fmt(chance),
                     f"{fmt(delta)} {verdict(delta, 'above chance', 'below chance')}", fmt(plain), ad_cell, acc_cell,
                     f"{statistics.mean(acc) - base_acc:+.3f}" if acc else "—"])
    table(f"Literature defenses with their adaptive attacks — {name}",
          ["defense", "strongest attack", "PSNR", "SSIM", "n", "grey PSNR", "Δ vs grey", "IG (plain) PSNR",
           "adaptive PSNR (vs plain)", "test acc", "Δ acc"], rows,
          note=(f"{source}; {model_spec} act={act}, {attacked} for the attacks; B={batch}, "
                f"{draws} draws from the report split, labels known, preset fast, {iterations} iterations "
                f"({t_attack:.0f} s); ± = 95 % t-interval half-width; 'tie' = interval holds 0.  Utility: "
                f"{epochs} epochs, batch 16, lr 0.1, seeds {seeds}, 25 % of the utility split held out "
                f"({t_util:.0f} s); test acc mean ± sd over seeds; threads={torch.get_num_threads()}"))
