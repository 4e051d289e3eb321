"""The sweep's ETA weighted by measured trial costs, and the probes that measure every shape early."""
from __future__ import annotations

import dataclasses

from leakbench.evaluation import load_spec, plan
from leakbench.evaluation.running.eta import CostEstimate, probes_first, shape_of

SPEC = {
    "name": "eta",
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "mlp:8", "act": "relu"}],
    "batch_sizes": [1],
    "images": 4,
    "attacks": [{"name": "fc-inversion"}, {"name": "dlg", "options": {"iterations": 5}}],
}


def test_the_estimate_weighs_each_remaining_trial_by_its_shapes_cost():
    trials = plan(load_spec(SPEC))
    cheap = [t for t in trials if t.attack == "fc-inversion"]
    dear = [t for t in trials if t.attack == "dlg"]
    est = CostEstimate(trials, workers=2)
    assert est.seconds_left() is None
    for t in cheap[:3]:
        est.done(t, 0.01)
    assert est.seconds_left() == (1 * 0.01 + 4 * 0.01) / 2  # an unmeasured shape: its kind's dearest mean
    est.done(dear[0], 10.0)
    assert est.seconds_left() == (1 * 0.01 + 3 * 10.0) / 2  # a count-based ETA would say ≈ 4 × 2.5 / 2
    est.done(dear[1], float("nan"))  # finished, not a cost
    assert est.seconds_left() == (0.01 + 2 * 10.0) / 2


def test_one_trial_of_every_shape_runs_first_and_nothing_is_lost():
    trials = plan(load_spec(SPEC))
    ordered = probes_first(trials)
    assert sorted(t.key for t in ordered) == sorted(t.key for t in trials)
    shapes = [shape_of(t) for t in ordered]
    assert len(set(shapes[:2])) == 2 and set(shapes[:2]) == set(shapes)
    assert shape_of(dataclasses.replace(trials[0], seed=7, batch=3)) == shape_of(trials[0])
