"""Liu et al. (2024) Table 1: how the Cramér–Rao lower bound on the reconstruction error scales.

Table 1 (lower-bound row) for the two-layer network f(x) = Σ_j a_j σ(w_jᵀx): no defense σ·√(d/m),
clipping σ·max(1, ‖G‖/C)·√(d/m), pruning σ·√(d/((1 − p)m)) — up to constants and log factors.  We
compute the exact bound of :func:`leakbench.analysis.cramer_rao` (eq. 28, float64, J by forward
mode) on a batch of B = 2 points on the unit sphere, tanh, Gaussian first layer, squared loss (seed 0),
and fit its exponents: the slope of log R_L against log m must be ≈ −1/2 and against log d ≈ +1/2;
clipping to C = ‖G‖/k must multiply it by ≈ k; pruning by ≈ 1/√(1 − p̂) (p̂ the pruned energy).
The bound is a property of the observation, not an attack: its control is the closed-form rate itself.

Default: m ∈ {16, 32, 64, 128, 256} at d = 10; d ∈ {5, 10, 20, 40} at m = 128.
``--full``: m up to 1 024, d up to 80.
"""
from __future__ import annotations

import math

import numpy as np
import torch

import leakbench as lb
from leakbench.analysis import cramer_rao, two_layer_scaling

from .common import Quote, paper_vs_ours

QUOTE = Quote("liu2024-reconstruction-attacks-defenses-systematic-evaluation.txt",
              "Table 1 (Sec. 3; stored text lines 84–88)")
SIGMA = 0.1


def _model(m: int, d: int):
    return lb.build(f"twolayer:{m}", input_shape=(d,), classes=1, init="gaussian", seed=0, act="tanh", bias=False)


def _batch(d: int, b: int = 2):
    x = torch.randn(b, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return x / x.norm(dim=1, keepdim=True), torch.tensor([[1.0], [-1.0]] * (b // 2), dtype=torch.float64)


def _bound(m: int, d: int, **defense):
    x, y = _batch(d)
    return cramer_rao(_model(m, d), x, y, sigma=SIGMA, loss="mse", jacobian="fwd", **defense)


def _fit(points, which: str, tail: int | None = None) -> float:
    pts = points[-tail:] if tail else points
    return float(np.polyfit(np.log([a for a, _ in pts]), np.log([getattr(r, which) for _, r in pts]), 1)[0])


def slopes(widths, dims) -> list[dict]:
    """Exponents of the bound (trace form, eq. 29, and exact, eq. 28) in m and d, against the paper's ±1/2."""
    at_m = [(m, _bound(m, 10)) for m in widths]
    at_d = [(d, _bound(128, d)) for d in dims]
    return [
        {"scaling": "R_L vs width m (d = 10)", "points": at_m, "trace": _fit(at_m, "trace"),
         "exact": _fit(at_m, "exact", 3), "paper": -0.5},
        {"scaling": "R_L vs input dim d (m = 128)", "points": at_d, "trace": _fit(at_d, "trace"),
         "exact": _fit(at_d, "exact", 3), "paper": 0.5},
    ]


def defenses(m: int = 64, d: int = 10) -> list[dict]:
    """Clipping and pruning factors on the plain bound, against Table 1's formulas."""
    plain = _bound(m, d)
    rows = []
    for k in (2.0, 4.0):
        r = _bound(m, d, clip=plain.grad_norm / k)
        rows.append({"defense": f"clip C = ‖G‖/{k:g}", "exact": r.exact / plain.exact,
                     "trace": r.trace / plain.trace,
                     "paper": two_layer_scaling("clip", d=d, m=m, sigma=SIGMA, C=plain.grad_norm / k,
                                                grad_norm=plain.grad_norm).lower
                     / two_layer_scaling("none", d=d, m=m, sigma=SIGMA).lower})
    for p in (0.5, 0.9):
        r = _bound(m, d, prune=p)
        rows.append({"defense": f"prune p = {p:g} (p̂ = {r.pruned_energy:.3f})", "exact": r.exact / plain.exact,
                     "trace": r.trace / plain.trace, "paper": 1 / math.sqrt(1 - p),
                     "paper_hat": 1 / math.sqrt(1 - r.pruned_energy)})
    return rows


def run(full: bool = False, only=None) -> None:
    widths = [16, 32, 64, 128, 256, 512, 1024] if full else [16, 32, 64, 128, 256]
    dims = [5, 10, 20, 40, 80] if full else [5, 10, 20, 40]
    rows = slopes(widths, dims)
    paper_vs_ours("Liu et al. Table 1 — exponent of the Cramér–Rao bound in m and d",
                  ["scaling", "ours: trace form (eq. 29)", "ours: exact (eq. 28), last 3 points", "paper",
                   "exact bound at each point"],
                  [(r["scaling"], r["trace"], r["exact"], r["paper"],
                    ", ".join(f"{a}: {v.exact:.3g}" for a, v in r["points"])) for r in rows],
                  quote=QUOTE, note=f"two-layer tanh net, Gaussian W, B = 2 on the unit sphere, squared loss, "
                                    f"σ = {SIGMA}, float64; the exact bound approaches the rate once m·d ≫ B·d")
    drows = defenses()
    paper_vs_ours("Liu et al. Table 1 — defense factors on the bound (m = 64, d = 10)",
                  ["defense", "ours: exact ratio", "ours: trace-form ratio", "paper's rate (nominal p)",
                   "paper's rate with p̂ (Prop. 3.4)"],
                  [(r["defense"], r["exact"], r["trace"], r["paper"], r.get("paper_hat", "")) for r in drows],
                  quote=QUOTE,
                  note="clip: max(1, ‖G‖/C); prune: 1/√(1 − p); p̂ = the pruned fraction of ‖J‖² "
                       "(magnitude pruning drops the small entries, which carry little of J)")
