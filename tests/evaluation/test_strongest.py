"""S_D selection on a hand-made table (Liu et al. 2024, Table 4) and the privacy–utility points (Figure 3)."""
from __future__ import annotations

import math

from leakbench.evaluation import privacy_utility, strongest, utility_table
from leakbench.evaluation.plan import defense_family


def row(attack, defense, b, rmse, psnr=None, ssim=None, status="done", error=None, dataset="d", model="m"):
    return {"kind": "attack", "dataset": dataset, "model": model, "attack": attack, "defense": defense,
            "batch_size": b, "status": status, "rmse": rmse, "psnr": psnr if psnr is not None else
            (None if rmse is None else -20 * math.log10(rmse)), "ssim": ssim, "error": error}


TABLE = [
    # defense none, B=2: ig wins on mean RMSE (0.20 vs 0.25) although dlg has the single best trial
    row("ig", "none", 2, 0.10), row("ig", "none", 2, 0.30),
    row("dlg", "none", 2, 0.05), row("dlg", "none", 2, 0.45),
    row("fc", "none", 2, None, status="n/a", error="fc needs an MLP"),
    # prune:0.9, B=2: equal RMSE, PSNR breaks the tie
    row("ig", "prune:0.9", 2, 0.40, psnr=8.0), row("dlg", "prune:0.9", 2, 0.40, psnr=9.0),
    # prune:0.9, B=4: dlg failed everywhere, ig diverged (NaN) once: nothing usable but cpa
    row("dlg", "prune:0.9", 4, None, status="failed", error="boom"),
    row("ig", "prune:0.9", 4, 0.2), row("ig", "prune:0.9", 4, float("nan")),
    row("cpa", "prune:0.9", 4, 0.35, ssim=0.5),
    # noise, B=2: only n/a attacks
    row("fc", "noise:0.1", 2, None, status="n/a", error="fc needs an MLP"),
]


def test_strongest_picks_lowest_mean_rmse_and_skips_na_and_failed():
    best = {(s.defense, s.batch_size): s for s in strongest(TABLE)}
    assert best[("none", 2)].attack == "ig" and math.isclose(best[("none", 2)].rmse, 0.20)
    scores = {a.attack: a for a in best[("none", 2)].scores}
    assert scores["fc"].not_applicable == "fc needs an MLP" and scores["fc"].trials == 0
    assert scores["dlg"].trials == 2 and math.isclose(scores["dlg"].rmse, 0.25)
    assert best[("prune:0.9", 2)].attack == "dlg"  # same RMSE, higher PSNR
    b4 = best[("prune:0.9", 4)]
    assert b4.attack == "cpa" and b4.ssim == 0.5
    assert {a.attack: a.failed for a in b4.scores}["dlg"] == 1
    assert math.isnan({a.attack: a.rmse for a in b4.scores}["ig"])
    none_ran = best[("noise:0.1", 2)]
    assert none_ran.attack is None and math.isnan(none_ran.rmse)
    assert [s.defense for s in strongest(TABLE)] == ["none", "prune:0.9", "prune:0.9", "noise:0.1"]


def test_settings_are_kept_apart():
    rows = [row("ig", "none", 1, 0.1, dataset="a"), row("dlg", "none", 1, 0.2, dataset="a"),
            row("ig", "none", 1, 0.3, dataset="b"), row("dlg", "none", 1, 0.2, dataset="b")]
    assert [(s.dataset, s.attack) for s in strongest(rows)] == [("a", "ig"), ("b", "dlg")]


def test_privacy_utility_points_use_the_undefended_baseline():
    util_rows = [
        {"kind": "utility", "status": "done", "dataset": "d", "model": "m", "defense": "none",
         "metrics": {"train_loss": 0.3, "test_accuracy": 0.9}},
        {"kind": "utility", "status": "done", "dataset": "d", "model": "m", "defense": "prune:0.9",
         "metrics": {"train_loss": 0.5, "test_accuracy": 0.8}},
        {"kind": "utility", "status": "failed", "dataset": "d", "model": "m", "defense": "noise:0.1", "metrics": {}},
    ]
    util = utility_table(util_rows)
    assert set(util) == {("d", "m", "none"), ("d", "m", "prune:0.9")}
    points = {(p.defense, p.batch_size): p for p in
              privacy_utility(strongest(TABLE), util, bounds={("d", "m", "prune:0.9", 2): 0.1})}
    p = points[("prune:0.9", 2)]
    assert math.isclose(p.train_loss_increase, 0.2) and math.isclose(p.accuracy_drop, 0.1)
    assert p.bound == 0.1 and p.family == "prune" and p.attack == "dlg"
    assert points[("none", 2)].train_loss_increase == 0.0
    assert points[("noise:0.1", 2)].train_loss_increase is None


def test_defense_family():
    assert defense_family("none") == ("none", "")
    assert defense_family("prune:0.9") == ("prune", "0.9")
    assert defense_family("clip:4+noise:0.01") == ("clip+noise", "4, 0.01")
