"""``--dry-run`` says "valid" only when the run would accept the store it names: another sweep's store is refused
in one line, as the run itself refuses it (issue 48)."""
from __future__ import annotations

import yaml
from typer.testing import CliRunner

from leakbench.cli import app
from leakbench.evaluation import Store, plan, load_spec

runner = CliRunner()
SPEC = {"name": "a", "datasets": [{"name": "digits", "options": {"limit": 60}}], "models": ["mlp:8"],
        "batch_sizes": [1], "images": 1, "attacks": [{"name": "dlg", "options": {"iterations": 2}}]}


def test_dry_run_refuses_another_sweeps_store_and_accepts_its_own(tmp_path):
    mine, other = tmp_path / "a.yaml", tmp_path / "b.yaml"
    mine.write_text(yaml.safe_dump(SPEC))
    other.write_text(yaml.safe_dump({**SPEC, "name": "b", "batch_sizes": [2], "images": 2}))
    db = tmp_path / "r.db"
    with Store(db) as store:  # the store of sweep a, bound as a run binds it
        store.bind(t.key for t in plan(load_spec(mine)))
    result = runner.invoke(app, ["evaluate", str(other), "--db", str(db), "--dry-run"])
    assert result.exit_code == 2 and "another sweep" in result.output and "--force" in result.output
    assert "valid" not in result.output and "Traceback" not in result.output
    assert runner.invoke(app, ["evaluate", str(other), "--db", str(db), "--dry-run", "--force"]).exit_code == 0
    ok = runner.invoke(app, ["evaluate", str(mine), "--db", str(db), "--dry-run"])
    assert ok.exit_code == 0 and "valid" in ok.output
    fresh = runner.invoke(app, ["evaluate", str(other), "--db", str(tmp_path / "new.db"), "--dry-run"])
    assert fresh.exit_code == 0 and not (tmp_path / "new.db").exists()  # a dry run writes nothing
