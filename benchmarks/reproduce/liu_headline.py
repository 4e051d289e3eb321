"""Liu et al. (2024)'s headline, decided: at matched utility loss, does gradient pruning leak less than noise?

The paper (Sec. 5.2, Table 5 and Figure 3; stored text lines 227 and 238): "With the same level of utility
loss, gradient pruning has the largest RMSE, indicating it is the best defense".  Its Figure 3 plots one
number per setting, without n or spread.  This entry answers the question on the demo's setting with the
evaluation's statistics (docs/evaluation.md, "Evidence"):

* the demo's CNN (``cnn:3-16-2-1,3-32-2-1``, ReLU, trained one epoch) on the bundled 32×32 photos, or on the
  shared CIFAR-10 subset with ``--full``;
* the paper's grids: prune p ∈ {0.3, 0.5, 0.7, 0.9, 0.99} and noise σ ∈ {0.001, 0.01, 0.05, 0.1} (Sec. 5.1),
  and no defense, at B = 4;
* the eavesdropper's attacks that run on every model: Inverting Gradients ``quick`` and ``fast``;
* n = 12 batches of 4 images per setting (``--full``: 24), three utility seeds (2 epochs, lr 0.02).

For every pair (prune p, noise σ) whose utility-loss intervals overlap — *matched utility* — the table gives
the paired difference of S_D (prune − noise, capped at chance, over the same batches) with its 95 %
bootstrap interval: ``prune leaks less`` (interval above 0), ``noise leaks less`` (below 0) or ``tied``.
The sweep's verdicts per budget are printed beside it.  Chance controls: the flat image at the data mean
(every S_D is capped there), and "stops every attack" where no attack is significantly below it.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

from leakbench.evaluation import Sweep
from leakbench.evaluation.verdicts.stats import paired_bootstrap
from leakbench.evaluation.verdicts.rules import BUDGETS, privacy_utility, verdicts
from leakbench.evaluation.verdicts.strongest import strongest
from leakbench.evaluation.verdicts.utility import utility_table

from .common import Quote, table

QUOTE = Quote("liu2024-reconstruction-attacks-defenses-systematic-evaluation.txt",
              "Sec. 5.2, Table 5 and Figure 3 (stored text lines 227, 238)")
PRUNE = [0.3, 0.5, 0.7, 0.9, 0.99]
NOISE = [0.001, 0.01, 0.05, 0.1]


def spec(*, full: bool) -> dict:
    """The sweep: the demo's eavesdropper on the paper's prune and noise grids at B = 4."""
    from benchmarks.common import CIFAR_NPZ
    from leakbench.data.cifar import CIFAR10_CLASSES

    data = ({"name": "npz", "options": {"path": str(CIFAR_NPZ), "classes": list(CIFAR10_CLASSES)}}
            if full and CIFAR_NPZ.exists()
            else {"name": "photos", "options": {"size": 32}})
    return {
        "name": "liu-headline", "datasets": [data],
        "models": [{"spec": "cnn:3-16-2-1,3-32-2-1", "act": "relu", "label": "cnn",
                    "training": {"epochs": 1, "lr": 0.05}}],
        "batch_sizes": [4], "images": 96 if full else 48, "seeds": [0],
        "attacks": [{"name": "inverting-gradients", "preset": "quick", "label": "ig-quick"},
                    {"name": "inverting-gradients", "preset": "fast", "label": "ig-fast"}],
        "defenses": ["none", {"prune": PRUNE}, {"noise": NOISE}],
        "utility": {"epochs": 2, "lr": 0.02, "seeds": [0, 1, 2]},
        "budget": {"trial_seconds": 300},
    }


def matched(rows) -> list[list[object]]:
    """Rows of the matched-utility table: (prune, noise, costs, S_D of each, paired difference, decision)."""
    points = {p.defense: p for p in privacy_utility(strongest(rows), utility_table(rows))}
    out = []
    for p in PRUNE:
        a = points.get(f"prune:{p:g}")
        for s in NOISE:
            b = points.get(f"noise:{s:g}")
            if a is None or b is None or not (a.utility.interval.known and b.utility.interval.known):
                continue
            ia, ib = a.utility.interval, b.utility.interval
            if ia.high < ib.low or ib.high < ia.low:
                continue  # utility not matched
            d = paired_bootstrap(a.sd_per_batch, b.sd_per_batch)
            verdict = ("prune leaks less" if d.above(0) else "noise leaks less" if d.below(0) else "tied")
            out.append([a.defense, b.defense, ia.text(3), ib.text(3), a.sd.text(3), b.sd.text(3), d.text(3),
                        verdict])
    return out


def run(*, full: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Sweep(spec(full=full), Path(tmp) / "headline.db", workers=2)
        sweep.run(progress=False)
        rows = sweep.store.rows()
        sweep.store.close()
    points = privacy_utility(strongest(rows), utility_table(rows))
    table("S_D and utility per setting (B = 4; mean ± 95 % interval, n)",
          ["defense", "S_D (capped)", "stops every attack", "per-image strongest", "utility loss (nats)",
           "test accuracy", "diverged"],
          [[p.defense, p.sd.text(3), "yes" if p.stops else "no", p.per_image.text(3), p.utility.interval.text(3),
            p.test_accuracy_ci.text(3), p.diverged or ""] for p in points])
    table("At matched utility (overlapping utility intervals): S_D(prune) − S_D(noise), paired by batch",
          ["prune", "noise", "utility prune", "utility noise", "S_D prune", "S_D noise", "difference",
           "decision"], matched(rows),
          note=f"The paper: pruning has the largest RMSE at the same utility loss — {QUOTE}.")
    found = verdicts(points, BUDGETS)
    table("The verdict per budget (upper end of the utility interval ≤ u)",
          ["budget", "status", "pick", "tied / equivalent", "S_D of the pick", "n"],
          [["any" if math.isinf(v.budget) else f"{v.budget:g}", v.status, v.defense, ", ".join(v.tied),
            v.sd.text(3), v.n] for v in found])
