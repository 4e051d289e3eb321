"""Defenses: reconstruction quality against their utility cost, their time overhead, and the Cramér–Rao bound.

1. Inverting Gradients (``fast`` preset, labels known) on a small tanh CNN over the bundled
   ``digits`` (8×8) as each defense's strength grows — RMSE and PSNR after Hungarian matching,
   per batch size, in the spirit of Liu et al. (2024) Table 4 — printed beside the defense's
   utility (Table 5: final training loss; test accuracy; ε for DP-SGD) from
   ``leakbench.evaluation.training.utility.utility`` with the same CNN and the same budget.
2. Time overhead of each defense: ``observe`` with the defense ÷ ``observe`` without (batch 16,
   same process, interleaved, best of n) and one training epoch with ÷ without.
3. The Cramér–Rao lower bound on the per-entry RMSE (Liu et al. eq. 28/29 with clipping and
   pruning as in App. E) next to the attack's RMSE for noisy gradients, batch 1.
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.analysis.bounds import cramer_rao
from leakbench.defenses import parse, share
from leakbench.evaluation.training.utility import utility
from leakbench.losses import get_loss

from .common import console, table

MODEL, ACT = "cnn:3-8-1-1,3-8-2-1", "tanh"

# (family, strength, spec) grouped like Table 4's columns; dpsgd, dropout, secagg and quantize added
SETTINGS = [
    ("none", "—", "none"),
    *[("prune", f"p={p}", f"prune:{p}") for p in (0.3, 0.5, 0.7, 0.9, 0.99)],
    *[("clip", f"C={c}", f"clip:{c}") for c in (1, 0.5, 0.25)],
    *[("noise", f"σ={s}", f"noise:{s}") for s in (0.001, 0.01, 0.1)],
    *[("graddrop", f"p={p}", f"graddrop:{p}") for p in (0.3, 0.5, 0.7, 0.9)],
    *[("local", f"k={k}", f"local:{k},0.1") for k in (3, 5)],
    *[("dpsgd", f"C=1,σ={s}", f"dpsgd:1,{s}") for s in (0.01, 0.1, 1.0)],
    *[("dropout", f"p={p}", f"dropout:{p}") for p in (0.3, 0.5)],
    *[("secagg", f"L={n}", f"secagg:{n}") for n in (2, 4)],
    *[("quantize", f"{b} bits", f"quantize:{b}") for b in (8, 4, 2)],
]
BOUND_SPECS = [("noise:0.001", 0.001, None, None), ("noise:0.01", 0.01, None, None), ("noise:0.1", 0.1, None, None),
               ("clip:0.5+noise:0.01", 0.01, 0.5, None), ("prune:0.9+noise:0.01", 0.01, None, 0.9),
               ("prune:0.99+noise:0.01", 0.01, None, 0.99)]


def _model(data, seed: int = 0):
    return lb.build(MODEL, input_shape=data.shape, classes=data.num_classes, act=ACT, seed=seed)


def _attack(data, model, spec: str, batch: int, draw: int, iterations: int) -> dict:
    x, y = data.batch(batch, seed=draw)
    obs = lb.observe(model, x, y, labels_known=True, defense=spec, population=data, seed=draw)
    rec = lb.attack("inverting-gradients", obs, preset="fast", iterations=iterations, seed=0)
    return lb.compare(rec, x, y)


def reconstruction(data, specs, batches, draws, iterations) -> dict[tuple[str, int], tuple[float, float]]:
    """(spec, B) → (mean RMSE, mean PSNR) over ``draws`` batches."""
    model = _model(data)
    out = {}
    for spec in specs:
        for b in batches:
            scores = [_attack(data, model, spec, b, d, iterations) for d in range(draws)]
            out[spec, b] = (sum(s["rmse"] for s in scores) / draws, sum(s["psnr"] for s in scores) / draws)
    return out


def overhead(data, specs, repeat: int, batch: int = 16, calls: int = 10) -> dict[str, float]:
    """spec → best time of ``calls`` client rounds (:func:`leakbench.defenses.share`) with the defense ÷ without."""
    model = _model(data)
    x, y = data.batch(batch, seed=0)
    params = {n: p.detach() for n, p in model.named_parameters()}
    loss_fn = get_loss("ce")

    def rounds(defense) -> float:
        gen = torch.Generator().manual_seed(0)
        t = time.perf_counter()
        for _ in range(calls):
            share(defense, model, params, x, y, loss_fn, generator=gen, population=data)
        return time.perf_counter() - t

    plain = parse("none")
    out = {}
    for spec in specs:
        defense = parse(spec)
        rounds(defense), rounds(plain)  # warm-up
        with_, without = [], []
        for _ in range(repeat):  # interleaved so machine load hits both alike
            with_.append(rounds(defense))
            without.append(rounds(plain))
        out[spec] = min(with_) / min(without)
    return out


def run(quick: bool = False) -> None:
    width = console.width
    console.width = max(width, 132)  # the side-by-side table is wide
    try:
        _run(quick)
    finally:
        console.width = width


def _run(quick: bool) -> None:
    data = lb.load("digits")
    batches, draws, iterations = ((1,), 1, 200) if quick else ((1, 4), 2, 400)
    epochs, repeat = (2, 3) if quick else (5, 7)
    specs = [s for _, _, s in SETTINGS]
    threads = torch.get_num_threads()

    start = time.perf_counter()
    rec = reconstruction(data, specs, batches, draws, iterations)
    t_attack = time.perf_counter() - start
    util = {s: utility(MODEL, data, s, model_options={"act": ACT}, epochs=epochs, cache_dir=False) for s in specs}
    base = util["none"]
    cols = ["defense"]
    for b in batches:
        cols += [f"RMSE B={b}", f"PSNR B={b}"]
    cols += ["train loss", "test acc", "Δ acc", "ε (δ=1e-5)"]
    rows = []
    for _, _, spec in SETTINGS:
        u = util[spec]
        row: list[object] = [spec]
        for b in batches:
            row += [rec[spec, b][0], rec[spec, b][1]]
        row += [u.train_loss, u.test_accuracy, u.test_accuracy - base.test_accuracy,
                "—" if u.epsilon is None else f"{u.epsilon:.3g}"]
        rows.append(row)
    table("Defenses — Inverting Gradients reconstruction vs utility (cf. Liu et al. Tables 4 and 5)", cols, rows,
          note=(f"digits 8×8, {MODEL} act={ACT}; attack: inverting-gradients preset fast, {iterations} iterations, "
                f"labels known, mean of {draws} batch draw(s) per B ({t_attack:.0f} s); utility: {epochs} epochs, "
                f"batch 16, lr 0.1, 25 % held out; threads={threads}"))

    obs_ratio = overhead(data, specs[1:], repeat)
    rows = [(spec, obs_ratio[spec], util[spec].seconds / base.seconds) for spec in specs[1:]]
    table("Defenses — time overhead relative to the plain gradient", ["defense", "client round ×", "training ×"],
          rows, note=(f"client round: leakbench.defenses.share on {MODEL}, batch 16, 10 rounds, best of {repeat} "
                      f"interleaved; training: {epochs} epochs (plain: {base.seconds:.2f} s); local:k does k steps "
                      "and secagg:L computes L clients by design"))

    model = _model(data)
    x, y = data.batch(1, seed=0)
    rows = []
    for spec, sigma, clip, prune in BOUND_SPECS:
        bound = cramer_rao(model, x, y, sigma=sigma, clip=clip, prune=prune, jacobian="fwd")
        attacked = rec[spec, 1][0] if (spec, 1) in rec else _attack(data, model, spec, 1, 0, iterations)["rmse"]
        rows.append((spec, bound.exact_rmse, bound.trace_rmse, attacked, bound.clip_scale, bound.pruned_energy))
    table("Cramér–Rao lower bound on the per-pixel RMSE vs the attack, batch 1",
          ["observation", "CR bound (exact)", "CR bound (trace)", "IG RMSE", "clip scale", "p̂"], rows,
          note=("bound: σ²·tr((JJᵀ)⁻¹) and σ²d²/tr(JJᵀ) per entry (Liu et al. eq. 28–29, App. E); it holds for "
                "unbiased estimators — IG uses a box and a TV prior, so it may dip below"))
