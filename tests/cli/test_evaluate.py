"""``leakbench evaluate``, ``leakbench report`` and ``leakbench demo`` from the command line."""
from __future__ import annotations

import sqlite3

import yaml
from typer.testing import CliRunner

from leakbench.cli import app

runner = CliRunner()
SPEC = {
    "name": "cli-test",
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "mlp:20", "act": "relu"}],
    "batch_sizes": [1, 2],
    "images": 2,
    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 4}, "label": "ig"},
                {"name": "fc-inversion", "preset": "quick"}],
    "defenses": ["none", {"prune": [0.5]}],
}
N_TRIALS = 2 * 3 * 2


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_evaluate_resume_and_report(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC, sort_keys=False))
    db = tmp_path / "results.db"
    dry = invoke("evaluate", spec, "--db", db, "--dry-run")
    assert dry.exit_code == 0 and f"{N_TRIALS} trial(s)" in dry.output and not db.exists()
    first = invoke("evaluate", spec, "--db", db, "--max-trials", "5")
    assert first.exit_code == 0, first.output
    assert "5 trial(s) run" in first.output and "stopped: max_trials" in first.output
    second = invoke("evaluate", spec, "--db", db, "--report", tmp_path / "rep")
    assert second.exit_code == 0, second.output
    assert f"{N_TRIALS - 5} trial(s) run" in second.output and "5 already finished" in second.output
    assert "Strongest attack S_D" in second.output and "fc-inversion" in second.output
    assert (tmp_path / "rep" / "index.html").is_file()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*), max(attempts) FROM trials WHERE status = 'done'").fetchone() == (N_TRIALS, 1)
    rep = invoke("report", db, "--out", tmp_path / "rep2")
    assert rep.exit_code == 0 and "index.html" in rep.output
    assert (tmp_path / "rep2" / "results.csv").read_text().count("\n") == N_TRIALS + 1


def test_bad_spec_is_one_line_with_the_line_number(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**SPEC, "attacks": ["dlg", "inverting-gradient"]}, sort_keys=False))
    line = next(i for i, text in enumerate(spec.read_text().splitlines(), 1) if "inverting-gradient" in text)
    one_line_error(invoke("evaluate", spec, "--db", tmp_path / "r.db"),
                   f"spec.yaml line {line}", "attacks[1].name", "Did you mean 'inverting-gradients'")
    assert not (tmp_path / "r.db").exists()


def test_bad_options(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    one_line_error(invoke("evaluate", spec, "--workers", "0"), "--workers")
    one_line_error(invoke("evaluate", spec, "--workers", "2", "--ray", "auto"), "--ray")
    one_line_error(invoke("evaluate", spec, "--stack", "0"), "--stack")
    one_line_error(invoke("evaluate", tmp_path / "absent.yaml"), "no such file")
    one_line_error(invoke("report", tmp_path / "absent.db"), "no such file")


def test_demo_with_a_small_spec_writes_db_report_and_images(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**SPEC, "batch_sizes": [1], "defenses": ["none"]}))
    out = tmp_path / "demo"
    result = invoke("demo", "--out", out, "--spec", spec, "--workers", "1")
    assert result.exit_code == 0, result.output
    assert (out / "results.db").is_file() and (out / "report" / "index.html").is_file()
    assert len(list((out / "results-images").glob("*.npz"))) == 4
    assert "Strongest attack S_D" in result.output and str(out / "report" / "index.html") in result.output


def test_the_resume_line_keeps_the_stack():
    from leakbench.cli.evaluate import resume_command

    line = resume_command("s.yaml", "r.db", workers=1, ray=None, retry_failed=False, yes=False, report=None, stack=1)
    assert line.endswith("--stack 1")


def test_membership_audits_a_model_file_and_writes_the_report(tmp_path, monkeypatch):
    import torch

    import leakbench as lb

    monkeypatch.chdir(tmp_path)
    data = lb.load("digits")
    torch.save(lb.build("mlp:16", input_shape=data.shape, classes=10, act="relu", seed=3).state_dict(), "w.pt")
    args = ["membership", "--data", "digits", "--model", "mlp:16", "--act", "relu", "--model-file", "w.pt",
            "--epochs", "2", "--pool", "200", "--reference-models", "1", "--attack", "membership-loss",
            "--attack", "membership-rmia", "--defense", "none", "--defense", "dpsgd:1,1", "--out", "audit"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "membership · digits · mlp:16" in result.output and "n = 200 points" in result.output
    page = (tmp_path / "audit" / "report" / "index.html").read_text()
    assert "Reference-model attacks" in page and "DP-SGD audited" in page
    again = invoke(*args)  # resumed: the four trials are kept
    assert again.exit_code == 0 and "0 trial(s) run" in again.output
    bad = invoke("membership", "--data", "digits", "--pool", "50000", "--out", "x")
    assert bad.exit_code != 0 and "pool" in bad.output
