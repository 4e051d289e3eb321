"""Every sweep spec under examples/ is valid as shipped (a dry run: parsed, names resolved, trials counted)."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from leakbench.cli import app

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("spec", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_spec_is_valid(spec: Path):
    result = CliRunner().invoke(app, ["evaluate", str(spec), "--dry-run", "--code-path", str(EXAMPLES)])
    assert result.exit_code == 0, result.output
    assert "valid;" in " ".join(result.output.split())
