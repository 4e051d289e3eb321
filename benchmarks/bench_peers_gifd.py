"""Peers: the GIFD authors' code beside leakbench's ``gifd``, same trained ConvNet, same generator, same images.

Fang et al. (ICCV 2023) published their code (https://github.com/ffhibnese/GIFD_Gradient_Inversion_Attack, commit
ff243fe measured) for BigGAN and StyleGAN2, neither for these images.  So both sides get **the same generator**: the
library's VAE decoder that ``gias`` trains on the benchmark's public images (:mod:`leakbench.models.prior`; on
CIFAR-10 the ``gias`` ``colour`` preset's), exported stage by stage as TorchScript (z → fc → conv1 → conv2 → image:
three feature spaces).  What is compared is the attack around it — the latent search, then the search of each
intermediate feature inside an ℓ1 ball, the best-matching space kept — on the trained network and images of
``benchmarks/bench_learned_prior.py`` (the same ``LEAKBENCH_PRIOR_DATA`` / ``_SIZE`` / ``_N`` / ``_POOL`` /
``_FIRST`` variables and model).  The reference's BigGAN set-up attacks one image (``num_images: 1``): B = 1, the
label unknown to both (iDLG from the gradient).

Needs an environment of its own with the reference's requirements (``LEAKBENCH_GIFD_PYTHON``) and a checkout of the
repository (``LEAKBENCH_GIFD_REPO``)::

    LEAKBENCH_GIFD_PYTHON=/path/to/venv/bin/python LEAKBENCH_GIFD_REPO=/path/to/checkout \
        python -m benchmarks peers_gifd

Built here: the GGL peer's environment (``bench_peers_ggl``) plus ``pip install FrEIA``.  Without them the benchmark
says why and skips.

Rows, per image in dB over the grey image at the image's mean (the chance row): leakbench ``gifd`` (its defaults;
``LEAKBENCH_PEERS_GIFD`` adds options, JSON) and the reference (``benchmarks/peers/gifd_reference.py``) at the same
step counts — ``restarts`` latent searches of ``latent_steps``, ``feature_steps`` in each feature space — and radii
(leakbench's relative ``radius`` times each feature's mean ℓ1 norm over random codes; the reference's are absolute),
its other options its BigGAN configuration's.  The paired row is leakbench − reference per image with its 95 %
t-interval: an interval holding 0 is a tie.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import leakbench as lb
from leakbench.models.prior import generator_stages

from .bench_learned_prior import batches, setting
from .bench_peers_ggl import GENERATORS
from .common import console, grey_psnr, mean_cell, table
from .peers.driver import Images, call, environment, paired, prior

#: random codes the absolute radii are averaged over
RADIUS_CODES = 256


class _Stage(torch.nn.Module):
    """One stage of a generator as a module (for tracing)."""

    def __init__(self, gen: torch.nn.Module, index: int) -> None:
        super().__init__()
        self.gen, self.index = gen, index

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return generator_stages(self.gen)[self.index](h)


def export_stages(gen: torch.nn.Module, latent: int, radius: float, folder: Path) -> tuple[list[str], list[float]]:
    """Each stage of ``gen`` traced to ``folder`` (the paths), and the absolute ℓ1 radius of each feature space:
    ``radius`` times its mean per-image ℓ1 norm over random codes z ~ N(0, I) (seed 0)."""
    paths, radii = [], []
    h = torch.randn(RADIUS_CODES, latent, generator=torch.Generator().manual_seed(0))
    stages = generator_stages(gen)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        for i in range(len(stages)):
            path = folder / f"stage{i}.pt"
            torch.jit.trace(_Stage(gen, i), h[:2]).save(str(path))
            paths.append(str(path))
            h = stages[i](h)
            if i < len(stages) - 1:
                radii.append(radius * float(h.flatten(1).abs().sum(1).mean()))
    return paths, radii


def run(*, quick: bool = False) -> None:
    needs = "the reference's requirements: torch, nevergrad, FrEIA, …"
    if (env := environment("peers_gifd", "GIFD", "inversefed", needs)) is None:
        return
    python, repo = env
    want = Images.from_env(quick)
    start = time.perf_counter()
    scratch = tempfile.TemporaryDirectory(prefix="leakbench-peers-gifd-")
    folder = Path(scratch.name)
    s = setting(folder, want.size, quick=quick)
    options = {**GENERATORS[s.data], "public": s.public,
               **({"latent_steps": 30, "feature_steps": 7} if quick else {}),
               **json.loads(os.environ.get("LEAKBENCH_PEERS_GIFD", "{}"))}
    o, gen = prior("gifd", options, s.ds.shape)
    console.print(f"[dim]convnet-16 on {s.data} {want.size}×{want.size}: held-out accuracy {s.accuracy:.3f} "
                  f"({time.perf_counter() - start:.0f} s)[/dim]")
    pairs = [s.ds.batch(indices=idx) for idx in batches(s.pools, want.pool, 1, want.count)][want.first:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.jit.trace(s.model, pairs[0][0]).save(str(folder / "model.pt"))
    paths, radii = export_stages(gen, o.latent, o.radius, folder)
    ours, theirs, grey, right, t_ours, t_theirs, layers = [], [], [], [0, 0], 0.0, 0.0, []
    for b, (x, y) in enumerate(pairs, start=want.first):
        obs = lb.observe(s.model, x, y, labels_known=False, seed=b)
        g = grey_psnr(x, y)
        t0 = time.perf_counter()
        rec = lb.attack("gifd", obs, seed=b, **options)
        t_ours += time.perf_counter() - t0
        np.savez(folder / "data.npz", x=x.numpy(), y=y.numpy(), latent=np.asarray(o.latent), radii=np.asarray(radii))
        ref = call(python, "gifd_reference.py", folder, {
            "repo": repo, "model": folder / "model.pt", "stages": ",".join(paths), "data": folder / "data.npz",
            "latent_steps": o.latent_steps, "feature_steps": o.feature_steps, "restarts": o.restarts, "seed": b},
            "GIFD")
        t_theirs += float(ref["seconds"])
        grey.append(g)
        ours.append(lb.compare(rec.images, x, y)["psnr"] - g)
        theirs.append(lb.compare(torch.from_numpy(ref["final"]).float(), x, y)["psnr"] - g)
        right[0] += int(rec.labels.reshape(-1)[0]) == int(y[0])
        right[1] += int(ref["label"]) == int(y[0])
        layers.append(str(ref["layer"]))
        console.print(f"[dim]image {b}: grey {g:.2f} dB; leakbench {ours[-1]:+.2f} ({rec.trace.get('stage')}), "
                      f"reference {theirs[-1]:+.2f} ({layers[-1]}) ({time.perf_counter() - start:.0f} s)[/dim]",
                      highlight=False)
    n = len(pairs)
    diff, verdict = paired(ours, theirs)
    label = " ".join(f"{k}={v}" for k, v in options.items() if k != "public")
    rows = [["grey (chance)", " / ".join(f"{v:.2f}" for v in grey), "+0.00", "–", "–", "–"],
            [f"leakbench gifd ({label})", " / ".join(f"{v:+.2f}" for v in ours), mean_cell(ours),
             f"{sum(v > 0 for v in ours)} of {n}", f"{right[0]} of {n}", f"{t_ours / n:.1f}"],
            ["reference GIFD (same generator)", " / ".join(f"{v:+.2f}" for v in theirs), mean_cell(theirs),
             f"{sum(v > 0 for v in theirs)} of {n}", f"{right[1]} of {n}",
             f"{t_theirs / n:.1f} ({t_theirs / t_ours:.2f}×)"],
            ["leakbench − reference, paired", " / ".join(f"{v:+.2f}" for v in diff), mean_cell(diff),
             verdict, "–", "–"]]
    table(f"GIFD peers on a trained convnet-16 ({s.data} {want.size}×{want.size}, accuracy {s.accuracy:.2f}), B = 1: PSNR "
          f"over grey (dB), {n} held-out images ({want.pool} pool), label unknown",
          ["row", "per image", "mean [95 % t-interval]", "above grey", "label right", "s / image"], rows,
          f"{s.source}; both sides: {o.restarts} restarts × {o.latent_steps} latent steps, {o.feature_steps} steps in "
          f"each of {len(radii)} feature spaces, ℓ1 radii {', '.join(f'{r:.3g}' for r in radii)} (relative "
          f"{o.radius}); the reference's chosen spaces: {', '.join(layers)}; its seconds are its reconstruct call in "
          f"its own process; {time.perf_counter() - start:.0f} s in all on {torch.get_num_threads()} thread(s).")
