"""Provable privacy attacks on trained shallow networks, Sec. 5 / Figure 1: margin fractions against d.

Figure 1 of the paper: (a) the fraction of the 20 training points on the margin grows with the input
dimension d; (b, c) the fraction of 5 000 test points (same distribution) on or above the margin falls
with d — so y·f(x) ≥ γ is a membership test.  The stored text gives the setting (width 10 000, hidden
bias, no output bias, small init, points uniform on the sphere of radius √d, d from 1 to 1 000) and the
trend in words ("virtually all test points lie below the margin" from a moderate d on, "approximately
80 %" below it at a smaller d); the figure's values and those two values of d are lost in the text
extraction, so the paper column states the trend the figure shows.

Ours: :func:`benchmarks.bench_margin.one` (the same network, logistic loss, full-batch GD, float64).
Chance control: the non-member rows are the test points themselves (a test point reaching the margin is
a false positive); the membership AUC of y·f(x) is 0.5 at chance.
Default: width 1 000, 1 000 test points, d ∈ {1, 5, 20, 100, 300, 1 000}, 600 steps.
``--full``: width 10 000, 5 000 test points, 11 values of d, 1 500 steps (about 11 min on 2 cores).
"""
from __future__ import annotations

from ..bench_margin import one
from .common import Quote, paper_vs_ours

QUOTE = Quote("provable-privacy-attacks-trained-shallow-networks.txt",
              "Sec. 5, Figure 1 (a)–(c) (stored text lines 174–189)")
PAPER_TREND = {"train": "rises with d towards 1", "test": "falls with d towards 0"}


def budgets(full: bool) -> dict:
    if full:
        return {"dims": [1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 1000], "width": 10_000, "n_test": 5000,
                "steps": 1500}
    return {"dims": [1, 5, 20, 100, 300, 1000], "width": 1000, "n_test": 1000, "steps": 600}


def rows(*, full: bool = False, only: list[int] | None = None, **override) -> list[dict]:
    b = {**budgets(full), **override}
    return [one(d, width=b["width"], n_test=b["n_test"], steps=b["steps"], seed=0) | {"budget": b}
            for d in (only or b["dims"])]


def run(full: bool = False, only=None) -> None:
    out = rows(full=full, only=only)
    b = out[0]["budget"]
    paper_vs_ours("Provable attacks Figure 1 — training points on the margin and test points reaching it, against d",
                  ["d", "train on margin (≤ 1.1 γ)", "paper (a)", "test ≥ γ (non-members, false positives)",
                   "paper (b, c)", "membership AUC (chance 0.5)", "train acc", "train s"],
                  [(r["d"], r["on_margin"], PAPER_TREND["train"], r["test_reach"], PAPER_TREND["test"], r["auc"],
                    r["train_acc"], r["seconds"]) for r in out],
                  quote=QUOTE, note=f"20 train, {b['n_test']} test points on the sphere of radius √d; twolayer:"
                                    f"{b['width']} (hidden bias, no output bias), small init, logistic loss, "
                                    f"{b['steps']} full-batch GD steps (lr 0.5), float64")
