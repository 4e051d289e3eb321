"""Chen & Campbell (BMVC 2022): Table 1 (rank deficiency, security metric) and Appendix E (R-GAP vs hybrid vs
gradient matching per CNN variant).

Setting of the paper (Sec. 4): one CIFAR-10 image, CNNs of Table 1 with tanh, bias-free convolutions,
a biased FC layer, uniform initialisation, untrained; we use float64 and held-out CIFAR-10 images
(index ≥ 500 of ../shared/data, or the bundled photos).  The paper's PSNR uses peak 255 on images it
scores in [0, 1] (+48.13 dB, METHODS.md); we quote it both ways and report the standard PSNR.

Budgets.  Default (2 cores): ``hybrid`` preset ``quick`` (300 / 200 / 100 iterations per layer, lr 1e-2),
``inverting-gradients`` preset ``quick`` (300 steps).  ``--full``: the paper's budgets (Appendix D):
hybrid 10 000 / 8 000 / 1 000 iterations per layer at Adam's default lr 1e-3, CosineTV (= Inverting
Gradients) 4 800 steps.  Controls: the grey image, and each attack on a noise gradient (same norm per
tensor) at the default budget.
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.analysis import security_metric

from ..bench_analytic import TABLE1
from .common import Quote, grey, held_out_images, noise_observation, paper_vs_ours, score

TABLE1_QUOTE = Quote("chen-campbell2022-linear-systems-gradient-matching.txt",
                     "Table 1 (Sec. 4; stored text lines 103–112)")
APPE_QUOTE = Quote("chen-campbell2022-linear-systems-gradient-matching.txt",
                   "Appendix E, the supplement's table of MSE, PSNR (stored text lines 196–208)")

#: Table 1: rank deficiency per conv layer and the metric (the paper prints the metric rounded).
PAPER_TABLE1 = {
    "CNN2 V1": ([0], 0), "CNN2 V2": ([-1470], -1470), "CNN3 V1": ([0, -4533], -2266),
    "CNN3 V2": ([-1470, -1050], -1995), "CNN3 V3": ([0, 0], 0), "CNN3 V4": ([-2146, 0], -2146),
    "CNN4 V1": ([0, -3965, -386], -2772), "CNN4 V2": ([0, -9316, 0], -6211),
}
#: Appendix E: PSNR with peak 255 of R-GAP, DLG, CosineTV, Hybrid on untrained variants.
PAPER_PSNR255 = {
    "CNN2 V1": (197.00, 45.08, 54.54, 79.82), "CNN2 V2": (62.75, -9.32, 53.01, 71.69),
    "CNN3 V1": (60.90, 48.46, 52.03, 61.48), "CNN3 V2": (60.99, 48.17, 51.37, 63.78),
    "CNN3 V3": (181.26, -59.49, 54.51, 75.79), "CNN3 V4": (61.83, -29.17, 51.07, 61.96),
    "CNN4 V1": (60.81, 48.79, 51.86, 60.28), "CNN4 V2": (62.05, 58.35, 54.82, 67.72),
}
PEAK_255 = 48.13  # 20·log10(255)
QUICK_VARIANTS = ["CNN2 V1", "CNN2 V2", "CNN3 V1", "CNN3 V2", "CNN3 V4", "CNN4 V1"]


def table1(only: list[str] | None = None) -> list[dict]:
    rows = []
    for name in only or list(TABLE1):
        report = security_metric(TABLE1[name], (3, 32, 32))
        paper_rd, paper_metric = PAPER_TABLE1[name]
        rows.append({"variant": name, "rd": report.rank_deficiencies, "metric": report.metric,
                     "paper_rd": paper_rd, "paper_metric": paper_metric})
    return rows


def _model(name: str, ds):
    return lb.build(TABLE1[name], input_shape=ds.shape, classes=ds.num_classes, act="tanh",
                    bias={"conv": False, "linear": True}, init="uniform", seed=0, dtype=torch.float64)


def attacks(full: bool) -> dict[str, dict]:
    """label → options of the three attacks at the chosen budget."""
    if full:
        return {"rgap": {}, "hybrid": {}, "inverting-gradients": {"preset": "default"}}
    return {"rgap": {}, "hybrid": {"preset": "quick"}, "inverting-gradients": {"preset": "quick"}}


def appendix_e(*, full: bool = False, only: list[str] | None = None, images: int = 1, first: int = 0,
               overrides: dict[str, dict] | None = None, controls: bool = True,
               names: tuple[str, ...] = ("rgap", "hybrid", "inverting-gradients")) -> tuple[list[dict], str]:
    """One row per (variant, attack or control): mean standard PSNR over ``images`` held-out images
    (from the ``first``-th on: CIFAR-10 index 500 + first)."""
    ds, idx, source = held_out_images(images, offset=first)
    plan = {k: v for k, v in attacks(full).items() if k in names}
    for name, extra in (overrides or {}).items():
        plan[name] = {**plan.get(name, {}), **extra}
    quick = {k: v for k, v in attacks(False).items() if k in names}
    for name, extra in (overrides or {}).items():
        quick[name] = {**quick.get(name, {}), **extra}
    rows = []
    for variant in only or (list(TABLE1) if full else QUICK_VARIANTS):
        model = _model(variant, ds)
        per: dict[str, list[float]] = {}
        secs: dict[str, float] = {}
        for i in idx:
            x, y = ds.batch(indices=[i])
            obs = lb.observe(model, x.double(), y)
            for attack, options in plan.items():
                start = time.perf_counter()
                rec = lb.attack(attack, obs, **options)
                secs[attack] = secs.get(attack, 0.0) + time.perf_counter() - start
                per.setdefault(attack, []).append(score(rec.images, x)["psnr"])
            if controls:
                per.setdefault("grey image", []).append(grey(x)["psnr"])
                noise = noise_observation(obs, seed=i)
                for attack, options in quick.items():
                    rec = lb.attack(attack, noise, **options)
                    per.setdefault(f"{attack} on noise gradient", []).append(score(rec.images, x)["psnr"])
        paper = dict(zip(("rgap", "dlg", "inverting-gradients", "hybrid"), PAPER_PSNR255[variant]))
        for label, values in per.items():
            p = paper.get(label)
            rows.append({"variant": variant, "attack": label, "psnr": sum(values) / len(values),
                         "seconds": secs.get(label, float("nan")) / len(idx),
                         "paper_psnr255": p, "paper_psnr": None if p is None else p - PEAK_255})
    return rows, source


def run(full: bool = False, only: list[str] | None = None) -> None:
    rows = table1(only)
    paper_vs_ours("Chen & Campbell Table 1 — rank deficiency per conv layer and the security metric (eq. 12)",
                  ["variant", "rd ours", "rd paper", "metric ours", "metric paper"],
                  [(r["variant"], str(r["rd"]), str(r["paper_rd"]), round(r["metric"]), r["paper_metric"])
                   for r in rows],
                  quote=TABLE1_QUOTE, note="3×32×32, random weights and upstream gradients (seed 0)")
    images = 3 if full else 1
    results, source = appendix_e(full=full, only=only, images=images)
    budget = ("paper budgets: hybrid 10 000/8 000/1 000 it per layer (lr 1e-3), IG 4 800 steps" if full else
              "quick budgets: hybrid 300/200/100 it (lr 0.1), IG 300 steps")
    paper_vs_ours("Chen & Campbell Appendix E — PSNR (standard, dB) per variant: ours vs the paper",
                  ["variant", "attack", "PSNR ours", "PSNR paper", "paper (peak 255)", "s"],
                  [(r["variant"], r["attack"], r["psnr"], "" if r["paper_psnr"] is None else r["paper_psnr"],
                    "" if r["paper_psnr255"] is None else r["paper_psnr255"], r["seconds"]) for r in results],
                  quote=APPE_QUOTE,
                  note=f"{source}; mean over {images} image(s); {budget}; noise-gradient rows at quick budgets; "
                       "paper PSNR = its peak-255 value − 48.13; the paper's CosineTV = inverting-gradients")
