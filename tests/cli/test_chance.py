"""``leakbench attack`` shows the chance level beside the score and says when a result is no better."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from leakbench.cli import app

runner = CliRunner()


def test_weak_attack_prints_chance_and_what_would_make_it_stronger(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["attack", "--data", "digits", "--data-option", "limit=32", "--model", "mlp:16",
                                 "--attack", "inverting-gradients", "--option", "iterations=1", "--out", str(out)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rmse"] >= metrics["chance_rmse"]  # one step from a random start: no better than grey
    text = " ".join(result.output.split())
    assert "chance" in result.output and f"{metrics['chance_rmse']:.4f}" in result.output
    assert "At or below chance" in text and "not that the data is safe" in text
    for fix in ("--preset", "--labels-known", "bn_stats", "train=True", "malicious-server"):
        assert fix in text, fix
