"""The sweep's ETA weighted by measured trial costs, and the probes that measure every shape early."""
from __future__ import annotations

import dataclasses

from leakbench.evaluation import load_spec, plan
from leakbench.evaluation.running.eta import CostEstimate, cheapest_groups_first, probes_first, shape_of

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


def test_a_round_priced_by_earlier_trials_orders_whole_groups_cheapest_first():
    trials = plan(load_spec({**SPEC, "batch_sizes": [1, 2]}))
    before = CostEstimate(trials)
    for t in trials:  # dlg 10 s, fc-inversion 0.01 s, at either batch size
        before.done(t, 10.0 if t.attack == "dlg" else 0.01)
    est = CostEstimate(trials)
    assert est.seconds(trials[0]) == 0.0 and est.seconds_left() is None  # nothing measured yet
    est.learn_from(before)
    assert {est.seconds(t) for t in trials} == {10.0, 0.01}
    assert est.seconds_left() == sum(10.0 if t.attack == "dlg" else 0.01 for t in trials)
    # grouped by batch size: B = 2 holds half the batches of B = 1, so it is cheaper and comes first, whole
    by_size = cheapest_groups_first(trials, est, lambda t: t.batch_size)
    assert [t.batch_size for t in by_size] == sorted(t.batch_size for t in trials)[::-1]
    assert [t.key for t in by_size if t.batch_size == 1] == [t.key for t in trials if t.batch_size == 1]
    # grouped by attack: every fc-inversion trial first, each group in its own order
    by_attack = cheapest_groups_first(list(reversed(trials)), est, lambda t: t.attack)
    cheap = [t.key for t in reversed(trials) if t.attack == "fc-inversion"]
    assert [t.key for t in by_attack] == cheap + [t.key for t in reversed(trials) if t.attack == "dlg"]
    # an unmeasured shape is priced at its kind's dearest mean
    odd = dataclasses.replace(trials[0], attack="other")
    assert est.seconds(odd) == 10.0
