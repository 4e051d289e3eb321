"""Learned image priors (GIAS, Jeon et al. 2021; GIFD, Fang et al. 2023; GGL, Li et al. 2022) and GradInversion's
group consistency (Yin et al. 2021) against Inverting Gradients' ``trained`` preset on a trained ConvNet.

Issue 44, part 3: on a ConvNet trained to classify its inputs confidently, one step's gradient pins the images
weakly, and pixel-space gradient matching ends near a grey image (docs/cli.md, "On a trained network").  GIAS
searches the latent space of a generator trained on public images (the library's own VAE decoder, trained on digits
0–999, :mod:`leakbench.models.prior`) and then fine-tunes one generator copy per image; GIFD follows the same latent
search with a search of the generator's intermediate features, each in an ℓ1 ball.

``LEAKBENCH_PRIOR_DATA=cifar`` runs the same on the shared CIFAR-10 test images (``../shared/data``) at
``LEAKBENCH_PRIOR_SIZE`` px: ``convnet-16`` trained on index mod 100 < 50 (30 epochs, lr 0.02, batch 32), the
generator trained on those 500 images, attacked mod 100 ≥ 50 (tuning pool below 500, report pool from 500 on).
``LEAKBENCH_PRIOR_MODEL=convnet-32`` attacks another network (any model spec; default ``convnet-16``), trained with the
same recipe and seed.

Set-up: scikit-learn's digits at ``LEAKBENCH_PRIOR_SIZE`` px (default 16: the CPU budget; 28 is the trained-layouts
benchmark's size), ``convnet-16`` trained with plain SGD (10 epochs, batch 16, lr 0.05, seed 0) on digits 0–999 —
the same images the generator is trained on, none attacked — its accuracy on digits 1 000+ printed.  Attacked:
undefended one-step gradients of disjoint batches, labels known (the informed eavesdropper), drawn by a seeded
permutation from the **report pool** (digits 1 300–1 796) or, with ``LEAKBENCH_PRIOR_POOL=tuning``, the **tuning
pool** (digits 1 000–1 299), on which the presets were chosen.  Rows: the grey image at each batch's mean (chance), and under every attack its
non-member control: batch j's reconstruction scored against batch j + 1's images and grey level (what the same
images score on a batch they were not built from: the prior's and the averaging's own share),
``inverting-gradients`` preset ``trained`` (the batches stacked in one call), ``gias``, ``gifd`` and ``ggl`` (default
presets; the first run trains the generator, about half a minute, then it is cached), and on request ``gradinversion``
(Inverting Gradients with GradInversion's group consistency, and its BN prior where statistics are granted).

``LEAKBENCH_PRIOR_B=4,8`` the batch sizes, ``LEAKBENCH_PRIOR_N=8`` the batches per size (``LEAKBENCH_PRIOR_FIRST=k``
attacks only batches k… of them: one run split over processes, the same batches and seeds),
``LEAKBENCH_PRIOR_ATTACKS=trained,gias,gifd,ggl`` which attacks (default: all but ``gradinversion``), ``LEAKBENCH_PRIOR_GIAS='{"restarts": 1}'`` /
``LEAKBENCH_PRIOR_GIFD='{"radius": 0.1}'`` / ``LEAKBENCH_PRIOR_TRAINED='{"local_model": "first-order"}'`` options
(JSON, for tuning; named in the row; likewise ``LEAKBENCH_PRIOR_GGL``, ``LEAKBENCH_PRIOR_GRADINVERSION``).
``LEAKBENCH_PRIOR_DEFENSE=prune:0.9`` has the client apply a defense (``ggl`` adapts to it).  ``LEAKBENCH_PRIOR_BN=1`` grants the batch's BN statistics (the client in train mode; set the attacks' ``bn`` weight
through their options).  ``LEAKBENCH_PRIOR_LOCAL=1,0.05,2`` observes a FedAvg client's update instead of the gradient:
``epochs`` local epochs of minibatch SGD at ``lr`` in minibatches of ``b`` over the batch (``lb.observe``'s
``local_steps``, ``local_lr``, ``local_batch``); every attack simulates those steps (the issue's "B = 4 after one local
epoch").
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import leakbench as lb
from leakbench.attacks import attack_batch
from leakbench.evaluation.training.utility import loss_and_accuracy, train_model

from .common import benchmark_images, console, env_ints, env_names, grey_psnr, mean_cell, resized, table

MODEL = "convnet-16"
#: (epochs, batch, lr) of plain SGD per dataset: bench_trained_layouts' recipes (CIFAR-10's 500 training images need
#: 30 epochs at lr 0.02 to leave chance)
RECIPES = {"digits": (10, 16, 0.05), "cifar": (30, 32, 0.02)}
TRAIN = range(0, 1000)
#: the generative attacks compared (options per attack: ``LEAKBENCH_PRIOR_GIAS`` / ``LEAKBENCH_PRIOR_GIFD``, JSON)
GENERATIVE = ("gias", "gifd", "ggl")
#: pixel-space matching: Inverting Gradients' ``trained`` preset, and GradInversion (its group consistency; the BN
#: prior when ``LEAKBENCH_PRIOR_BN=1``)
ATTACKS = ("trained", "gradinversion", *GENERATIVE)
POOLS = {"report": range(1300, 1797), "tuning": range(1000, 1300)}
#: CIFAR-10 (the shared 1 000 test images, 100 per class in class order): trained on, and the generator's public
#: data, index mod 100 < 50; attacked: mod 100 ≥ 50, below 500 (tuning) or from 500 on (report)
CIFAR_TRAIN = [i for i in range(1000) if i % 100 < 50]
CIFAR_POOLS = {"report": [i for i in range(500, 1000) if i % 100 >= 50],
               "tuning": [i for i in range(500) if i % 100 >= 50]}


def _data(name: str, size: int, folder: Path) -> tuple[lb.ImageDataset, list[int], dict, str, str]:
    """(dataset at ``size`` px, training indices, attack pools, the generator's ``public`` option, source line);
    CIFAR-10's public images are written to ``folder`` as an ``.npz``."""
    if name == "digits":
        return (lb.load("digits", size=size), list(TRAIN), {k: list(v) for k, v in POOLS.items()}, "digits",
                f"digits {size}×{size}: trained on 0–999, generator on 0–999")
    ds, source = benchmark_images(1000)
    if not source.startswith("CIFAR"):
        raise SystemExit(f"LEAKBENCH_PRIOR_DATA=cifar needs ../shared/data/cifar10-test-1000.npz ({source})")
    ds = resized(ds, size)
    public = folder / "cifar-public.npz"      # the generator's key hashes the images, not this path
    np.savez(public, x=ds.images[CIFAR_TRAIN].numpy(), y=ds.labels[CIFAR_TRAIN].numpy())
    return (ds, CIFAR_TRAIN, CIFAR_POOLS, str(public),
            f"CIFAR-10 test images at {size}×{size} (bilinear, antialiased): trained on index mod 100 < 50, generator "
            "on the same 500")


def batches(pools: dict, pool: str, size: int, count: int) -> list[list[int]]:
    """``count`` disjoint batches of ``size`` indices from ``pools[pool]`` (a seeded permutation, seed = size)."""
    indices = list(pools[pool])
    order = torch.randperm(len(indices), generator=torch.Generator().manual_seed(size)).tolist()
    if size * count > len(indices):
        raise SystemExit(f"{count} batches of {size} need {size * count} images; pool {pool} holds {len(indices)}")
    return [[indices[i] for i in order[b * size:(b + 1) * size]] for b in range(count)]


def _local() -> dict:
    """``LEAKBENCH_PRIOR_LOCAL=epochs,lr,b`` as ``lb.observe`` arguments (an update), or {} (the gradient)."""
    raw = os.environ.get("LEAKBENCH_PRIOR_LOCAL", "").strip()
    if not raw:
        return {}
    try:
        epochs, lr, b = raw.split(",")
        out = {"local_steps": int(epochs), "local_lr": float(lr), "local_batch": int(b)}
    except ValueError:
        raise SystemExit("LEAKBENCH_PRIOR_LOCAL: expected epochs,lr,minibatch, e.g. 1,0.05,2") from None
    if out["local_steps"] < 1 or out["local_batch"] < 1 or not out["local_lr"] > 0:
        raise SystemExit("LEAKBENCH_PRIOR_LOCAL: expected epochs ≥ 1, lr > 0 and minibatch ≥ 1, e.g. 1,0.05,2")
    return out


def _describe(local: dict) -> str:
    if not local:
        return "one undefended gradient"
    return (f"the update after {local['local_steps']} local epoch(s) of SGD (lr {local['local_lr']:g}, minibatches of "
            f"{local['local_batch']})")


@dataclass
class Setting:
    """The benchmark's trained network and data: ``LEAKBENCH_PRIOR_DATA`` at ``size`` px."""

    data: str
    name: str               # the model spec
    ds: lb.ImageDataset
    pools: dict
    public: str             # the generators' ``public`` option
    source: str
    model: torch.nn.Module  # trained, eval mode
    accuracy: float         # on every image it was not trained on
    recipe: tuple           # (epochs, batch, lr)


def setting(folder: Path, size: int, *, quick: bool = False) -> Setting:
    """Train ``LEAKBENCH_PRIOR_MODEL`` (default ``convnet-16``) on ``LEAKBENCH_PRIOR_DATA``'s training images (seed 0;
    CIFAR-10's public ``.npz`` written to ``folder``)."""
    data = os.environ.get("LEAKBENCH_PRIOR_DATA", "digits")
    if data not in RECIPES:
        raise SystemExit(f"LEAKBENCH_PRIOR_DATA: unknown data {data!r}; known: {', '.join(RECIPES)}")
    name = os.environ.get("LEAKBENCH_PRIOR_MODEL", "").strip() or MODEL
    ds, train, pools, public, source = _data(data, size, folder)
    epochs, batch_size, lr = RECIPES[data]
    epochs = 2 if quick else epochs
    try:
        model = lb.build(name, input_shape=ds.shape, classes=ds.num_classes, seed=0)
    except ValueError as err:
        raise SystemExit(f"LEAKBENCH_PRIOR_MODEL: {err}") from None
    model = train_model(model, ds.subset(train), epochs=epochs, batch_size=batch_size, lr=lr, seed=0).model.eval()
    held = sorted(set(range(len(ds.labels))) - set(train))
    _, acc = loss_and_accuracy(model, ds.images[held], ds.labels[held])
    return Setting(data, name, ds, pools, public, source, model, acc, (epochs, batch_size, lr))


def run(*, quick: bool = False) -> None:
    size = env_ints("LEAKBENCH_PRIOR_SIZE", "16")[0]
    sizes = env_ints("LEAKBENCH_PRIOR_B", "4,8")
    count = env_ints("LEAKBENCH_PRIOR_N", "2" if quick else "8")[0]
    first = env_ints("LEAKBENCH_PRIOR_FIRST", "0")[0]
    if not 0 <= first < count:
        raise SystemExit(f"LEAKBENCH_PRIOR_FIRST: expected a batch index from 0 to {count - 1}, got {first}")
    pool = os.environ.get("LEAKBENCH_PRIOR_POOL", "report")
    if pool not in POOLS:
        raise SystemExit(f"LEAKBENCH_PRIOR_POOL: unknown pool {pool!r}; known: {', '.join(POOLS)}")
    attacks = env_names("LEAKBENCH_PRIOR_ATTACKS") or ["trained", *GENERATIVE]
    if unknown := [a for a in attacks if a not in ATTACKS]:
        raise SystemExit(f"LEAKBENCH_PRIOR_ATTACKS: unknown {', '.join(unknown)}; known: {', '.join(ATTACKS)}")
    options = {name: json.loads(os.environ.get(f"LEAKBENCH_PRIOR_{name.upper()}", "{}")) for name in ATTACKS}
    local = _local()
    # the informed eavesdropper with BN statistics: the client trains in train mode, its batch statistics granted
    bn = {"train": True, "bn_stats": True} if os.environ.get("LEAKBENCH_PRIOR_BN") == "1" else {}
    # a defense the client applies (a spec, e.g. "topk:0.1"); ggl adapts to it through its transform T
    defense = os.environ.get("LEAKBENCH_PRIOR_DEFENSE", "").strip()
    quick_options = {"trained": {"iterations": 50}, "gias": {"latent_steps": 30, "generator_steps": 20},
                     "gifd": {"latent_steps": 30, "feature_steps": 7}, "ggl": {"evaluations": 100},
                     "gradinversion": {"iterations": 50}} if quick else {}

    start = time.perf_counter()
    scratch = tempfile.TemporaryDirectory(prefix="leakbench-prior-")   # removed when run returns
    s = setting(Path(scratch.name), size, quick=quick)
    ds, pools, model, acc, (epochs, batch_size, lr) = s.ds, s.pools, s.model, s.accuracy, s.recipe
    data, source = s.data, s.source
    for name in GENERATIVE:
        options[name].setdefault("public", s.public)
    console.print(f"[dim]{s.name} on {data} {size}×{size}: held-out accuracy {acc:.3f} "
                  f"({time.perf_counter() - start:.0f} s)[/dim]")

    rows = []
    for B in sizes:
        pairs = [ds.batch(indices=idx) for idx in batches(pools, pool, B, count)][first:]
        observations = [lb.observe(model, x, y, labels_known=True, **local, **bn, defense=defense or None, seed=b)
                        for b, (x, y) in enumerate(pairs, start=first)]
        grey = [grey_psnr(x, y) for x, y in pairs]
        rows.append([B, "grey (chance)", " / ".join(f"{g:.2f}" for g in grey), "+0.00", f"0 of {len(pairs)}", "–", "–"])
        seconds: dict[str, float] = {}
        for name in attacks:
            t0 = time.perf_counter()
            if name == "trained":
                recs = attack_batch("inverting-gradients", observations, seeds=list(range(first, count)), preset="trained",
                                    **{**options[name], **quick_options.get(name, {})})
            else:
                recs = [lb.attack(name, obs, seed=b, **{**options[name], **quick_options.get(name, {})})
                        for b, obs in enumerate(observations, start=first)]
            seconds[name] = (time.perf_counter() - t0) / len(pairs)
            bad = [r for r in recs if isinstance(r, Exception)]
            if bad:
                raise SystemExit(f"{name} failed: {bad[0]}")
            over = [lb.compare(r.images.cpu(), x, y)["psnr"] - g for r, (x, y), g in zip(recs, pairs, grey)]
            label = ("inverting-gradients trained" if name == "trained" else name) + "".join(
                f" {k}={v}" for k, v in options[name].items() if k != "public")
            ratio = (f"{seconds[name] / seconds['trained']:.2f}" if name != "trained" and "trained" in seconds else "–")
            rows.append([B, label, " / ".join(f"{o:+.2f}" for o in over), mean_cell(over),
                         f"{sum(o > 0 for o in over)} of {len(over)}", f"{seconds[name]:.0f}", ratio])
            console.print(f"[dim]{' | '.join(map(str, rows[-1]))} ({time.perf_counter() - start:.0f} s)[/dim]",
                          highlight=False)
            if len(pairs) > 1:  # non-member control: batch j's reconstruction scored against batch j + 1's images
                other = [lb.compare(recs[j].images.cpu(), *pairs[(j + 1) % len(pairs)])["psnr"]
                         - grey[(j + 1) % len(pairs)] for j in range(len(pairs))]
                rows.append([B, "  on the next batch's images (control)", " / ".join(f"{o:+.2f}" for o in other),
                             mean_cell(other), f"{sum(o > 0 for o in other)} of {len(other)}", "–", "–"])
    table(f"Learned prior on a trained {s.name} ({data} {size}×{size}, accuracy {acc:.2f}): PSNR over grey (dB), "
          f"{len(pairs)} held-out batches per B ({pool} pool{f', batches {first}–{count - 1}' if first else ''}), "
          "labels known",
          ["B", "attack", "over grey per batch", "mean [95 % t-interval]", "above grey", "s / batch", "s ratio to trained"], rows,
          f"observed: {_describe(local)}{', BN statistics granted (train mode)' if bn else ''}"
          f"{f', defense {defense}' if defense else ''}; {source} ({epochs} epochs SGD, lr {lr}, batch "
          f"{batch_size}); attacked pool {pool} (indices {min(pools[pool])}–{max(pools[pool])}); "
          f"{time.perf_counter() - start:.0f} s on {torch.get_num_threads()} thread(s).")
