"""User code (``module:Class``) is imported only from installed packages, PYTHONPATH or a ``--code-path`` the
user names: never from the current directory; ``evaluate --dry-run`` lists the modules without importing them."""
from __future__ import annotations

import sys
import uuid

import pytest
import yaml
from typer.testing import CliRunner

from leakbench.cli import app
from leakbench.errors import ConfigError
from leakbench.evaluation import load_spec
from leakbench.models.custom import add_code_paths, deferred_imports, import_class

pytestmark = pytest.mark.usefixtures("one_thread")

NET = '''
import pathlib
pathlib.Path(__file__).with_suffix(".ran").write_text("imported")
import torch
class Net(torch.nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = torch.nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)
    def forward(self, x):
        return self.fc(x.reshape(len(x), -1))
'''


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A module lying in the current directory (as a received spec's .py file would), with '' on sys.path as
    ``python -m`` puts it; the fixture restores sys.path and PYTHONPATH."""
    name = f"planted_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(NET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    monkeypatch.setenv("PYTHONPATH", "")
    yield name, tmp_path / f"{name}.ran"
    sys.modules.pop(name, None)


def _spec(name):
    return {"name": "c", "datasets": [{"name": "digits", "options": {"size": 8}}], "models": [f"{name}:Net"],
            "batch_sizes": [1], "attacks": ["fc-inversion"]}


def test_the_current_directory_is_never_searched(planted):
    name, ran = planted
    with pytest.raises(ConfigError, match=f"no module '{name}'.*--code-path.*never searched"):
        import_class(f"{name}:Net")
    with pytest.raises(ConfigError, match=r"models\[0\]"):
        load_spec(_spec(name))
    assert not ran.exists()


def test_a_named_code_path_is_searched(planted, tmp_path):
    name, ran = planted
    assert add_code_paths([tmp_path]) == [str(tmp_path)]
    assert import_class(f"{name}:Net").__name__ == "Net" and ran.exists()
    with pytest.raises(ConfigError, match="--code-path"):
        add_code_paths([tmp_path / "missing"])


def test_deferred_imports_record_and_import_nothing(planted, tmp_path):
    name, ran = planted
    add_code_paths([tmp_path])
    with deferred_imports() as modules:
        load_spec(_spec(name))
    assert modules == {name: ["model spec"]} or list(modules) == [name]
    assert not ran.exists()


def test_dry_run_lists_the_modules_a_run_would_import_without_importing(planted, tmp_path):
    name, ran = planted
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_spec(name)))
    refused = CliRunner().invoke(app, ["evaluate", str(path), "--dry-run"])
    assert refused.exit_code == 2 and "never searched" in refused.output and not ran.exists()
    result = CliRunner().invoke(app, ["evaluate", str(path), "--dry-run", "--code-path", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "valid" in result.output and f"a run would import {name}" in result.output
    assert not ran.exists()
