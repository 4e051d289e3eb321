"""Provable-attacks paper, Sec. 5: training points on the margin and test points reaching it, against d.

Settings of the paper (and its public code): a two-layer ReLU network with a hidden bias
and no output bias (homogeneous), width 10 000, small initialisation, 20 training points
and 5 000 test points uniform on the sphere of radius √d, d from 1 to 1 000, trained
until an approximate KKT point.  Labels: independent fair coins (the code labels by the
parity of the signs of the coordinates, which is as unstructured for d ≥ 2).  The margin
γ is the smallest positive y·f(x) over the training set; a training point is "on the
margin" when y·f(x) ≤ 1.1 γ (the code's 10 % slack); a test point "reaches" it when
y·f(x) ≥ γ.  Also reported: the AUC of the margin membership attack (scores y·f(x)).

``--quick``: width 1 000, 1 000 test points, 6 dimensions, 600 steps.  Full: width
10 000, 5 000 test points, 11 dimensions from 1 to 1 000, 1 500 steps of full-batch GD.
Writes ``benchmarks/out/margin.png``.

Measured (2026-11-23, one thread on a 2-core CPU shared with other jobs): ``--quick`` 28 s;
full 658 s (d = 1 000 alone trains in 229 s).  Full: train acc 1 from d = 5 on (0.55 at
d = 1, 0.8 at d = 2); training points on the margin 0.3, 0.05, 0.1, 0.25, 0.35, 0.65,
0.7, 0.95, 1, 0.9, 0.95 and test points reaching it 0.50, 0.50, 0.38, 0.14, 0.13, 0.019,
0.0014, 0, 0, 0, 0 for d = 1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 1 000; AUC 0.52 →
0.91 (d = 10) → 0.9995 (d = 100) → 1 (d ≥ 200).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

import leakbench as lb
from leakbench.attacks.membership import membership_margin
from leakbench.metrics.membership import roc_auc
from leakbench.models.targets import train_target
from leakbench.threat import observe_weights

from .common import table

OUT = Path(__file__).parent / "out"


def one(d: int, *, width: int, n_test: int, steps: int, seed: int) -> dict:
    train = lb.load("sphere", n=20, d=d, rule="random", seed=seed)
    test = lb.load("sphere", n=n_test, d=d, rule="random", seed=seed + 1000)
    start = time.perf_counter()
    target = train_target(train, model=f"twolayer:{width}", loss="logistic", lr=0.5, steps=steps, loss_tol=0,
                          center=False, init="small", seed=seed)
    seconds = time.perf_counter() - start
    q = target.margins()
    positive = q[q > 0]
    gamma = float(positive.min()) if positive.numel() else float("nan")
    obs = observe_weights(target)
    y_test = test.signed_labels().double()
    q_test = target.outputs(test.images.double()).reshape(-1) * y_test
    scores = membership_margin(obs, torch.cat([train.images, test.images]).double(),
                               labels=torch.cat([train.labels, test.labels]),
                               margin_value=gamma).scores if gamma == gamma else None
    members = torch.cat([torch.ones(20), torch.zeros(n_test)]).bool()
    return {
        "d": d, "train_acc": float((q > 0).double().mean()), "loss": target.final_loss,
        "on_margin": float(((q > 0) & (q <= 1.1 * gamma)).double().mean()) if gamma == gamma else 0.0,
        "test_reach": float((q_test >= gamma).double().mean()) if gamma == gamma else float("nan"),
        "auc": roc_auc(scores, members) if scores is not None else float("nan"), "seconds": seconds,
    }


def run(quick: bool = False) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if quick:
        dims, width, n_test, steps = [1, 5, 20, 100, 300, 1000], 1000, 1000, 600
    else:
        dims, width, n_test, steps = [1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 1000], 10_000, 5000, 1500
    rows = [one(d, width=width, n_test=n_test, steps=steps, seed=0) for d in dims]
    table("Margin membership (provable attacks, Sec. 5)",
          ["d", "train acc", "final loss", "train on margin", "test ≥ margin", "AUC", "train s"],
          [(r["d"], r["train_acc"], r["loss"], r["on_margin"], r["test_reach"], r["auc"], r["seconds"]) for r in rows],
          note=f"n=20 train, {n_test} test on the sphere of radius √d; twolayer:{width} (hidden bias, no output bias), "
               f"small init, logistic loss, {steps} full-batch GD steps (lr 0.5), float64")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(dims, [r["on_margin"] for r in rows], "o-")
    ax[0].set(xscale="log", xlabel="input dimension d", ylabel="fraction of training points on the margin",
              ylim=(0, 1.05), title="training points on the margin (≤ 1.1 γ)")
    ax[1].plot(dims, [r["test_reach"] for r in rows], "o-", color="C3")
    ax[1].set(xscale="log", xlabel="input dimension d", ylabel="fraction of test points with y f(x) ≥ γ",
              ylim=(0, 1.05), title="test points reaching the margin")
    fig.tight_layout()
    fig.savefig(OUT / "margin.png", dpi=120)
    plt.close(fig)
    print(f"plot: {OUT / 'margin.png'}")
