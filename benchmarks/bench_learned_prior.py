"""A learned image prior (GIAS, Jeon et al. 2021) against Inverting Gradients' ``trained`` preset on a trained ConvNet.

Issue 44, part 3: on a ConvNet trained to classify its inputs confidently, one step's gradient pins the images
weakly, and pixel-space gradient matching ends near a grey image (docs/cli.md, "On a trained network").  GIAS
searches the latent space of a generator trained on public images (the library's own VAE decoder, trained on digits
0–999, :mod:`leakbench.models.prior`) and then fine-tunes one generator copy per image.

Set-up: scikit-learn's digits at ``LEAKBENCH_PRIOR_SIZE`` px (default 16: the CPU budget; 28 is the trained-layouts
benchmark's size), ``convnet-16`` trained with plain SGD (10 epochs, batch 16, lr 0.05, seed 0) on digits 0–999 —
the same images the generator is trained on, none attacked — its accuracy on digits 1 000+ printed.  Attacked:
undefended one-step gradients of disjoint batches, labels known (the informed eavesdropper), drawn by a seeded
permutation from the **report pool** (digits 1 300–1 796) or, with ``LEAKBENCH_PRIOR_POOL=tuning``, the **tuning
pool** (digits 1 000–1 299), on which the presets were chosen.  Rows: the grey image at each batch's mean (chance),
``inverting-gradients`` preset ``trained`` (the batches stacked in one call), and ``gias`` (default preset; the
first run trains the generator, about half a minute, then it is cached).

``LEAKBENCH_PRIOR_B=4,8`` the batch sizes, ``LEAKBENCH_PRIOR_N=8`` the batches per size,
``LEAKBENCH_PRIOR_ATTACKS=trained,gias`` which attacks, ``LEAKBENCH_PRIOR_GIAS='{"restarts": 1}'`` options for gias
(JSON, for tuning).  ``LEAKBENCH_PRIOR_LOCAL=1,0.05,2`` observes a FedAvg client's update instead of the gradient:
``epochs`` local epochs of minibatch SGD at ``lr`` in minibatches of ``b`` over the batch (``lb.observe``'s
``local_steps``, ``local_lr``, ``local_batch``); both attacks simulate those steps (the issue's "B = 4 after one local
epoch").
"""
from __future__ import annotations

import json
import os
import time

import torch

import leakbench as lb
from leakbench.attacks import attack_batch
from leakbench.evaluation.training.utility import loss_and_accuracy, train_model

from .common import console, env_ints, env_names, table

MODEL = "convnet-16"
RECIPE = (10, 16, 0.05)  # epochs, batch, lr: bench_trained_layouts' digits recipe
TRAIN = range(0, 1000)
POOLS = {"report": range(1300, 1797), "tuning": range(1000, 1300)}


def batches(pool: str, size: int, count: int) -> list[list[int]]:
    """``count`` disjoint batches of ``size`` digits indices from ``pool`` (a seeded permutation, seed = size)."""
    indices = list(POOLS[pool])
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


def run(*, quick: bool = False) -> None:
    size = env_ints("LEAKBENCH_PRIOR_SIZE", "16")[0]
    sizes = env_ints("LEAKBENCH_PRIOR_B", "4,8")
    count = env_ints("LEAKBENCH_PRIOR_N", "2" if quick else "8")[0]
    pool = os.environ.get("LEAKBENCH_PRIOR_POOL", "report")
    if pool not in POOLS:
        raise SystemExit(f"LEAKBENCH_PRIOR_POOL: unknown pool {pool!r}; known: {', '.join(POOLS)}")
    attacks = env_names("LEAKBENCH_PRIOR_ATTACKS") or ["trained", "gias"]
    if unknown := [a for a in attacks if a not in ("trained", "gias")]:
        raise SystemExit(f"LEAKBENCH_PRIOR_ATTACKS: unknown {', '.join(unknown)}; known: trained, gias")
    gias_options = json.loads(os.environ.get("LEAKBENCH_PRIOR_GIAS", "{}"))
    local = _local()
    quick_options = {"trained": {"iterations": 50}, "gias": {"latent_steps": 30, "generator_steps": 20}} if quick else {}

    start = time.perf_counter()
    ds = lb.load("digits", size=size)
    epochs, batch_size, lr = RECIPE
    model = lb.build(MODEL, input_shape=ds.shape, classes=ds.num_classes, seed=0)
    model = train_model(model, ds.subset(list(TRAIN)), epochs=2 if quick else epochs, batch_size=batch_size, lr=lr,
                        seed=0).model.eval()
    held = list(range(len(TRAIN), len(ds.labels)))
    _, acc = loss_and_accuracy(model, ds.images[held], ds.labels[held])
    console.print(f"[dim]{MODEL} on digits {size}×{size}: held-out accuracy {acc:.3f} "
                  f"({time.perf_counter() - start:.0f} s)[/dim]")

    rows = []
    for B in sizes:
        pairs = [ds.batch(indices=idx) for idx in batches(pool, B, count)]
        observations = [lb.observe(model, x, y, labels_known=True, **local) for x, y in pairs]
        grey = [lb.compare(torch.full_like(x, float(x.mean())), x, y)["psnr"] for x, y in pairs]
        rows.append([B, "grey (chance)", " / ".join(f"{g:.2f}" for g in grey), "+0.00", f"0 of {count}", "–", "–"])
        seconds: dict[str, float] = {}
        for name in attacks:
            t0 = time.perf_counter()
            if name == "trained":
                recs = attack_batch("inverting-gradients", observations, seeds=list(range(count)), preset="trained",
                                    **quick_options.get(name, {}))
            else:
                recs = [lb.attack("gias", obs, seed=b, **{**gias_options, **quick_options.get(name, {})})
                        for b, obs in enumerate(observations)]
            seconds[name] = (time.perf_counter() - t0) / count
            bad = [r for r in recs if isinstance(r, Exception)]
            if bad:
                raise SystemExit(f"{name} failed: {bad[0]}")
            over = [lb.compare(r.images.cpu(), x, y)["psnr"] - g for r, (x, y), g in zip(recs, pairs, grey)]
            label = "inverting-gradients trained" if name == "trained" else "gias"
            ratio = (f"{seconds['gias'] / seconds['trained']:.2f}" if name == "gias" and "trained" in seconds else "–")
            rows.append([B, label, " / ".join(f"{o:+.2f}" for o in over), f"{sum(over) / count:+.2f}",
                         f"{sum(o > 0 for o in over)} of {count}", f"{seconds[name]:.0f}", ratio])
            console.print(f"[dim]{' | '.join(map(str, rows[-1]))} ({time.perf_counter() - start:.0f} s)[/dim]",
                          highlight=False)
    table(f"Learned prior on a trained {MODEL} (digits {size}×{size}, accuracy {acc:.2f}): PSNR over grey (dB), "
          f"{count} held-out batches per B ({pool} pool), labels known",
          ["B", "attack", "over grey per batch", "mean", "above grey", "s / batch", "s ratio gias / trained"], rows,
          f"observed: {_describe(local)}; "
          f"trained on digits 0–999 ({'2' if quick else epochs} epochs SGD, lr {lr}, batch {batch_size}); generator "
          f"on digits 0–999; attacked pool {pool} (digits {POOLS[pool].start}–{POOLS[pool].stop - 1}); "
          f"{time.perf_counter() - start:.0f} s on {torch.get_num_threads()} thread(s).")
