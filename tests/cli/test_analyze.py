"""``leakbench analyze security|exclusivity``: tables, --json and one-line errors."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from leakbench.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_security_table_and_json():
    result = invoke("analyze", "security", "--model", "cnn:4-6-2-0,3-3-2-0", "--input-shape", "3,32,32")
    assert result.exit_code == 0, result.output
    assert "-1470" in result.output and "-1050" in result.output and "-1995" in result.output
    result = invoke("analyze", "security", "--model", "cnn:4-6-2-0", "--input-shape", "3,32,32", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["metric_rounded"] == -1470 and report["layers"][0]["rank_deficiency"] == -1470


def test_exclusivity_table_and_json():
    args = ["analyze", "exclusivity", "--model", "mlp:500", "--data", "digits", "--batch-size", "4"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "ExANs layer 1" in result.output and "reconstructable regime" in result.output
    result = invoke(*args, "--json")
    report = json.loads(result.output)
    assert report["batch_size"] == 4 and len(report["exans"]) == 4 and report["widths"] == [64, 500]


def test_errors_are_one_line():
    for args, fragment in (
        (["analyze", "security", "--model", "cnn:3-6-1-0", "--input-shape", "3,a,32"], "--input-shape"),
        (["analyze", "security", "--model", "cnn:3-6", "--input-shape", "3,32,32"], "kernel-channels-stride-padding"),
        (["analyze", "exclusivity", "--model", "cnn:3-4-1-0", "--data", "digits"], "ReLU MLP"),
        (["analyze", "exclusivity", "--model", "mlp:20", "--batch-size", "0"], "--batch-size"),
    ):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.output
