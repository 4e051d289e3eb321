"""Membership inference with reference models on digits: loss, LiRA (offline/online), RMIA at 2 / 4 / 8 models.

The target is an MLP (``mlp:128``, 60 epochs of SGD, batch 32, lr 0.2 — trained to a training loss near 0.03)
on a seeded half of the whole digits set (1 797 points: 898 members, 899 non-members); 8 reference models
with the same recipe on complementary halves of the same pool (every point IN for exactly half of them);
the rows at 2 and 4 models use the first 2 and 4.  Every point of the pool is queried; RMIA's population z is
the pool.  Columns: AUC with its stratified-bootstrap 95 % interval, TPR at 1 % and 0.1 % FPR — reported only
with ≥ 10/FPR non-members, so on 899 non-members both read "not measurable"; TPR at 5 % and 2 % FPR are
given instead.  The margin attack does not apply (it needs a binary two-layer net at a KKT point).

Published orderings (Carlini et al. 2022, Fig. 9 and Table 1; Zarifzadeh et al. 2024, Fig. 1 and Table 2):
at low FPR both LiRA and RMIA ≫ loss; with few reference models RMIA ≥ LiRA (offline LiRA is weakest at
2 models); LiRA gains most from more models.

A second table puts the demo's CNN (``cnn:3-16-2-1,3-32-2-1``, ReLU; 30 epochs, batch 64, lr 0.1) on a seeded
pool of 2 400 full-resolution photo patches (32×32, 8 source photos as classes): 1 200 non-members, so TPR at
1 % FPR is measurable (≥ 10/FPR); 0.1 % would need 10 000.

``--quick``: 4 reference models at most (rows at 2 and 4), 40 epochs.

Measured (2026-11, one thread on a shared 2-core CPU): full 10 s (training 5 s), ``--quick`` 6 s.  Full:
target train loss 0.019, non-member accuracy 0.963; AUC loss 0.547, LiRA offline 0.569 / 0.579 / 0.587 and
online 0.569 / 0.575 / 0.571, RMIA offline 0.595 / 0.611 / 0.619 and online 0.602 / 0.604 / 0.605 at 2 / 4 / 8
models (each ± 0.027); TPR at 2 % FPR loss 0.035, LiRA 0.024–0.046, RMIA 0.055–0.068.  RMIA ≥ LiRA ≥ loss as
published, by small margins here: the MLP generalises well on digits.

Photo patches, demo CNN (train loss 0.28, non-member accuracy 0.86; 60 s): AUC loss 0.517, LiRA offline 0.537 /
0.557 / 0.565 and online 0.519 / 0.529 / 0.534, RMIA offline 0.542 / 0.557 / 0.564 and online 0.540 / 0.561 /
0.560 at 2 / 4 / 8 models (each ± 0.023, n = 2 400); TPR at 1 % FPR (chance 0.010, n = 1 200 non-members): loss
0.012, LiRA offline 0.020–0.025, online 0.002–0.016, RMIA 0.018–0.033.  Offline LiRA and both RMIAs clear the loss
baseline's interval (upper end 0.540) from 4 models on, online LiRA never; at 2 models RMIA ≥ LiRA as published,
inside the intervals (a tie).
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.evaluation.membership.reference import (Recipe, membership_rows, run_membership_attacks,
                                                       target_on_half, train_reference_models)

from .common import table

ATTACKS = {"LiRA offline": ("membership-lira", {"online": False}),
           "LiRA online": ("membership-lira", {"online": True}),
           "RMIA offline": ("membership-rmia", {"online": False}),
           "RMIA online": ("membership-rmia", {"online": True})}
FPRS = (0.05, 0.02, 0.01, 0.001)


def _table(title: str, pool, recipe: Recipe, budgets: tuple[int, ...], start: float) -> None:
    target, members, fit = target_on_half(recipe, pool, seed=0)
    refs = train_reference_models(recipe, pool, count=max(budgets), seed=0, cache_dir=False)
    trained = time.perf_counter() - start
    rows = []
    loss = run_membership_attacks(target, pool, refs, {"loss": ("membership-loss", {})})
    for r in membership_rows(loss, members, fprs=FPRS):
        rows.append(["loss (Yeom)", "0", r.auc.text(3), *[r.tpr_text(f) for f in FPRS]])
    rows.append(["margin", "0", "n/a: needs a binary two-layer net at a KKT point", *["–"] * len(FPRS)])
    for k in budgets:
        scores = run_membership_attacks(target, pool, refs, ATTACKS, models=k)
        for r in membership_rows(scores, members, fprs=FPRS):
            rows.append([r.attack, str(k), r.auc.text(3), *[r.tpr_text(f) for f in FPRS]])
    with torch.no_grad():
        test_acc = float((target(pool.images[~members]).argmax(1) == pool.labels[~members]).float().mean())
    table(f"Membership with reference models — {title} (train loss {fit.train_loss:.3f}, "
          f"non-member accuracy {test_acc:.3f})",
          ["attack", "models", "AUC ± 95 % CI", "TPR @ 5 %", "TPR @ 2 %", "TPR @ 1 %", "TPR @ 0.1 %"], rows,
          note=f"{int(members.sum())} members, {int((~members).sum())} non-members (chance: AUC 0.5, TPR = FPR); "
               f"training {trained:.0f} s, total {time.perf_counter() - start:.0f} s.  Published: LiRA, RMIA ≫ "
               "loss at low FPR; RMIA ≥ LiRA at few reference models.")


def run(*, quick: bool = False) -> None:
    torch.set_num_threads(1)
    budgets = (2, 4) if quick else (2, 4, 8)
    start = time.perf_counter()
    _table("digits, mlp:128", lb.load("digits"),
           Recipe("mlp:128", epochs=40 if quick else 60, batch_size=32, lr=0.2), budgets, start)
    # the demo's CNN on photo patches, a pool of 2 400 so that 1 200 non-members measure TPR at 1 % FPR
    photos = lb.load("photos", size=32, scale=1)
    pool = photos.subset(torch.randperm(len(photos), generator=torch.Generator().manual_seed(0))[:2400])
    start = time.perf_counter()
    _table("photo patches 32×32, the demo CNN (cnn:3-16-2-1,3-32-2-1 relu)", pool,
           Recipe("cnn:3-16-2-1,3-32-2-1", model_options={"act": "relu"}, epochs=10 if quick else 30,
                  batch_size=64, lr=0.1), budgets, start)
