"""Batched independent trials and batched training seeds (issue 28): sequential against stacked, per trial.

The demo's CNN (``cnn:3-16-2-1,3-32-2-1``, relu) on 32×32 photo patches (``lb.load("photos", size=32)``):

- **attacks** — k observations (different images, seeds, every second one under ``noise:0.001``) attacked
  by Inverting Gradients ``quick`` at B = 1 and ``fast`` at B = 4 (output-layer features from B = 2), k = 1,
  4, 16, 64: ``sequential`` is :func:`leakbench.attack` once per observation, ``stacked`` is
  :func:`leakbench.attacks.attack_batch` on all k, with the stacked objective through ``torch.func.vmap``
  (``vmap``) and through one autograd graph over the k rows (``block``, a block-diagonal Jacobian; the two compared at k = 16).  The
  sequential per-trial time does not depend on k: it is measured on 8 observations (4 with ``--quick``),
  interleaved with the stacked runs in this process, best of 2 rounds (the machine is shared).
- **training** — 1, 3 and 8 seeds of the same CNN for one epoch at batch 4, plain and under DP-SGD
  (``dpsgd:1,1``), one after the other (``utility_seeds(stacked=False)``) against stacked.

Times are this process's CPU seconds (``time.process_time``, one torch thread): on a quiet machine they equal
the wall time, and on a shared one (other jobs on the cores) they do not stretch with the load as wall time
does.  With ``--device cuda`` everything runs on the GPU, times are wall seconds after a synchronize, k goes up to
256, and the ratio is measured there (the estimate is printed beside it).  Target (issue 28): k = 16 stacked ≥ 3× faster per trial than sequential on 2 CPU cores.  When the best k = 16
ratio misses it, the profiler's top operators of one stacked and one sequential step say where the time goes.
The GPU column is an estimate from arithmetic intensity (FLOPs of one step from ``FlopCounterMode``, the
operator count from the profiler), not a measurement: marked ``unmeasured``.
"""
from __future__ import annotations

import math
import os
import time

import torch

import leakbench as lb
from leakbench.attacks import GradientMatcher, create, recover_labels
from leakbench.attacks.solvers.batched_matching import STACKING, solve_many
from leakbench.evaluation.training.utility import utility_seeds

from .common import console, table

MODEL = "cnn:3-16-2-1,3-32-2-1"
#: a GPU step's fixed cost per operator (kernel launch and Python dispatch, seconds) and its fp32 throughput
#: on small convolutions (FLOP/s): the assumptions of the unmeasured GPU estimate
LAUNCH, THROUGHPUT = 8e-6, 20e12


def _load() -> str:
    try:
        return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "load average n/a"


def _setup(batch: int, count: int, data, model, device: torch.device) -> list:
    out = []
    for t in range(count):
        x, y = data.batch(size=batch, seed=1000 + t)
        out.append(lb.observe(model, x.to(device), y.to(device), defense="noise:0.001" if t % 2 else "none", seed=t))
    return out


def _clock(device: torch.device) -> float:
    """CPU seconds of this process on a CPU; wall seconds after the queued GPU work on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def _sequential(observations, preset: str, options: dict) -> float:
    device = observations[0].device
    start = _clock(device)
    for i, obs in enumerate(observations):
        lb.attack("inverting-gradients", obs, preset=preset, seed=i, **options)
    return (_clock(device) - start) / len(observations)


def _stacked(observations, preset: str, options: dict, stacking: str) -> float:
    attack = create("inverting-gradients", preset=preset, **options)
    device = observations[0].device
    start = _clock(device)
    matchers = [GradientMatcher(o, attack.options) for o in observations]
    labels = [recover_labels(o, seed=i) for i, o in enumerate(observations)]
    out = solve_many(matchers, labels, list(range(len(observations))), stacking=stacking)
    bad = [r for r in out if isinstance(r, Exception)]
    assert not bad, bad[0]
    return (_clock(device) - start) / len(observations)


def _step_costs(observations, preset: str, options: dict) -> tuple[float, int]:
    """(FLOPs of one matching step of one problem, operators dispatched by it)."""
    from torch.utils.flop_counter import FlopCounterMode

    attack = create("inverting-gradients", preset=preset, **{**options, "iterations": 1, "feature_phase": 0.0})
    obs = observations[0]
    m = GradientMatcher(obs, attack.options)
    labels = recover_labels(obs)
    x = torch.rand((obs.batch_size, *obs.input_shape), device=obs.device).requires_grad_(True)
    counter = FlopCounterMode(display=False)
    with counter:
        total, _ = m.objective(x, labels)
        total.backward()  # (autograd.grad trips the counter's module hooks)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        total, _ = m.objective(x, labels)
        torch.autograd.grad(total, x)
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    return float(counter.get_total_flops()), ops


def _gpu_ratio(k: int, flops: float, ops: int) -> float:
    """Per-trial speed-up of a stack of k on a GPU if a step costs ops·LAUNCH + FLOPs/THROUGHPUT."""
    alone = ops * LAUNCH + flops / THROUGHPUT
    return k * alone / (ops * LAUNCH + k * flops / THROUGHPUT)


def _profile(observations, preset: str, options: dict) -> None:
    """Top operators (self CPU time) of a few steps, stacked and sequential."""
    short = {**options, "iterations": 20, "feature_phase": 0.0}  # past the set-up: matching steps
    for label, fn in (("stacked k=16", lambda: _stacked(observations, preset, short, "block")),
                      ("sequential, one trial", lambda: _sequential(observations[:1], preset, short))):
        fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        print(f"profile: {label}, 20 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


def _attacks(quick: bool, device: torch.device, presets: tuple[str, ...] = ("quick", "fast")) -> None:
    data = lb.load("photos", size=32)
    model = lb.build(MODEL, input_shape=data.shape, classes=data.num_classes, act="relu").to(device)
    gpu = device.type == "cuda"
    ks = (1, 4, 16) if quick else (1, 4, 16, 64, 256) if gpu else (1, 4, 16, 64)
    sample, rounds = (4, 1) if quick else (8, 1) if gpu else (8, 2)  # a GPU machine is not shared: one round
    cases = [("quick", 1, {"iterations": 60} if quick else {}), ("fast", 4, {"iterations": 100} if quick else {})]
    for preset, batch, options in (c for c in cases if c[0] in presets):
        observations = _setup(batch, max(ks), data, model, device)
        _stacked(observations[:2], preset, {**options, "iterations": 3}, "vmap")  # warm-up: imports, first calls
        flops, ops = _step_costs(observations, preset, options)
        seq = math.inf
        best = {(k, mode): math.inf for k in ks for mode in STACKING}
        for _ in range(rounds):  # interleaved rounds, the best of each kept: the machine is shared
            seq = min(seq, _sequential(observations[:sample], preset, options))
            for k in ks:
                for mode in STACKING if k == 16 else ("block",):
                    best[k, mode] = min(best[k, mode], _stacked(observations[:k], preset, options, mode))
        rows = [[k, seq, best[k, "block"], f"{seq / best[k, 'block']:.2f}", f"{_gpu_ratio(k, flops, ops):.1f}"]
                for k in ks]
        steps = create("inverting-gradients", preset=preset, **options).options.iterations
        unit = f"wall seconds on {torch.cuda.get_device_name(device)}" if gpu else "CPU seconds"
        table(f"Inverting Gradients {preset!r} at B = {batch}, {steps} steps: {unit} per trial",
              ["k", "sequential", "stacked", "ratio", "GPU ratio, estimated*"], rows,
              f"{unit}; {MODEL} relu, photos 32×32; sequential: {sample} trials one after the other; stacked: "
              f"block-diagonal objective; best of {rounds} interleaved rounds; torch threads {torch.get_num_threads()}, "
              f"{_load()}. "
              f"At k = 16 the vmap objective took {best[16, 'vmap']:.4g} s a trial, block {best[16, 'block']:.4g} s.  "
              f"* unmeasured estimate: a step of one problem is {flops / 1e6:.1f} MFLOP in {ops} operators; at "
              f"{LAUNCH * 1e6:.0f} µs an operator and {THROUGHPUT / 1e12:.0f} TFLOP/s it is launch-bound until "
              "k·FLOPs/throughput reaches ops·launch.")
        at16 = seq / min(best[16, m] for m in STACKING)
        if at16 < 3 and not gpu:
            console.print(f"[yellow]k = 16 reaches {at16:.2f}× (target 3×): where the time goes[/yellow]")
            _profile(observations[:16], preset, options)


def _training(quick: bool, device: torch.device) -> None:
    counts = (1, 3) if quick else (1, 3, 8)
    rows = []
    common = dict(epochs=1, batch_size=4, lr=0.01, data_options={"size": 32}, model_options={"act": "relu"},
                  cache_dir=False, device=str(device))
    if quick:
        common["data_options"] = {"size": 16}
    for defense in ("none", "dpsgd:1,1"):  # warm-up: imports (Opacus), first calls
        for stacked in (False, True):
            utility_seeds(MODEL, "photos", defense, seeds=[0, 1], stacked=stacked,
                          **{**common, "data_options": {"size": 8}})
    for defense in ("none", "dpsgd:1,1"):
        for k in counts:
            seeds = list(range(k))
            start = _clock(device)
            alone = utility_seeds(MODEL, "photos", defense, seeds=seeds, stacked=False, **common)
            seq = (_clock(device) - start) / k
            start = _clock(device)
            stacked = utility_seeds(MODEL, "photos", defense, seeds=seeds, stacked=True, **common)
            bat = (_clock(device) - start) / k
            gap = max(abs(a.train_loss - b.train_loss) for a, b in zip(alone, stacked))
            rows.append([defense, k, seq, bat, f"{seq / bat:.2f}×", f"{gap:.1e}"])
    unit = "wall seconds on the GPU" if device.type == "cuda" else "CPU seconds"
    table(f"Training seeds for one epoch: {unit} per seed", ["defense", "seeds", "one after the other", "stacked",
                                                             "ratio", "max |Δ loss|"], rows,
          f"{MODEL} relu on photos {common['data_options']['size']}px, batch 4, lr 0.01; {_load()}.")


def run(*, quick: bool = False, device: str = "cpu") -> None:
    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available here")
    _attacks(quick, where)
    _training(quick, where)


if __name__ == "__main__":
    run()
