"""Inverting Gradients: cost per iteration against a bare PyTorch loop, quality per budget, time to quality.

1. Seconds per iteration of ``leakbench.attack("inverting-gradients")`` on the ConvNet of
   Geiping et al. (32×32, batch 1 and 4) and of a bare PyTorch loop computing the same
   objective (1 − cos + TV, signed Adam, box) in the same process; the ratio (target ≤ 1.10).
2. PSNR after 500 and 2 000 iterations of the paper preset (``default``: the paper's step 0.1
   in normalised units, i.e. 0.025 on [0, 1] images).
3. Wall time to reach 18, 20 and 25 dB with the paper preset and the ``fast`` preset on
   the same images (target: ``fast`` needs at most half the time).  PSNR is read after
   every step (outside the clock), so the step counts are exact.

Measured and not adopted for ``fast`` (convnet-32, batch 1, 1 thread): channels-last memory
format (0.121 s/step against 0.116 contiguous) and ``torch.compile`` of the whole step written
with ``torch.func.grad`` (no faster than eager, after 219 s of compilation); one step costs
about 2.6 forward+backward passes, nearly all of it in convolutions.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import leakbench as lb
from leakbench.attacks.solvers.objectives import total_variation

from .common import benchmark_images, psnr, table


def bare_loop(model, target, x0, y, *, iterations: int, lr: float = 0.025, tv: float = 4e-4) -> torch.Tensor:
    """Inverting Gradients written directly in PyTorch: the baseline the engine is measured against.

    ``lr`` 0.025 on [0, 1] images is the paper's 0.1 in normalised units (σ ≈ 0.25), as the
    engine's ``step_unit="normalised"`` computes it."""
    params = [p for p in model.parameters() if p.requires_grad]
    tnorm = torch.sqrt(sum(t.pow(2).sum() for t in target))
    x = x0.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    marks = [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=marks, gamma=0.1)
    for _ in range(iterations):
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
        dot = sum((g * t).sum() for g, t in zip(grads, target))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        loss = 1 - dot / (norm * tnorm) + tv * total_variation(x)
        (gx,) = torch.autograd.grad(loss, [x])
        x.grad = gx.sign()
        opt.step()
        sched.step()
        with torch.no_grad():
            x.clamp_(0, 1)
    return x.detach()


def _setup(ds, batch: int, width: int, seed: int = 0):
    x, y = ds.batch(batch, seed=seed)
    model = lb.build(f"convnet-{width}", input_shape=ds.shape, classes=ds.num_classes, seed=seed).eval()
    obs = lb.observe(model, x, y, labels_known=True)
    return x, y, model, obs


def per_iteration(quick: bool) -> None:
    ds, source = benchmark_images(8)
    iters, repeat = (10, 2) if quick else (30, 3)
    rows = []
    for batch in (1, 4):
        x, y, model, obs = _setup(ds, batch, 32)
        params = [p.requires_grad_(True) for p in model.parameters()]
        x0 = lb.attacks.solvers.matching_settings.initial_images(x.shape, "gaussian", (0, 1), generator=torch.Generator().manual_seed(0),
                                                device="cpu", dtype=torch.float32)
        run_engine = lambda obs=obs: lb.attack("inverting-gradients", obs, iterations=iters,  # noqa: E731
                                               trace_every=iters)
        run_bare = lambda model=model, obs=obs, x0=x0, y=y: bare_loop(model, obs.shared, x0, y,  # noqa: E731
                                                                      iterations=iters)
        run_engine(), run_bare()  # warm-up
        t_engine, t_bare = [], []
        for _ in range(repeat):  # interleaved so machine load hits both alike
            t = time.perf_counter(); run_engine(); t_engine.append(time.perf_counter() - t)
            t = time.perf_counter(); run_bare(); t_bare.append(time.perf_counter() - t)
        e, b = min(t_engine) / iters, min(t_bare) / iters
        rows.append((f"convnet-32, 32×32, batch {batch}", e, b, e / b))
        del params
    table("Inverting Gradients — seconds per iteration", ["setting", "leakbench s/it", "bare loop s/it", "ratio"],
          rows, note=f"{source}; best of {repeat} runs of {iters} iterations, threads={torch.get_num_threads()}")


PAPER_BUDGET = 2000


def _curve(obs, x, preset: str, *, iterations: int | None = None, every: int = 1, stop_at: int | None = None):
    """(step, seconds, psnr) every ``every`` steps; the PSNR evaluation is excluded from the clock."""
    points: list[tuple[int, float, float]] = []
    paused = [0.0]
    t0 = time.perf_counter()

    class Stop(Exception):
        pass

    def callback(step, images):
        t = time.perf_counter()
        points.append((step, t - t0 - paused[0], psnr(images, x)))
        paused[0] += time.perf_counter() - t
        if stop_at is not None and step + 1 >= stop_at:
            raise Stop

    options = {"trace_every": every}
    if iterations is not None:
        options["iterations"] = iterations
    try:
        lb.attack("inverting-gradients", obs, preset=preset, callback=callback, **options)
    except Stop:
        pass
    return points


def _first(points, threshold):
    return next(((s, t) for s, t, p in points if p >= threshold), None)


def quality(quick: bool, images: list[int] | None = None) -> None:
    ds, source = benchmark_images(8)
    images = images if images is not None else ([0] if quick else [0, 1, 2])
    width = 16 if quick else 32
    budget = 600 if quick else PAPER_BUDGET
    rows_budget, rows_time = [], []
    for index in images:
        x, y = ds.batch(indices=[index])
        model = lb.build(f"convnet-{width}", input_shape=ds.shape, classes=ds.num_classes, seed=index).eval()
        obs = lb.observe(model, x, y, labels_known=True)
        # The paper's 4 800-step schedule, stopped after ``budget`` steps (its first decay is at step 1 800).
        paper = _curve(obs, x, "default", stop_at=budget)
        fast = _curve(obs, x, "fast")
        at = {s: p for s, _, p in paper}
        # step s is the (s + 1)-th update: PSNR after 500 and 2 000 updates
        rows_budget.append((index, at.get(499, float("nan")), at.get(budget - 1, float("nan")), fast[-1][2],
                            fast[-1][1] / max(1, fast[-1][0] + 1)))
        for th in (18, 20, 25):
            a, b = _first(paper, th), _first(fast, th)
            ratio = (b[1] / a[1]) if a and b else float("nan")
            steps = (b[0] + 1) / (a[0] + 1) if a and b else float("nan")
            rows_time.append((index, f"{th} dB", f"{a[1]:.1f} s @ {a[0]}" if a else "not reached",
                              f"{b[1]:.1f} s @ {b[0]}" if b else "not reached", ratio, steps))
    note = (f"{source}; convnet-{width} (random init, seed = image index, eval mode), batch 1, labels known, "
            f"threads={torch.get_num_threads()}; paper preset stopped after {budget} of its 4800 steps")
    table("Inverting Gradients — PSNR by iteration budget (paper preset) and the fast preset's final PSNR",
          ["image", "paper @ 500", f"paper @ {budget}", "fast final", "fast s/it"], rows_budget, note=note)
    table("Time to quality — paper preset vs fast preset",
          ["image", "target", "paper", "fast", "fast/paper (time)", "fast/paper (steps)"], rows_time,
          note=note + "; both presets cost the same per step, so the step ratio is the time ratio on a quiet machine")


def run(quick: bool = False) -> None:
    per_iteration(quick)
    quality(quick)
