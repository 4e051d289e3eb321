"""R-GAP's per-layer least squares: the SVD solver (``gelsd``, the previous default) against the sparse Gram solver.

Chen & Campbell's CNN2–4 variants (Table 1) at 32×32, tanh, float64, batch 1 (one CIFAR-10 image),
the same observation for both solvers in this process: seconds per attack, the largest system
(rows × unknowns), the rank deficiencies, the relative difference between the two reconstructions and
each one's relative error to the true image (≈ 1e-15 where every layer has full rank: R-GAP is exact
there; large where a layer is rank-deficient — the same for both solvers, the minimum-norm solution).
"""
from __future__ import annotations

import time

import torch

import leakbench as lb

from .bench_analytic import TABLE1
from .common import benchmark_images, table


def run(quick: bool = False) -> None:
    ds, source = benchmark_images(4)
    x, y = ds.batch(1, seed=0)
    x64 = x.double()
    names = ["CNN2 V1", "CNN2 V2", "CNN3 V2", "CNN3 V4"] if quick else list(TABLE1)
    rows = []
    for name in names:
        model = lb.build(TABLE1[name], input_shape=ds.shape, classes=ds.num_classes, act="tanh",
                         bias={"conv": False, "linear": True}, init="uniform", seed=0, dtype=torch.float64)
        obs = lb.observe(model, x64, y)
        recs, secs = {}, {}
        for solver in ("gelsd", "auto"):
            start = time.perf_counter()
            recs[solver] = lb.attack("rgap", obs, solver=solver)
            secs[solver] = time.perf_counter() - start
        old, new = recs["gelsd"].images, recs["auto"].images
        layers = [layer for layer in recs["auto"].trace["layers"] if layer["kind"] == "conv"]
        largest = max(layers, key=lambda layer: layer["rows"] * layer["unknowns"])
        rows.append((name, TABLE1[name], f"{largest['rows']}×{largest['unknowns']}",
                     str([layer["rank_deficiency"] for layer in layers]),
                     secs["gelsd"], secs["auto"], secs["gelsd"] / secs["auto"],
                     f"{float((new - old).norm() / old.norm()):.1e}",
                     f"{float((old - x64).norm() / x64.norm()):.1e}", f"{float((new - x64).norm() / x64.norm()):.1e}",
                     ",".join(sorted({layer["solver"] for layer in layers}))))
    table("R-GAP seconds per variant: gelsd (SVD) vs the sparse Gram solver (default), 3×32×32, float64, batch 1",
          ["variant", "spec", "largest system", "rank deficiency", "gelsd s", "gram s", "ratio", "Δ rel",
           "err gelsd", "err gram", "solver"], rows,
          note=f"{source}; same observation for both solvers, one process; threads={torch.get_num_threads()}; "
               "Δ rel = ‖x_gram − x_gelsd‖/‖x_gelsd‖, err = ‖x̂ − x‖/‖x‖")
