"""A target whose training diverged is no target: the trial fails "non-finite/diverged target" instead of
reporting a score ("no attack beats chance") for it."""
from __future__ import annotations

import math

import pytest
import torch

import leakbench as lb
from leakbench.evaluation import Sweep, load_spec
from leakbench.evaluation.membership.reference import divergence

pytestmark = pytest.mark.usefixtures("one_thread")

ENTRY = {"dataset": {"name": "digits"}, "model": {"spec": "mlp:8", "act": "relu"},
         "training": {"epochs": 2, "batch_size": 8, "lr": 50.0}, "pool": 40, "reference_models": 1,
         "defenses": ["none"], "attacks": ["membership-loss"]}
SPEC = {"name": "div", "datasets": [{"name": "digits", "options": {"size": 8}}], "models": ["mlp:8"],
        "batch_sizes": [1], "membership": [ENTRY]}


def test_a_diverged_membership_target_fails_its_trial(tmp_path):
    sweep = Sweep(load_spec(SPEC), tmp_path / "r.db")
    summary = sweep.run()
    rows = sweep.store.rows(kind="membership")
    assert [r["status"] for r in rows] == ["failed"] and not summary
    assert "non-finite/diverged target" in rows[0]["error"] and "2 × 2.303" in rows[0]["error"]
    sweep.store.close()


def test_divergence_reads_the_loss_against_predicting_nothing():
    data = lb.load("digits", size=8)
    model = lb.build("mlp:8", input_shape=data.shape, classes=10, act="relu", seed=0)
    x, y = data.images[:20], data.labels[:20]
    assert divergence(model, x, y, 2.0) is None  # below 2 × ln 10
    assert "above 2 × 2.303" in divergence(model, x, y, 27.0)
    assert "NaN/inf" in divergence(model, x, y, math.nan)
    with torch.no_grad():
        next(model.parameters()).fill_(math.inf)
    assert "NaN/inf" in divergence(model, x, y, 1.0)
    binary = torch.nn.Linear(64, 1)  # logistic loss on ±1 labels: predicting nothing costs ln 2
    signs = torch.ones(20)
    assert divergence(binary, x.reshape(20, -1), signs, 1.0, loss="logistic") is None
    assert "2 × 0.6931" in divergence(binary, x.reshape(20, -1), signs, 1.5, loss="logistic")
