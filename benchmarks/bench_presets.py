"""How long each attack preset takes on this machine, so a user can plan a run.

Settings of the demo (``leakbench demo``): bundled photos at 32×32, the CNN ``cnn:3-16-2-1,3-32-2-1``
for gradient matching, ``mlp:256`` for the analytic attacks, the CNN behind an imprint block (64 bins)
or a random head (2 000 neurons) for the malicious-server attacks; batch sizes 1 and 8.  Iterative
presets are timed on ``STEPS`` steps after a warm-up and extrapolated linearly to the preset's
iterations × restarts ("est."); one-shot attacks run whole ("run").  The baseline row is a bare
PyTorch loop of the same cosine gradient-matching objective (autograd twice, Adam, no leakbench
code), timed in this process: the ``ratio`` column is leakbench's s/step over it.

No GPU here: a CUDA device runs the gradient-matching presets roughly an order of magnitude faster
(not measured on this machine; pass ``device`` to ``lb.build``/``lb.observe`` to use one).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import leakbench as lb
from leakbench.attacks import ATTACKS, create
from leakbench.models.malicious import imprint, random_head

from .common import console, table

STEPS = 10
CNN = "cnn:3-16-2-1,3-32-2-1"


def _bare_step_seconds(model, x, y, steps: int) -> float:
    """s/step of a plain PyTorch cosine gradient-matching loop on ``model`` (the baseline)."""
    params = [p for p in model.parameters()]
    target = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    xh = torch.rand_like(x).requires_grad_(True)
    opt = torch.optim.Adam([xh], lr=0.1)

    def step():
        opt.zero_grad()
        g = torch.autograd.grad(F.cross_entropy(model(xh), y), params, create_graph=True)
        dot = sum((a * b).sum() for a, b in zip(g, target))
        norm = torch.sqrt(sum((a * a).sum() for a in g)) * torch.sqrt(sum((b * b).sum() for b in target))
        loss = 1 - dot / norm
        (gx,) = torch.autograd.grad(loss, [xh])
        xh.grad = gx.sign()
        opt.step()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _iterations(name: str, preset: str) -> tuple[int, int]:
    attack = create(name, preset=preset)
    opts = attack.options
    its = getattr(opts, "iterations", None) or getattr(getattr(opts, "matching", None), "iterations", None)
    restarts = getattr(opts, "restarts", 1) or 1
    return int(its or 0), int(restarts)


def _time(name: str, preset: str, obs, steps: int) -> tuple[float, str]:
    """Seconds for the whole preset: measured, or s/step × iterations × restarts."""
    total, restarts = _iterations(name, preset)
    if total and total > steps:
        lb.attack(name, obs, preset=preset, iterations=2, **({"restarts": 1} if restarts > 1 else {}))
        start = time.perf_counter()
        lb.attack(name, obs, preset=preset, iterations=steps, **({"restarts": 1} if restarts > 1 else {}))
        per_step = (time.perf_counter() - start) / steps
        return per_step * total * restarts, f"est. {total}×{restarts}"
    start = time.perf_counter()
    lb.attack(name, obs, preset=preset)
    return time.perf_counter() - start, "run"


def _clock(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else (f"{seconds / 60:.1f} min" if seconds < 7200
                                                       else f"{seconds / 3600:.1f} h")


def run(quick: bool = False) -> None:
    torch.manual_seed(0)
    data = lb.load("photos", size=32)
    cnn = lb.build(CNN, input_shape=data.shape, classes=data.num_classes, act="relu", seed=0)
    mlp = lb.build("mlp:256", input_shape=data.shape, classes=data.num_classes, act="relu", seed=0)
    public = data.images[-300:]
    servers = {"robbing-the-fed": imprint(cnn, input_shape=data.shape, bins=64, calibration=public, seed=0),
               "liu2024": random_head(cnn, input_shape=data.shape, width=2000, seed=0)}
    servers["tensor-features"] = servers["liu2024"]
    models = {"inverting-gradients": cnn, "dlg": cnn, "fc-inversion": mlp, "exclusivity": mlp,
              "cocktail-party": mlp, "rgap": lb.build("cnn:3-4-2-1", input_shape=data.shape,
                                                      classes=data.num_classes, act="leaky-relu", seed=0)}
    rows = []
    steps = 4 if quick else STEPS
    for B in (1,) if quick else (1, 8):
        x, y = data.batch(B, seed=0)
        bare = _bare_step_seconds(cnn, x, y, steps)
        rows.append(("bare PyTorch loop (baseline)", "-", B, f"{bare * 1e3:.1f} ms/step", "-", 1.0))
        for name in ATTACKS.names():
            model = servers.get(name, models.get(name))
            if model is None:
                continue  # attacks on weights: benchmarks/bench_kkt.py and bench_margin.py
            obs = lb.observe(model, x, y)
            presets = ["default", *sorted(ATTACKS.get(name).presets)]
            for preset in dict.fromkeys(presets):
                reasons = create(name, preset=preset).requirements(obs)
                if reasons:
                    continue
                secs, how = _time(name, preset, obs, steps)
                total, restarts = _iterations(name, preset)
                ratio = secs / (total * restarts) / bare if (name in ("inverting-gradients", "dlg") and total) else "-"
                rows.append((name, preset, B, _clock(secs), how, ratio))
        console.print(f"[dim]B={B} done[/dim]")
    table("Attack presets on the demo's models, CPU (2 cores)", ["attack", "preset", "B", "time", "how",
                                                                 "s/step ÷ bare loop"], rows,
          note=f"{torch.get_num_threads()} torch threads; iterative presets extrapolated from {steps} steps")
