"""Time budgets for loops a user value sizes (leakbench.budget): training stops at the budget, as a timed-out
trial; a sweep's end puts the trial it cut back to pending."""
from __future__ import annotations

import time

import pytest
import torch

import leakbench as lb
from leakbench.budget import check_time, seconds_left, time_limit
from leakbench.errors import BudgetExceeded
from leakbench.evaluation import Store, Sweep, load_spec, plan
from leakbench.evaluation.running.run import run_trial
from leakbench.evaluation.training.utility import train_model
from leakbench.models.targets import train_target

DATA = lb.load("digits")
SPEC = {
    "name": "budget",
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "mlp:8", "act": "relu"}],
    "batch_sizes": [1],
    "attacks": [{"name": "fc-inversion"}],
}


def test_limits_nest_the_earliest_wins_and_none_means_none():
    check_time()  # no limit: never raises
    assert seconds_left() == float("inf")
    with time_limit(None):
        check_time()
    with time_limit(60, "outer"):
        with time_limit(0.0, "inner"):
            time.sleep(0.01)
            with pytest.raises(BudgetExceeded, match="ran past inner"):
                check_time("step 3")
        check_time()  # the inner limit is gone
        with time_limit(3600, "later"):  # a later inner deadline leaves the outer one in force
            assert seconds_left() <= 60
    with time_limit(until=time.time() - 1, what="budget.sweep_minutes"), pytest.raises(BudgetExceeded,
                                                                                         match="sweep_minutes"):
        check_time()


def test_training_stops_at_the_budget():
    model = lb.build("mlp:8", input_shape=DATA.shape, classes=10)
    start = time.perf_counter()
    with time_limit(0.2, "the test's budget"), pytest.raises(BudgetExceeded, match="training .* steps"):
        train_model(model, DATA, epochs=10**5, batch_size=1, lr=0.01)
    x = torch.rand(8, 1, 4, 4)
    with time_limit(0.2, "the test's budget"), pytest.raises(BudgetExceeded, match="training the target"):
        train_target(x, torch.tensor([0, 1] * 4), model="twolayer:16", steps=10**7, loss_tol=0)
    assert time.perf_counter() - start < 10


def test_a_utility_trial_is_timed_out_by_trial_seconds():
    spec = {**SPEC, "utility": {"epochs": 10**5, "batch_size": 1, "seeds": [0]}, "budget": {"trial_seconds": 0.3}}
    trial = next(t for t in plan(load_spec(spec)) if t.kind == "utility")
    start = time.perf_counter()
    result = run_trial(trial)
    assert result.status == "timed out" and "budget.trial_seconds" in result.error
    assert time.perf_counter() - start < 10


def test_the_sweeps_end_stops_training_and_leaves_the_trial_pending(tmp_path):
    # the attacked model trains for 10⁵ epochs (no per-trial budget covers that training): the sweep's end does
    spec = {**SPEC, "models": [{"spec": "mlp:8", "act": "relu", "training": {"epochs": 10**5, "lr": 0.01}}],
            "budget": {"sweep_minutes": 0.01}}
    start = time.perf_counter()
    summary = Sweep(spec, tmp_path / "r.db", check=False).run()
    assert time.perf_counter() - start < 20
    assert summary.stopped == "budget.sweep_minutes"
    assert set(Store(tmp_path / "r.db").status().values()) == {"pending"}, "cut by the sweep, not the trial's fault"
