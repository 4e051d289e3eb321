"""Liu et al. (2024) Table 4's shape: four attacks × defenses at B = 2 / 4 / 8, the strongest attack per setting.

Table 4 of the paper (Sec. 5.2): RMSE of "Ours" (``liu2024`` on a model with a random head),
Gradient Inversion (``inverting-gradients``), Robbing the Fed (``robbing-the-fed`` on a model with an
imprint block) and CPA (``cocktail-party``) against gradient clipping, dropping, noise and pruning on
CIFAR-10 with a ResNet-18 trained one epoch, 10 000 iterations per attack (App. F) — the full grid is
the ``liu2024`` evaluation preset (days on 2 CPU cores).  This entry runs a slice that fits 2 cores:

* a small ReLU CNN (``cnn:3-16-2-1,3-32-2-1``, the demo's model), untrained (the paper trains one epoch);
  the server's modules as in the ``demo`` preset (imprint block, 64 bins calibrated on 256 public images;
  random head of 2 000 neurons);
* one batch per B of held-out CIFAR-10 images; quick presets (IG 300 steps, ``liu2024`` quick, CPA quick);
* default: no defense and prune p = 0.9 at B = 2, 4, 8, and clip C = 4, graddrop p = 0.5, noise σ = 0.01
  at B = 4; ``--full``: the paper's 15 settings and none at B = 2, 4, 8 (same quick attack budgets).

Chance controls per batch: the grey image (flat 0.5) and Inverting Gradients on a noise gradient.
An attack whose RMSE is not below the grey image's learnt nothing the grey image does not know.
"""
from __future__ import annotations

import math

import torch

import leakbench as lb
from leakbench.errors import NothingRecovered
from leakbench.evaluation.trials.controls import public_sample
from leakbench.models import malicious

from .common import Quote, grey, held_out_images, noise_observation, paper_vs_ours, score

QUOTE = Quote("liu2024-reconstruction-attacks-defenses-systematic-evaluation.txt",
              "Table 4 (Sec. 5.2; stored text lines 190–208)")
MODEL = "cnn:3-16-2-1,3-32-2-1"
ATTACKS = ("ours", "gradient-inversion", "robbing-the-fed", "cpa")
#: Table 4: defense setting → B → RMSE of (Ours, GradientInversion, Robbing The Fed, CPA)
_COLUMNS = ["clip:2", "clip:4", "clip:8", "graddrop:0.3", "graddrop:0.5", "graddrop:0.7", "graddrop:0.9",
            "noise:0.001", "noise:0.01", "noise:0.1", "prune:0.3", "prune:0.5", "prune:0.7", "prune:0.9",
            "prune:0.99"]
_ROWS = {
    2: ["0.17 0.17 0.19 0.16 0.16 0.18 0.18 0.17 0.22 0.28 0.16 0.17 0.20 0.26 0.27",
        "0.19 0.23 0.25 0.19 0.20 0.20 0.21 0.30 0.32 0.35 0.19 0.20 0.24 0.28 0.27",
        "0.23 0.23 0.23 0.28 0.32 0.32 0.30 0.26 0.25 0.27 0.22 0.25 0.32 0.37 0.46",
        "0.21 0.22 0.23 0.23 0.22 0.22 0.24 0.22 0.23 0.28 0.21 0.23 0.29 0.28 0.32"],
    4: ["0.16 0.16 0.16 0.16 0.16 0.19 0.19 0.19 0.24 0.27 0.16 0.16 0.21 0.27 0.27",
        "0.21 0.22 0.23 0.21 0.21 0.21 0.22 0.31 0.31 0.31 0.19 0.18 0.23 0.29 0.28",
        "0.18 0.18 0.18 0.27 0.31 0.32 0.31 0.19 0.19 0.22 0.20 0.25 0.32 0.39 0.42",
        "0.21 0.21 0.20 0.21 0.23 0.22 0.24 0.23 0.23 0.25 0.18 0.21 0.24 0.29 0.31"],
    8: ["0.16 0.16 0.16 0.16 0.17 0.19 0.19 0.19 0.29 0.30 0.15 0.16 0.20 0.29 0.29",
        "0.22 0.21 0.21 0.22 0.22 0.22 0.23 0.30 0.31 0.31 0.20 0.21 0.25 0.30 0.30",
        "0.16 0.16 0.16 0.29 0.31 0.31 0.31 0.16 0.16 0.25 0.22 0.30 0.30 0.36 0.43",
        "0.21 0.21 0.22 0.22 0.22 0.23 0.25 0.20 0.22 0.24 0.19 0.22 0.26 0.32 0.33"],
}
PAPER_TABLE4 = {(b, setting): tuple(float(r.split()[j]) for r in rows)
                for b, rows in _ROWS.items() for j, setting in enumerate(_COLUMNS)}
DEFAULT_SETTINGS = ["none", "clip:4", "graddrop:0.5", "noise:0.01", "prune:0.9"]


def _models(ds, x, seed: int = 0) -> dict[str, torch.nn.Module]:
    base = lb.build(MODEL, input_shape=ds.shape, classes=ds.num_classes, act="relu", seed=seed)
    public = public_sample(ds, x, 256, seed=seed)
    return {"plain": base,
            "imprint": malicious.imprint(base, bins=64, calibration=public, seed=seed, input_shape=ds.shape),
            "head": malicious.random_head(base, width=2000, seed=seed, input_shape=ds.shape)}


PLAN = {  # attack label → (model, attack name, options)
    "ours": ("head", "liu2024", {"preset": "quick"}),
    "gradient-inversion": ("plain", "inverting-gradients", {"preset": "quick"}),
    "robbing-the-fed": ("imprint", "robbing-the-fed", {}),
    "cpa": ("plain", "cocktail-party", {"preset": "quick"}),
}


def one(batch: int, setting: str, *, attacks=ATTACKS, seed: int = 0) -> dict:
    ds, idx, source = held_out_images(batch)
    x, y = ds.batch(indices=idx)
    models = _models(ds, x, seed)
    defense = None if setting == "none" else setting
    rmse = {}
    for label in attacks:
        which, name, options = PLAN[label]
        obs = lb.observe(models[which], x, y, defense=defense, seed=seed)
        attack = lb.attacks.create(name, **options)
        reasons = attack.requirements(obs)
        try:
            rmse[label] = float("nan") if reasons else score(attack(obs, seed=seed).images, x)["rmse"]
        except NothingRecovered:  # e.g. no imprint bin isolates a sample: no reconstruction to score
            rmse[label] = float("nan")
    obs = lb.observe(models["plain"], x, y, defense=defense, seed=seed)
    noise = lb.attack("inverting-gradients", noise_observation(obs, seed=seed), preset="quick")
    usable = {k: v for k, v in rmse.items() if not math.isnan(v)}
    return {"B": batch, "setting": setting, "rmse": rmse, "best": min(usable, key=usable.get) if usable else "",
            "grey": grey(x)["rmse"], "noise": score(noise.images, x)["rmse"],
            "paper": PAPER_TABLE4.get((batch, setting)), "source": source}


def rows(*, full: bool = False, only: list[tuple[int, str]] | None = None, attacks=ATTACKS) -> list[dict]:
    if full:
        plan = [(b, s) for b in (2, 4, 8) for s in ["none"] + _COLUMNS]
    else:  # B = 2 / 4 / 8 without defense and under the strongest pruning; one setting per other defense at B = 4
        plan = [(b, s) for b in (2, 4, 8) for s in ("none", "prune:0.9")] + [(4, s) for s in DEFAULT_SETTINGS[1:4]]
    plan = only or plan
    return [one(b, s, attacks=attacks) for b, s in plan]


def run(full: bool = False, only=None) -> None:
    out = rows(full=full, only=only)
    table_rows = []
    for r in out:
        paper = r["paper"]
        best_paper = ATTACKS[min(range(4), key=lambda i: paper[i])] if paper else ""
        table_rows.append((r["B"], r["setting"], *[r["rmse"].get(a, float("nan")) for a in ATTACKS], r["best"],
                           r["grey"], r["noise"],
                           " / ".join(f"{v:.2f}" for v in paper) if paper else "(not in Table 4)", best_paper))
    paper_vs_ours("Liu et al. Table 4 (slice) — RMSE of four attacks per defense setting and batch size",
                  ["B", "defense", "ours (liu2024)", "gradient inversion", "robbing the fed", "cpa", "strongest",
                   "grey image", "IG on noise gradient", "paper: ours / GI / RtF / CPA", "paper strongest"],
                  table_rows, quote=QUOTE,
                  note=f"{out[0]['source']}; {MODEL} relu, untrained (paper: ResNet-18 trained one epoch); quick "
                       "presets (paper: 10 000 iterations); imprint 64 bins on 256 public images, random head 2 000; "
                       "RMSE on [0, 1] after Hungarian matching; nan = the attack does not apply")
