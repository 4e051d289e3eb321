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

``--quick``: 4 reference models at most (rows at 2 and 4), 40 epochs.

Measured (2026-11, one thread on a shared 2-core CPU): full 10 s (training 5 s), ``--quick`` 6 s.  Full:
target train loss 0.019, non-member accuracy 0.963; AUC loss 0.547, LiRA offline 0.569 / 0.579 / 0.587 and
online 0.569 / 0.575 / 0.571, RMIA offline 0.595 / 0.611 / 0.619 and online 0.602 / 0.604 / 0.605 at 2 / 4 / 8
models (each ± 0.027); TPR at 2 % FPR loss 0.035, LiRA 0.024–0.046, RMIA 0.055–0.068.  RMIA ≥ LiRA ≥ loss as
published, by small margins here: the MLP generalises well on digits.
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.evaluation.reference import (Recipe, membership_rows, run_membership_attacks, target_on_half,
                                            train_reference_models)

from .common import table

ATTACKS = {"LiRA offline": ("membership-lira", {"online": False}),
           "LiRA online": ("membership-lira", {"online": True}),
           "RMIA offline": ("membership-rmia", {"online": False}),
           "RMIA online": ("membership-rmia", {"online": True})}
FPRS = (0.05, 0.02, 0.01, 0.001)


def run(*, quick: bool = False) -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    pool = lb.load("digits")
    recipe = Recipe("mlp:128", epochs=40 if quick else 60, batch_size=32, lr=0.2)
    target, members, fit = target_on_half(recipe, pool, seed=0)
    budgets = (2, 4) if quick else (2, 4, 8)
    refs = train_reference_models(recipe, pool, count=max(budgets), seed=0, cache_dir=False)
    trained = time.perf_counter() - start
    rows = []
    loss = run_membership_attacks(target, pool, refs, {"loss": ("membership-loss", {})})
    for r in membership_rows(loss, members, fprs=FPRS):
        rows.append(["loss (Yeom)", "0", r.auc.text(3), *[r.tpr_text(f) for f in FPRS]])
    for k in budgets:
        scores = run_membership_attacks(target, pool, refs, ATTACKS, models=k)
        for r in membership_rows(scores, members, fprs=FPRS):
            rows.append([r.attack, str(k), r.auc.text(3), *[r.tpr_text(f) for f in FPRS]])
    test_acc = 1.0 - float((target(pool.images[~members]).argmax(1) != pool.labels[~members]).float().mean())
    table(f"Membership with reference models — digits, mlp:128 (train loss {fit.train_loss:.3f}, "
          f"non-member accuracy {test_acc:.3f})",
          ["attack", "models", "AUC ± 95 % CI", "TPR @ 5 %", "TPR @ 2 %", "TPR @ 1 %", "TPR @ 0.1 %"], rows,
          note=f"{int(members.sum())} members, {int((~members).sum())} non-members; training {trained:.0f} s, "
               f"total {time.perf_counter() - start:.0f} s.  Published: LiRA, RMIA ≫ loss at low FPR; "
               "RMIA ≥ LiRA at few reference models.")
