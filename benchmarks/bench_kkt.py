"""Haim et al. (2022)-style reconstruction from trained weights: best reconstructions and SSIM vs output.

A homogeneous d-1000-1000-1 ReLU MLP (first-layer bias only, first layer N(0, 10⁻⁸), the
rest Kaiming) is trained with full-batch GD on the logistic loss on n images of the
bundled scikit-learn digits, odd vs even (MNIST files are not bundled; 8×8 images, d = 64),
mean-subtracted, float64.  Departure from the paper's training (10⁶ epochs of
constant-step GD, out of a CPU budget): ``schedule="adaptive"`` (the loss-scaled step
η_t/L of Lyu & Li 2020 with an adapted η_t, a time change of the same gradient flow),
run in log-space past the float64 range of the loss.  With a constant step the Kaiming
middle layer dominates θ for thousands of steps (measured: KKT residual 0.994 after
3 000 steps, and the attack cannot lower its stationarity below that), so the weights
are nowhere near a KKT point.  The KKT attack runs ``runs`` random-search runs with
m = 2n candidates each (σ_x, α, λ_min drawn from the appendix B.2 distributions; the
learning rate fixed to a stable value on this CPU budget), on the weights rescaled to
‖θ‖ = 5 (``rescale``: the same KKT direction, and λ ~ U(0, 1), lr 3·10⁻³ stay stable
for weights trained far out in norm), pools them, and the appendix B.3 post-processing
pairs each training image with its voted reconstruction.  Model inversion (Sec. 5.4) on
the same network is the baseline.

Outputs in ``benchmarks/out/``: ``kkt_grid.png`` (best reconstructions above their
training images, sorted by SSIM) and ``kkt_ssim_vs_output.png`` (Figure 16: each
training sample's best SSIM against the network's output y·Φ(x)).  The table reports the
counts of training samples recovered with SSIM ≥ 0.4 and ≥ 0.6 (on 8×8 images SSIM is
lenient: the model-inversion baseline reaches 0.4 too, so compare the two rows).

``--quick``: n = 10, 1 000 adaptive training steps, 2 runs × 1 500 iterations.  Full
(budget: about 1 h on a shared 2-core CPU, one thread): n = 50 (25 per class), 3 000
adaptive training steps, 4 runs × 3 000 iterations with m = 100 (the attack's cost
grows with m × iterations × runs).

Measured (full, 2026-11-23, one thread on a 2-core CPU shared with other jobs, load ≈ 6):
3 016 s in all (training 158 s, attack 2 769 s); target residual 0.865, 33/50 samples
within 10 % of the margin; kkt: 40/50 training images at SSIM ≥ 0.4, 17/50 at ≥ 0.6,
best 0.78; model inversion: 0/50, best 0.23 on the raw weights, and with ``rescale=5``
(now the benchmark's baseline, the kkt attack's scale; rerun separately, 30 s) 3/50 at
SSIM ≥ 0.4, 0/50 at ≥ 0.6, best 0.42.  Read with care: the four runs stop at a
stationarity of 0.85 (the target's own residual is 0.865), and the best reconstructions
in ``kkt_grid.png`` are blurred average digits, not recognisable training images — on
8×8 images with a 7-pixel window SSIM ≥ 0.6 does not mean recovered.  The deep net is
far from a KKT point on this budget (its Kaiming middle layer still dominates ‖θ‖).
Before the adaptive schedule (``--quick`` with 3 000 constant steps) the residual was
0.994 and the attack did not move the stationarity at all (0.9938).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

import leakbench as lb
from leakbench.analysis.stationarity import kkt_residual
from leakbench.metrics.voting import vote
from leakbench.models.targets import train_target
from leakbench.threat import observe_weights

from .common import table

OUT = Path(__file__).parent / "out"


def run(quick: bool = False) -> None:
    torch.set_num_threads(1)
    per_class, steps, runs, iters = (5, 1000, 2, 1500) if quick else (25, 3000, 4, 3000)
    data = lb.load("digits", binary="odd-even")
    t0 = time.perf_counter()
    target = train_target(data, per_class=per_class, model="mlp:1000-1000", loss="logistic", lr=0.5, steps=steps,
                          loss_tol=0, schedule="adaptive", init="small", data_seed=0, seed=0)
    t_train = time.perf_counter() - t0
    kkt_res = kkt_residual(target.model, target.inputs, target.y)
    obs = observe_weights(target)
    n = target.x.shape[0]
    t0 = time.perf_counter()
    rec = lb.attack("kkt", obs, candidates=2 * n, iterations=iters, runs=runs, lr=3e-3, lambda_lr=1e-4, rescale=5.0,
                   seed=0)
    t_attack = time.perf_counter() - t0
    result = vote(rec.images, target.x)
    inv = lb.attack("model-inversion", obs, candidates=2 * n, iterations=iters // 2, lr=0.01, init_scale=0.1,
                    rescale=5.0)  # the same scale as the kkt attack: a fair baseline
    baseline = vote(inv.images, target.x)
    outputs = (target.outputs().reshape(-1) * target.y).cpu()
    rows = [
        ("kkt", n, runs * 2 * n, result.count(0.4), result.count(0.6), float(result.score.max()), t_attack),
        ("model-inversion", n, 2 * n, baseline.count(0.4), baseline.count(0.6), float(baseline.score.max()), float("nan")),
    ]
    table("Reconstruction from trained weights (Haim et al. 2022) — digits odd vs even, 64-1000-1000-1",
          ["attack", "n train", "candidates", "SSIM ≥ 0.4", "SSIM ≥ 0.6", "best SSIM", "attack s"], rows,
          note=f"target: {steps} adaptive GD steps → min margin {float(target.margins().min()):.3g}, KKT residual {kkt_res.residual:.3f}, "
               f"{int(kkt_res.on_margin.sum())}/{n} samples within 10 % of the margin, trained in {t_train:.0f} s; "
               f"kkt: {runs} runs × {iters} iterations, m = 2n, ‖θ‖ rescaled to 5; SSIM on 8×8 images uses a 7-pixel window")
    hp = [(i, r["init_scale"], r["alpha"], r["lambda_min"], r["relative_stationarity"]) for i, r in enumerate(rec.trace["runs"])]
    table("kkt runs", ["run", "σ_x", "α", "λ_min", "‖θ − Σλ∇Φ‖/‖θ‖"], hp)
    _plots(target, result, outputs)


def _plots(target, result, outputs) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    top = result.order[:10]
    fig, ax = plt.subplots(2, len(top), figsize=(1.2 * len(top), 2.8), squeeze=False)
    for col, i in enumerate(top.tolist()):
        ax[0, col].imshow(result.images[i, 0].cpu(), cmap="gray", vmin=0, vmax=1)
        ax[0, col].set_title(f"{float(result.score[i]):.2f}", fontsize=8)
        ax[1, col].imshow(target.x[i, 0].cpu(), cmap="gray", vmin=0, vmax=1)
        for r in range(2):
            ax[r, col].axis("off")
    fig.suptitle("top: reconstructions (SSIM); bottom: nearest training images", fontsize=9)
    fig.savefig(OUT / "kkt_grid.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    ax.scatter(outputs.numpy(), result.score.numpy(), s=12)
    ax.set(xlabel="output y·Φ(x) of the training sample", ylabel="best SSIM of its reconstruction",
           title="SSIM vs output (Haim et al. Fig. 16)")
    fig.tight_layout()
    fig.savefig(OUT / "kkt_ssim_vs_output.png", dpi=120)
    plt.close(fig)
    print(f"plots: {OUT / 'kkt_grid.png'}, {OUT / 'kkt_ssim_vs_output.png'}")
