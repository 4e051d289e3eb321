"""Peers: the GGL authors' code beside leakbench's ``ggl``, same trained ConvNet, same generator, same images.

Li et al. (CVPR 2022) published their code (https://github.com/zhuohangli/GGL, commit c555338 measured) with a
CelebA WGAN-GP and ImageNet's BigGAN, neither for these images.  So both sides get **the same generator**: the
library's VAE decoder that ``gias`` trains on the benchmark's public images (:mod:`leakbench.models.prior`; on
CIFAR-10 the ``gias`` ``colour`` preset's), exported as TorchScript.  What is compared is the attack around it —
GGL's gradient-free latent search: CMA-ES on the squared ℓ2 gradient distance plus the KL prior on the code — on
the trained network and images of ``benchmarks/bench_learned_prior.py`` (the same ``LEAKBENCH_PRIOR_DATA`` /
``_SIZE`` / ``_N`` / ``_POOL`` / ``_FIRST`` variables and the same model, trained here with the same seed).  GGL
attacks one image: B = 1, the label unknown to both (iDLG from the gradient).

Needs an environment of its own with the reference's requirements (``LEAKBENCH_GGL_PYTHON``) and a checkout of the
repository (``LEAKBENCH_GGL_REPO``)::

    LEAKBENCH_GGL_PYTHON=/path/to/venv/bin/python LEAKBENCH_GGL_REPO=/path/to/checkout \
        python -m benchmarks peers_ggl

Built here: the GIAS peer's environment (``bench_peers_gias``) plus ``pip install nevergrad gpytorch lpips pandas
matplotlib tqdm pytorch-pretrained-biggan``.  Without them the benchmark says why and skips.

Rows, per image in dB over the grey image at the image's mean (the chance row): the reference
(``benchmarks/peers/ggl_reference.py``: nevergrad's CMA, ``LEAKBENCH_GGL_ROUNDS`` rounds of 50 candidates, default
40: 2 000 evaluations); leakbench ``ggl`` on the **same objective** (``distance="l2"``, the KL weight times the
number of parameter tensors — the reference divides its distance by that number —, CMA-ES σ = 1 from z = 0 as
nevergrad's, no defense transform, the same number of evaluations); and leakbench ``ggl`` with its defaults (the
cosine distance, σ = 0.5) at that budget.  The paired rows are leakbench − reference per image with their 95 %
t-intervals: an interval holding 0 is a tie.  ``LEAKBENCH_PEERS_GGL`` adds options to both leakbench rows (JSON).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import leakbench as lb

from .bench_learned_prior import batches, setting
from .bench_peers_gias import _export
from .common import console, env_ints, grey_psnr, mean_cell, table
from .peers.driver import Images, call, environment, paired, prior

#: the generator per data: CIFAR-10's is ``gias``'s ``colour`` preset's
GENERATORS = {"cifar": {"prior_width": 16, "latent": 32, "prior_steps": 3000}, "digits": {}}
#: candidates per round of the reference's loop (its ``NGReconstructor.num_samples``)
PER_ROUND = 50


def run(*, quick: bool = False) -> None:
    needs = "the reference's requirements: torch, nevergrad, gpytorch, lpips, …"
    if (env := environment("peers_ggl", "GGL", "celeba32_wgan-gp.py", needs)) is None:
        return
    python, repo = env
    want = Images.from_env(quick)
    rounds = env_ints("LEAKBENCH_GGL_ROUNDS", "2" if quick else "40")[0]
    if not 1 <= rounds <= 1000:
        raise SystemExit(f"LEAKBENCH_GGL_ROUNDS: expected 1 to 1000 rounds of {PER_ROUND} candidates, got {rounds}")
    start = time.perf_counter()
    scratch = tempfile.TemporaryDirectory(prefix="leakbench-peers-ggl-")
    folder = Path(scratch.name)
    s = setting(folder, want.size, quick=quick)
    extra = json.loads(os.environ.get("LEAKBENCH_PEERS_GGL", "{}"))
    base = {**GENERATORS[s.data], "public": s.public, "evaluations": PER_ROUND * rounds, **extra}
    layers = len(list(s.model.parameters()))
    matched = {**base, "distance": "l2", "kl": 0.1 * layers, "sigma": 1.0, "adapt": "none", **extra}
    o, gen = prior("ggl", base, s.ds.shape)
    console.print(f"[dim]convnet-16 on {s.data} {want.size}×{want.size}: held-out accuracy {s.accuracy:.3f} "
                  f"({time.perf_counter() - start:.0f} s)[/dim]")
    pairs = [s.ds.batch(indices=idx) for idx in batches(s.pools, want.pool, 1, want.count)][want.first:]
    _export(s.model, gen, pairs[0][0], o.latent, folder)
    scores = {"reference": [], "matched": [], "default": []}
    seconds = dict.fromkeys(scores, 0.0)
    grey, labels_right = [], {"reference": 0, "matched": 0, "default": 0}
    for b, (x, y) in enumerate(pairs, start=want.first):
        obs = lb.observe(s.model, x, y, labels_known=False, seed=b)
        g = grey_psnr(x, y)
        grey.append(g)
        for name, options in (("matched", matched), ("default", base)):
            t0 = time.perf_counter()
            rec = lb.attack("ggl", obs, seed=b, **options)
            seconds[name] += time.perf_counter() - t0
            scores[name].append(lb.compare(rec.images, x, y)["psnr"] - g)
            labels_right[name] += int(rec.labels.reshape(-1)[0]) == int(y[0])
        np.savez(folder / "data.npz", x=x.numpy(), y=y.numpy(), latent=np.asarray(o.latent))
        ref = call(python, "ggl_reference.py", folder, {"repo": repo, "model": folder / "model.pt", "generator":
                   folder / "decoder.pt", "data": folder / "data.npz", "rounds": rounds, "seed": b}, "GGL")
        seconds["reference"] += float(ref["seconds"])
        scores["reference"].append(lb.compare(torch.from_numpy(ref["final"]).float(), x, y)["psnr"] - g)
        labels_right["reference"] += int(ref["label"]) == int(y[0])
        console.print(f"[dim]image {b}: grey {g:.2f} dB; reference {scores['reference'][-1]:+.2f}, leakbench "
                      f"matched {scores['matched'][-1]:+.2f}, default {scores['default'][-1]:+.2f} "
                      f"({time.perf_counter() - start:.0f} s)[/dim]", highlight=False)
    n = len(pairs)
    names = {"reference": "reference GGL (nevergrad CMA, same generator)",
             "matched": "leakbench ggl, the reference's objective", "default": "leakbench ggl, its defaults"}
    rows = [["grey (chance)", " / ".join(f"{v:.2f}" for v in grey), "+0.00", "–", "–", "–"]]
    for key, label in names.items():
        v = scores[key]
        ratio = "" if key == "reference" else f" ({seconds[key] / seconds['reference']:.2f}×)"
        rows.append([label, " / ".join(f"{e:+.2f}" for e in v), mean_cell(v), f"{sum(e > 0 for e in v)} of {n}",
                     f"{labels_right[key]} of {n}", f"{seconds[key] / n:.1f}{ratio}"])
    for key in ("matched", "default"):
        diff, verdict = paired(scores[key], scores["reference"])
        rows.append([f"{names[key].split(', ')[1]} − reference, paired", " / ".join(f"{e:+.2f}" for e in diff),
                     mean_cell(diff), verdict, "–", "–"])
    table(f"GGL peers on a trained convnet-16 ({s.data} {want.size}×{want.size}, accuracy {s.accuracy:.2f}), B = 1: PSNR "
          f"over grey (dB), {n} held-out images ({want.pool} pool), label unknown",
          ["row", "per image", "mean [95 % t-interval]", "above grey", "label right", "s / image"], rows,
          f"{s.source}; {PER_ROUND * rounds} evaluations on every side; the same VAE decoder (latent {o.latent}, "
          f"width {o.prior_width}); the reference's seconds are its reconstruct call in its own process; "
          f"{time.perf_counter() - start:.0f} s in all on {torch.get_num_threads()} thread(s).")
