"""Do verdicts survive a change of seeds?  The demo's eavesdropper run on three disjoint seed sets.

The demo spec's eavesdropper part (the CNN, Inverting Gradients with and without labels, every defense, three
batch sizes, utility over training seeds) is run three times with disjoint seeds — attack draws {0, 1},
{2, 3}, {4, 5} and utility seeds {0, 1, 2}, {3, 4, 5}, {6, 7, 8} — each into its own store.  For every
(threat model, B, budget) the three decisions are compared: they *agree* when each run's pick is named or listed
as tied/equivalent/at the budget's edge by every run, they are a reported *tie* when one setting is named or so
listed by every run (a run that names another one reports the tie), and the table says where they differ.  Before this
work a verdict named one defense from one batch, one seed and one training run; the baseline column shows
what the same rule (the highest mean S_D within the budget, no intervals) names on each seed set.

``--quick``: B = 1 and 4, images 4, one utility epoch (minutes instead of a quarter of an hour).
"""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import yaml

from leakbench.evaluation import Sweep
from leakbench.evaluation.sweep_spec.bundled import preset_path
from leakbench.evaluation.verdicts.rules import BUDGETS, privacy_utility, verdicts
from leakbench.evaluation.verdicts.strongest import strongest
from leakbench.evaluation.verdicts.utility import utility_table

from .common import table

SEED_SETS = ([0, 1], [2, 3], [4, 5])
UTILITY_SEEDS = ([0, 1, 2], [3, 4, 5], [6, 7, 8])


def eavesdropper_spec(seeds: list[int], utility_seeds: list[int], *, quick: bool) -> dict:
    """The demo spec cut to its eavesdropper CNN part, on the given seeds."""
    spec = yaml.safe_load(preset_path("demo").read_text())
    spec["name"] = f"demo-eavesdropper-{'-'.join(map(str, seeds))}"
    spec["models"] = [m for m in spec["models"] if m.get("label") == "cnn"]
    spec["attacks"] = [a for a in spec["attacks"] if a.get("label") in ("ig", "ig+labels")]
    spec["include"] = [r for r in spec["include"] if r.get("model") == "cnn"]
    spec["exclude"] = [r for r in spec.get("exclude") or [] if r.get("model", "cnn") == "cnn"]  # kept models only
    spec.pop("weights", None)
    spec.pop("membership", None)
    # a rule on the demo's seed k means the k-th seed of this set (the demo's seeds are 0, 1)
    for rule in spec["exclude"] + spec["include"]:
        if "seed" in rule:
            rule["seed"] = [seeds[k] for k in (rule["seed"] if isinstance(rule["seed"], list) else [rule["seed"]])]
    spec["seeds"] = list(seeds)
    spec["utility"] = {**spec["utility"], "seeds": list(utility_seeds)}
    if quick:
        spec["batch_sizes"] = [1, 4]
        spec["images"] = 4
        spec["utility"]["epochs"] = 1
        spec["replicate"] = {**spec.get("replicate", {}), "max_minutes": 1}
    # a rule value naming a dropped attack or batch size would select nothing (refused): keep the values still here
    kept = {"attack": {a.get("label", a["name"]) for a in spec["attacks"]} | {a["name"] for a in spec["attacks"]},
            "batch_size": set(spec["batch_sizes"])}
    for key in ("include", "exclude"):
        rules = []
        for rule in spec.get(key) or []:
            for field, values in kept.items():
                if field in rule:
                    listed = rule[field] if isinstance(rule[field], list) else [rule[field]]
                    rule = {**rule, field: [v for v in listed if v in values]}
            if all(rule.get(f) != [] for f in kept):
                rules.append(rule)
        spec[key] = rules
    return spec


def _naive(points, budget: float) -> dict[tuple, str]:
    """The old rule: the highest mean S_D among settings whose mean utility loss ≤ budget (ties by name)."""
    out: dict[tuple, tuple] = {}
    for p in points:
        cost = p.utility.mean if p.defense != "none" else 0.0
        if p.diverged or cost is None or (not math.isinf(budget) and cost > budget):
            continue
        key = (p.threat_model, p.batch_size)
        best = out.get(key)
        if best is None or (p.rmse, best[1]) > (best[0], p.defense):
            out[key] = (p.rmse, p.defense)
    return {k: v[1] for k, v in out.items()}


def run(*, quick: bool = False) -> None:
    found, naive, times = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (seeds, useeds) in enumerate(zip(SEED_SETS, UTILITY_SEEDS)):
            start = time.perf_counter()
            sweep = Sweep(eavesdropper_spec(seeds, useeds, quick=quick), Path(tmp) / f"s{i}.db", workers=2)
            sweep.run(progress=False)
            rows = sweep.store.rows()
            sweep.store.close()
            times.append(time.perf_counter() - start)
            points = privacy_utility(strongest(rows), utility_table(rows))
            found.append({(v.threat_model, v.batch_size, v.budget): v for v in verdicts(points, BUDGETS)})
            naive.append({b: _naive(points, b) for b in BUDGETS})
    rows_out, agree, consistent, total = [], 0, 0, 0
    for key in sorted(set().union(*found), key=lambda k: (k[0], k[1], k[2])):
        vs = [f.get(key) for f in found]
        if any(v is None for v in vs):
            continue
        sets = [{v.defense, *v.tied, *v.edge} for v in vs]
        ok = all(v.defense in s for v in vs for s in sets)  # each pick is within every run's tie set
        common = bool(set.intersection(*sets))  # one setting named or tied (in budget or at its edge) by every run
        total += 1
        agree += ok
        consistent += common
        old = [n[key[2]].get((key[0], key[1]), "–") for n in naive]
        rows_out.append([key[0], key[1], "any" if math.isinf(key[2]) else f"{key[2]:g}",
                         *(f"{v.status}: {v.defense}" + (f" (~{', '.join(v.tied)})" if v.tied else "")
                           + (f" (edge: {', '.join(v.edge)})" if v.edge else "") + f" n={v.n}" for v in vs),
                         "agree" if ok else "tie" if common else "DIFFER", " / ".join(old),
                         "same" if len(set(old)) == 1 else "differs"])
    table("Verdicts on three disjoint seed sets (demo eavesdropper part)",
          ["threat", "B", "budget", "seeds 0,1", "seeds 2,3", "seeds 4,5", "verdicts", "old rule's picks",
           "old rule"], rows_out,
          note=f"{agree} of {total} verdicts agree (each run's pick is named or tied by every run); {consistent} of "
               f"{total} are consistent (one setting is named, tied or at the budget's edge in every run: the runs "
               f"that differ report the tie); each run took "
               f"{', '.join(f'{t:.0f} s' for t in times)} with 2 workers.")
