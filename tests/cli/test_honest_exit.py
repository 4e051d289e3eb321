"""Exit status is never 0 when nothing was measured: every trial failed (``leakbench membership`` included), or
``budget.sweep_minutes`` ended the sweep before any trial ran; ``membership`` keeps ``--data-option``."""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from leakbench.cli import app
from leakbench.evaluation import SweepSummary

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()

SMALL = ["--pool", "40", "--reference-models", "1", "--epochs", "1", "--batch-size", "8", "--attack",
         "membership-loss", "--model", "mlp:8", "--act", "relu"]


def invoke(*args):
    return runner.invoke(app, list(args))


def test_membership_exits_1_when_every_trial_failed(tmp_path):
    # lr 50 diverges the target: its trial fails "non-finite/diverged target" and no verdict is printed
    result = invoke("membership", "--data", "digits", *SMALL, "--lr", "50", "--out", str(tmp_path / "a"))
    assert result.exit_code == 1, result.output
    assert "no trial succeeded" in result.output and "diverged" in result.output
    assert "no attack beats chance" not in result.output


def test_membership_keeps_the_data_options_of_a_file_dataset(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.integers(0, 256, (60, 8, 8), dtype=np.uint8), y=rng.integers(0, 3, 60))
    result = invoke("membership", "--data", "npz", "--data-option", f"path={tmp_path / 'd.npz'}", *SMALL,
                    "--lr", "0.1", "--out", str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert "1 trial(s) run" in result.output


def test_a_sweep_stopped_by_its_budget_before_any_trial_exits_1(tmp_path):
    spec = {"name": "b", "datasets": [{"name": "digits", "options": {"size": 8}}], "models": ["mlp:8"],
            "batch_sizes": [1], "attacks": ["fc-inversion"], "budget": {"sweep_minutes": 1e-9}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = invoke("evaluate", str(path), "--db", str(tmp_path / "r.db"), "--quiet")
    assert result.exit_code == 1, result.output
    assert "before any trial ran" in result.output and "no defense fits" not in result.output


def test_the_summary_is_false_when_nothing_was_measured(tmp_path):
    na = SweepSummary(db=tmp_path, planned=2, skipped=0, ran=2, counts={"n/a": 2})
    assert not na and "no trial succeeded (2 n/a)" in na.nothing
    cut = SweepSummary(db=tmp_path, planned=2, skipped=0, ran=0, counts={"pending": 2},
                       stopped="budget.sweep_minutes")
    assert not cut and "before any trial ran (2 trial(s) not run)" in cut.nothing
    ok = SweepSummary(db=tmp_path, planned=2, skipped=0, ran=2, counts={"done": 1, "n/a": 1})
    assert ok and ok.nothing is None
    asked = SweepSummary(db=tmp_path, planned=2, skipped=0, ran=0, counts={"pending": 2}, stopped="max_trials")
    assert asked.nothing is None  # --max-trials 0: the user asked to run nothing
