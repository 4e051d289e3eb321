"""Peers: breaching's Inverting Gradients next to leakbench's, same untrained ConvNet, same CIFAR-10 images.

Needs a breaching environment of its own (breaching needs torchvision, which does not import beside this
CPU torch): ``LEAKBENCH_BREACHING_PYTHON=/path/to/venv/bin/python python -m benchmarks peers``, where that
Python imports ``breaching``.  Built here (x86_64, Python 3.11, about a minute from the wheels on disk)::

    git clone https://github.com/JonasGeiping/breaching     # commit 8bd99d5 measured
    python3 -m venv breach-venv
    breach-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 hydra-core scipy lpips
    breach-venv/bin/pip install --no-deps ./breaching

(torch 2.14.1 with its torchvision: PyPI's torchvision does not import beside leakbench's 2.13.0).  Without
it the benchmark says why and skips.

For each held-out image set — CIFAR-10 test images from index 500 of the shared subset, which holds 100
images per class in class order, so a batch takes one image from each of classes 5–9 in turn
(:func:`held_out`; consecutive indices would give a batch of one class, whose slots come back in any
order) — at B = 1 (three images), 4 and 8 (``--quick``: one image, convnet-16, 500 steps, about a minute):
leakbench builds ``convnet-W`` (random init, eval mode) and hands it to breaching as a TorchScript module
that takes normalised images (CIFAR mean/std, as breaching's models do), with the images as an NPZ.
``benchmarks/peers/breaching_ig.py`` runs breaching's ``invertinggradients`` config (labels given) for
``--iterations`` steps — 2 000 here, not its default 24 000: at 0.06 / 0.2 / 0.4 s a step (B = 1 / 4 / 8,
one thread) the default is 24 / 80 / 160 minutes a batch on this machine — and copies out its candidate
every 25 steps off the clock (its last point is the reconstruction it returns, the candidate of lowest
objective); leakbench runs its ``fast`` and ``default`` (paper) presets with labels known, PSNR read
every 25 steps off the clock.  Both sides import what their first optimiser imports (``torch._dynamo``,
seconds) before the clock.  PSNR is taken after the best one-to-one matching of reconstructions to
originals (:func:`leakbench.metrics.match`), for both sides alike; the chance row is a grey image.
Printed: PSNR against time for the three, and the time each leakbench preset needs to reach breaching's
final PSNR, against the time breaching first reaches it and against breaching's whole run.
``LEAKBENCH_PEERS_BATCHES=8`` keeps only some batch sizes, ``LEAKBENCH_PEERS_PRESETS=fast`` some presets;
``LEAKBENCH_PEERS_STARTS=0,1,2`` compares more (disjoint) held-out batches at B > 1;
``LEAKBENCH_BREACHING_ITERATIONS`` sets breaching's budget.  ``LEAKBENCH_PEERS_VARIANTS=fast`` keeps only some
columns of the layout table (under ``fast`` revision 5 the three are one run on batches whose every label holds
three or more images).
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import leakbench as lb

from .bench_inverting import _curve, _first
from .common import benchmark_images, console, env_pick, psnr, table

ENV = "LEAKBENCH_BREACHING_PYTHON"
ITERATIONS_ENV = "LEAKBENCH_BREACHING_ITERATIONS"  # breaching's budget here (its own default: 24 000)
BATCHES_ENV = "LEAKBENCH_PEERS_BATCHES"  # e.g. "8": only these batch sizes (default: 1, 4 and 8)
PRESETS_ENV = "LEAKBENCH_PEERS_PRESETS"  # e.g. "fast": leakbench presets to run (default: fast,paper)
STARTS_ENV = "LEAKBENCH_PEERS_STARTS"  # e.g. "0,1,2": more (disjoint) held-out batches at B > 1 (default: 0)
SCRIPT = Path(__file__).parent / "peers" / "breaching_ig.py"
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
HELD_OUT = 500  # the first 500 images of the shared subset tuned the presets
PRESETS = {"fast": "fast", "paper": "default"}  # the names in the tables → leakbench's presets
PER_CLASS = 100  # the shared subset: 100 images per class, in class order
LAYOUTS_ENV = "LEAKBENCH_PEERS_LAYOUTS"  # e.g. "mixed,2x,1x": compare by label layout (issue 34) instead
LAYOUTS = ("mixed", "2x", "1x")
LAYOUT_BATCHES_ENV = "LEAKBENCH_PEERS_LAYOUT_BATCHES"  # e.g. "2": only that one of the three batches per layout
VARIANTS_ENV = "LEAKBENCH_PEERS_VARIANTS"  # e.g. "fast": only these columns of the layout table (default: all three)
LAYOUT_VARIANTS = {"fast": ("fast", {}), "fast unique": ("fast", {"features_labels": "unique"}),
                   "fast off": ("fast", {"features": 0.0, "feature_phase": 0.0})}


def held_out(batch: int, start: int = 0) -> list[int]:
    """``batch`` held-out indices (≥ 500) cycling over classes 5–9, the ``start``-th image of each first."""
    classes = 5
    return [HELD_OUT + PER_CLASS * (i % classes) + start + i // classes for i in range(batch)]


def layout_batch(layout: str, batch: int, k: int) -> list[int]:
    """The ``k``-th held-out batch (k < 3) of ``batch`` images with label layout ``layout``, disjoint from the other
    k of the same layout and size and from the other layouts: ``mixed`` cycles the five held-out classes 5–9
    (images 0… of each class, as :func:`held_out`), ``2x`` takes B/2 images of classes 5+k and 6+k (images 40… of
    each in batches 0 and 2, images 50… in batch 1: neighbouring batches share a class, never an image), ``1x`` B
    images of class 5+k (images 60…)."""
    if not 0 <= k < 3 or batch > 20 or (layout == "2x" and batch % 2):
        raise SystemExit(f"layout {layout}: batches k = 0, 1, 2 of an even B ≤ 20, got B = {batch}, k = {k}")
    if layout == "mixed":
        return held_out(batch, k * -(-batch // 5))
    if layout == "2x":
        half = batch // 2
        # Batch 1 takes images 50… so that it shares no image with batch 0 (class 6) or batch 2 (class 7); before
        # session 16 every batch took images 40…, so batch 1 repeated half of each neighbour (its rows were rerun).
        return [HELD_OUT + PER_CLASS * (k + c) + 40 + 10 * (k == 1) + i for c in (0, 1) for i in range(half)]
    if layout == "1x":
        return [HELD_OUT + PER_CLASS * k + 60 + i for i in range(batch)]
    raise SystemExit(f"{LAYOUTS_ENV}: expected some of {', '.join(LAYOUTS)}, got {layout!r}")


def _listed(text: str, name: str, default: list, kind=int) -> list:
    """The comma-separated values of environment variable ``name`` (``default`` when empty)."""
    try:
        return [kind(v.strip()) for v in text.split(",") if v.strip()] or default
    except ValueError:
        raise SystemExit(f"{name}={text!r}: expected comma-separated integers, e.g. {name}=8") from None


def settings_from(batches: str, starts: str) -> list[tuple[int, list[int]]]:
    """(B, indices) to compare: three single images, then a batch of 4 and of 8 for each ``starts`` entry k
    (the k-th disjoint held-out batch of that size); ``batches`` ("8", "1,4") keeps those sizes."""
    sizes = _listed(batches, BATCHES_ENV, [1, 4, 8])
    firsts = _listed(starts, STARTS_ENV, [0])
    if any(not 1 <= b <= 5 * PER_CLASS for b in sizes) or any(s < 0 for s in firsts):
        raise SystemExit(f"{BATCHES_ENV} takes sizes 1..{5 * PER_CLASS} and {STARTS_ENV} starts ≥ 0")
    out = [(1, [HELD_OUT + PER_CLASS * k]) for k in range(3)] if 1 in sizes else []
    for b in sizes:
        for k in firsts if b > 1 else []:
            first = k * -(-b // 5)  # ⌈b/5⌉ images of each class per batch: batch k starts after k of them
            if first + (b - 1) // 5 >= PER_CLASS:
                raise SystemExit(f"{STARTS_ENV}: batch {k} of size {b} runs past the held-out images of a class")
            out.append((b, held_out(b, first)))
    return out


class _Normalised(torch.nn.Module):
    """``model`` behind breaching's convention: it takes images normalised with ``mean``/``std``."""

    def __init__(self, model: torch.nn.Module, mean, std) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x * self.std + self.mean)


def breaching_python() -> tuple[str | None, str]:
    """(the breaching Python, "") when ``LEAKBENCH_BREACHING_PYTHON`` names one that imports breaching, else
    (None, why not)."""
    python = os.environ.get(ENV)
    if not python:
        return None, f"{ENV} is not set (the Python of a venv where `import breaching` works)"
    try:
        done = subprocess.run([python, "-c", "import breaching"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"{ENV}={python} cannot run: {err}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"{ENV}={python} cannot import breaching: {last}"
    return python, ""


def run_breaching(python: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, iterations: int,
                  every: int, tmp: Path, device: str = "cpu") -> list[tuple[int, float, float]]:
    """breaching's (step, seconds, PSNR) curve, its last point the returned (best) reconstruction."""
    wrapped = _Normalised(model, CIFAR_MEAN, CIFAR_STD).eval()
    example = ((x - wrapped.mean) / wrapped.std).contiguous()
    torch.jit.save(torch.jit.trace(wrapped, example), str(tmp / "model.pt"))
    np.savez(tmp / "data.npz", x=x.numpy(), y=y.numpy(), mean=np.asarray(CIFAR_MEAN), std=np.asarray(CIFAR_STD))
    out = tmp / "breaching.npz"
    done = subprocess.run([python, str(SCRIPT), "--model", str(tmp / "model.pt"), "--data", str(tmp / "data.npz"),
                           "--out", str(out), "--iterations", str(iterations), "--every", str(every),
                           "--threads", str(torch.get_num_threads()), "--device", device],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"breaching failed: {done.stderr.strip()[-2000:]}")
    with np.load(out, allow_pickle=False) as r:
        points = [(int(s), float(t), psnr(torch.from_numpy(im), x))
                  for s, t, im in zip(r["steps"], r["seconds"], r["images"])]
        points.append((int(r["iterations"]), float(r["total"]), psnr(torch.from_numpy(r["final"]), x)))
    return points


def _at(points, seconds: float) -> float:
    """PSNR of the last point at or before ``seconds``."""
    before = [p for _, t, p in points if t <= seconds]
    return before[-1] if before else float("nan")


def _curve_on(obs, x: torch.Tensor, preset: str, options: dict, *, every: int, device: torch.device):
    """(step, seconds, psnr) every ``every`` steps of ``preset`` with ``options``; the copy and the PSNR are off the
    clock (on CUDA the clock waits for the steps so far)."""
    points: list[tuple[int, float, float]] = []
    paused = [0.0]

    def callback(step, images):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        points.append((step, t - t0 - paused[0], psnr(images, x)))
        paused[0] += time.perf_counter() - t

    t0 = time.perf_counter()
    rec = lb.attack("inverting-gradients", obs, preset=preset, callback=callback, trace_every=every, **options)
    if device.type == "cuda":
        torch.cuda.synchronize()
    points.append((points[-1][0] + 1 if points else 0, time.perf_counter() - t0 - paused[0], psnr(rec.images, x)))
    return points


def layouts(python: str, names: list[str], *, device: str = "cpu") -> None:
    """breaching against ``fast`` (feature term on all labels, on unique labels only, off) by label layout at
    B = 8 and 16: three disjoint held-out batches per layout and size, PSNR over a grey image, and the time
    ``fast`` takes to breaching's final PSNR as a ratio of breaching's time to it (same device, same process
    for leakbench)."""
    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available here")
    ds, source = benchmark_images(8)
    iterations = int(os.environ.get(ITERATIONS_ENV, "2000"))
    sizes = _listed(os.environ.get(BATCHES_ENV, ""), BATCHES_ENV, [8, 16])
    every = 25
    x, y = ds.batch(indices=[HELD_OUT])  # warm-up: the first attack in a process imports torch._dynamo
    warm = lb.build("convnet-32", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval().to(where)
    lb.attack("inverting-gradients", lb.observe(warm, x.to(where), y.to(where), labels_known=True), preset="fast",
              iterations=2)
    variants = env_pick(VARIANTS_ENV, LAYOUT_VARIANTS)
    rows, summary = [], {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for layout in names:
            for batch in sizes:
                for k in _listed(os.environ.get(LAYOUT_BATCHES_ENV, ""), LAYOUT_BATCHES_ENV, [0, 1, 2]):
                    idx = layout_batch(layout, batch, k)
                    x, y = ds.batch(indices=idx)
                    model = lb.build("convnet-32", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval()
                    theirs = run_breaching(python, model, x, y, iterations=iterations, every=every, tmp=Path(tmp),
                                           device=device)
                    model = model.to(where)
                    obs = lb.observe(model, x.to(where), y.to(where), labels_known=True)
                    grey = psnr(torch.full_like(x, float(x.mean())), x)
                    target, reach = theirs[-1][2], _first(theirs, theirs[-1][2])
                    row = [layout, batch, k, f"{grey:.2f}", f"{target - grey:+.2f} ({theirs[-1][1]:.1f} s)"]
                    for name, (preset, options) in variants.items():
                        ours = _curve_on(obs, x, preset, options, every=every, device=where)
                        hit = _first(ours, target)
                        ratio = hit[1] / reach[1] if hit and reach[1] > 0 else float("nan")
                        row.append(f"{ours[-1][2] - grey:+.2f} ({ours[-1][1]:.1f} s)"
                                   + (f", ×{ratio:.2f}" if hit else ", not reached"))
                        summary.setdefault((layout, batch, name), []).append((ours[-1][2] - target, ratio))
                    rows.append(row)
                    console.print(f"[dim]{' | '.join(map(str, row))}[/dim]", highlight=False)
    note = (f"{source}; held-out images ≥ {HELD_OUT} (classes 5–9); convnet-32 (random init, seed 0, eval), labels "
            f"known, on {where.type}; breaching: invertinggradients, {iterations} steps; PSNR after one-to-one "
            f"matching; {time.perf_counter() - start:.0f} s in all")
    table("By label layout: final PSNR over a grey image (dB), (seconds), × = leakbench's time to breaching's final "
          "PSNR ÷ breaching's", ["layout", "B", "batch", "grey dB", "breaching", *variants], rows, note=note)
    agg = []
    for layout in names:
        for batch in sizes:
            for name in variants:
                got = summary[(layout, batch, name)]
                wins = sum(d > 0 for d, _ in got)
                ratios = [r for _, r in got if r == r]
                agg.append([layout, batch, name, f"{sum(d for d, _ in got) / len(got):+.2f}",
                            f"{min(d for d, _ in got):+.2f} … {max(d for d, _ in got):+.2f}",
                            f"{wins} of {len(got)}",
                            f"{max(ratios):.2f}" if len(ratios) == len(got) else f"{len(ratios)} of {len(got)} reach it"])
    table("Per layout: leakbench final PSNR − breaching final PSNR (dB), n = the batches run",
          ["layout", "B", "leakbench", "mean Δ", "min … max Δ", "above breaching", "worst time ratio"], agg, note=note)


def run(quick: bool = False, device: str = "cpu") -> None:
    python, why = breaching_python()
    if python is None:
        console.print(f"[yellow]peers: skipped[/yellow] — {why}", highlight=False, soft_wrap=True)
        return
    if os.environ.get(LAYOUTS_ENV):
        layouts(python, _listed(os.environ[LAYOUTS_ENV], LAYOUTS_ENV, list(LAYOUTS), kind=str), device=device)
        return
    if device != "cpu":
        raise SystemExit(f"peers: --device {device} is for the layouts comparison ({LAYOUTS_ENV}=mixed,2x,1x)")
    torch.set_num_threads(1)
    ds, source = benchmark_images(8)
    width = 16 if quick else 32
    iterations = 500 if quick else int(os.environ.get(ITERATIONS_ENV, "2000"))
    every = 25
    presets = _listed(os.environ.get(PRESETS_ENV, ""), PRESETS_ENV, list(PRESETS), kind=str)
    if set(presets) - set(PRESETS):
        raise SystemExit(f"{PRESETS_ENV}: expected some of {', '.join(PRESETS)}, got {presets}")
    settings = [(1, held_out(1))] if quick else settings_from(os.environ.get(BATCHES_ENV, ""),
                                                              os.environ.get(STARTS_ENV, ""))
    curves, ratios = [], []
    x, y = ds.batch(indices=[HELD_OUT])  # warm-up: the first attack in a process imports torch._dynamo (seconds)
    warm = lb.build(f"convnet-{width}", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval()
    lb.attack("inverting-gradients", lb.observe(warm, x, y, labels_known=True), preset="fast", iterations=2)
    with tempfile.TemporaryDirectory() as tmp:
        for batch, indices in settings:
            x, y = ds.batch(indices=indices)
            model = lb.build(f"convnet-{width}", input_shape=ds.shape, classes=ds.num_classes, seed=0).eval()
            obs = lb.observe(model, x, y, labels_known=True)
            theirs = run_breaching(python, model, x, y, iterations=iterations, every=every, tmp=Path(tmp))
            ours = {name: _curve(obs, x, PRESETS[name], every=every, stop_at=iterations if name == "paper" else None)
                    for name in presets}
            target, total = theirs[-1][2], theirs[-1][1]
            reach = _first(theirs, target)
            label = f"B={batch} images {','.join(map(str, indices))}" if batch > 1 else f"B=1 image {indices[0]}"
            grey = psnr(torch.full_like(x, 0.5), x)
            curves.append((label, "chance: grey image", *[grey] * 5, 0.0))
            for name, points in (("breaching IG", theirs), *((f"leakbench {n}", c) for n, c in ours.items())):
                curves.append((label, name, *[_at(points, f * total) for f in (0.1, 0.25, 0.5, 1.0)],
                               points[-1][2], points[-1][1]))
            for name, points in ours.items():
                hit = _first(points, target)
                ratios.append((label, f"{target:.2f} (grey {grey:.2f})", f"{reach[1]:.1f} s @ {reach[0]}",
                               f"{total:.1f} s", name,
                               f"{hit[1]:.1f} s @ {hit[0]}" if hit else f"not reached ({points[-1][2]:.2f})",
                               hit[1] / reach[1] if hit and reach[1] > 0 else float("nan"),
                               hit[1] / total if hit else float("nan"),
                               f"{points[-1][2]:.2f} dB in {points[-1][1]:.1f} s"))
                console.print(f"[dim]{label}: {' | '.join(str(c) for c in ratios[-1][1:])}[/dim]", highlight=False)
    note = (f"{source}; convnet-{width} (random init, seed 0, eval), labels known, 1 thread each; breaching: "
            f"invertinggradients config, {iterations} steps; PSNR after one-to-one matching, every {every} steps "
            "off the clock")
    table("PSNR (dB) against time — at fractions of breaching's run time",
          ["setting", "method", "10 %", "25 %", "50 %", "100 %", "final", "final s"], curves, note=note)
    table("Time to breaching's final PSNR",
          ["setting", "breaching final dB", "breaching first reaches it", "breaching's run", "leakbench preset",
           "leakbench reaches it", "÷ breaching's first", "÷ breaching's run", "leakbench final"],
          ratios, note=note + "; ratios = leakbench's time to breaching's final PSNR / breaching's (first time "
          "it reaches it; its whole run); below 0.5: leakbench needs under half breaching's time")
