"""Peers: the GIAS authors' code beside leakbench's ``gias``, same trained ConvNet, same generator, same images.

Jeon et al. (NeurIPS 2021) published their reconstruction code
(https://github.com/ml-postech/gradient-inversion-generative-image-prior, commit f841412 measured) but no generator
for these images (their StyleGAN2 / DCGAN weights are not shipped and cannot be downloaded here).  So both sides
get **the same generator**: the library's VAE decoder that ``gias`` trains on the benchmark's public images
(:mod:`leakbench.models.prior`), exported as TorchScript.  What is compared is the attack around it — the
latent search, the choice of code, the per-image generator fine-tuning — on the trained network and batches of
``benchmarks/bench_learned_prior.py`` (the same ``LEAKBENCH_PRIOR_DATA`` / ``_SIZE`` / ``_B`` / ``_N`` /
``_POOL`` / ``_FIRST`` variables and the same model, trained here with the same seed).

Needs an environment of its own that imports torch and torchvision (the reference's package imports torchvision,
which does not import beside leakbench's CPU torch) and a checkout of the repository::

    LEAKBENCH_GIAS_PYTHON=/path/to/venv/bin/python LEAKBENCH_GIAS_REPO=/path/to/checkout \
        python -m benchmarks peers_gias

Built here: ``python3 -m venv gias-venv; gias-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 six pyyaml
numpy`` (the wheels on disk).  Without them the benchmark says why and skips.

Rows, per batch in dB over the grey image at the batch's mean (the chance row): leakbench ``gias`` with one run
(``consensus=1``; CIFAR-10: the ``colour`` preset's generator; ``LEAKBENCH_PEERS_GIAS`` adds options, JSON), and
the reference (``benchmarks/peers/gias_reference.py``) at the same step counts: ``restarts`` latent searches of
``latent_steps`` steps, then ``generator_steps`` of per-image generator fine-tuning (the reference fine-tunes every
restart's, leakbench the best one's).  The reference's other options are its own for 32-px images.  Labels known,
one undefended gradient.  The paired row is leakbench − reference per batch, with its 95 % t-interval: an interval
holding 0 is a tie.
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

from .bench_learned_prior import batches, setting
from .common import console, env_ints, grey_psnr, mean_cell, table
from .peers.driver import Images, call, environment, paired, prior


def _options(data: str) -> dict:
    extra = json.loads(os.environ.get("LEAKBENCH_PEERS_GIAS", "{}"))
    return {**({"preset": "colour"} if data == "cifar" else {}), "consensus": 1, **extra}


def _export(model: torch.nn.Module, gen: torch.nn.Module, x: torch.Tensor, latent: int, folder: Path) -> None:
    """The model and the generator as TorchScript (traced: the decoder's crop test is constant for one shape)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.jit.trace(model, x).save(str(folder / "model.pt"))
        torch.jit.trace(gen, torch.zeros(2, latent)).save(str(folder / "decoder.pt"))


def run(*, quick: bool = False) -> None:
    if (env := environment("peers_gias", "GIAS", "inversefed", "torch and torchvision")) is None:
        return
    python, repo = env
    B = env_ints("LEAKBENCH_PRIOR_B", "4")[0]
    want = Images.from_env(quick)
    start = time.perf_counter()
    scratch = tempfile.TemporaryDirectory(prefix="leakbench-peers-gias-")
    folder = Path(scratch.name)
    s = setting(folder, want.size, quick=quick)
    options = {**_options(s.data), "public": s.public, **({"latent_steps": 30, "generator_steps": 20} if quick else {})}
    o, gen = prior("gias", options, s.ds.shape)
    console.print(f"[dim]convnet-16 on {s.data} {want.size}×{want.size}: held-out accuracy {s.accuracy:.3f} "
                  f"({time.perf_counter() - start:.0f} s)[/dim]")
    pairs = [s.ds.batch(indices=idx) for idx in batches(s.pools, want.pool, B, want.count)][want.first:]
    _export(s.model, gen, pairs[0][0], o.latent, folder)
    ours, theirs, grey, t_ours, t_theirs = [], [], [], 0.0, 0.0
    for b, (x, y) in enumerate(pairs, start=want.first):
        obs = lb.observe(s.model, x, y, labels_known=True, seed=b)
        g = grey_psnr(x, y)
        t0 = time.perf_counter()
        rec = lb.attack("gias", obs, seed=b, **options)
        t_ours += time.perf_counter() - t0
        np.savez(folder / "data.npz", x=x.numpy(), y=y.numpy(), latent=np.asarray(o.latent))
        out = call(python, "gias_reference.py", folder, {
            "repo": repo, "model": folder / "model.pt", "generator": folder / "decoder.pt", "data": folder / "data.npz",
            "latent_steps": o.latent_steps, "generator_steps": o.generator_steps, "restarts": o.restarts, "seed": b},
            "GIAS")
        images = torch.from_numpy(out["final"]).float()
        t_theirs += float(out["seconds"])
        grey.append(g)
        ours.append(lb.compare(rec.images, x, y)["psnr"] - g)
        theirs.append(lb.compare(images, x, y)["psnr"] - g)
        console.print(f"[dim]batch {b}: grey {g:.2f} dB; leakbench {ours[-1]:+.2f}, reference {theirs[-1]:+.2f} "
                      f"({time.perf_counter() - start:.0f} s)[/dim]", highlight=False)
    n = len(pairs)
    diff, verdict = paired(ours, theirs)
    label = " ".join(f"{k}={v}" for k, v in options.items() if k != "public")
    rows = [["grey (chance)", " / ".join(f"{v:.2f}" for v in grey), "+0.00", "–", "–"],
            [f"leakbench gias ({label})", " / ".join(f"{v:+.2f}" for v in ours), mean_cell(ours),
             f"{sum(v > 0 for v in ours)} of {n}", f"{t_ours / n:.1f}"],
            ["reference GIAS (same generator)", " / ".join(f"{v:+.2f}" for v in theirs), mean_cell(theirs),
             f"{sum(v > 0 for v in theirs)} of {n}", f"{t_theirs / n:.1f} ({t_theirs / t_ours:.2f}×)"],
            ["leakbench − reference, paired", " / ".join(f"{v:+.2f}" for v in diff), mean_cell(diff),
             verdict, "–"]]
    table(f"GIAS peers on a trained convnet-16 ({s.data} {want.size}×{want.size}, accuracy {s.accuracy:.2f}), B = "
          f"{B}: PSNR over grey (dB), {n} held-out batches ({want.pool} pool), labels known",
          ["row", "per batch", "mean [95 % t-interval]", "above grey", "s / batch"], rows,
          f"{s.source}; both sides: {o.restarts} restarts × {o.latent_steps} latent steps, {o.generator_steps} "
          f"generator steps, the same VAE decoder (latent {o.latent}, width {o.prior_width}); the reference's "
          f"seconds are its reconstruct call in its own process; {time.perf_counter() - start:.0f} s in all on "
          f"{torch.get_num_threads()} thread(s).")
