"""Your own model class (``module.path:ClassName``) in a sweep, through the CLI, to the report."""
from __future__ import annotations

import sqlite3
import textwrap

import pytest
import yaml
from typer.testing import CliRunner

from leakbench.cli import app
from leakbench.evaluation.sweep_spec.model import load_spec
from leakbench.models.custom import class_digest

runner = CliRunner()

NET = textwrap.dedent('''
    import math
    import torch
    from torch import nn

    class TinyNet(nn.Module):
        def __init__(self, input_shape, num_classes, width=8):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(),
                                      nn.Linear(width, num_classes))

        def forward(self, x):
            return self.body(x)

    class Broken(nn.Module):
        def __init__(self, depth):
            super().__init__()
            raise ValueError("depth must be even")

    class NotAModule:
        pass
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``usernets_<id>`` written under tmp_path and put on sys.path."""
    name = f"usernets_{tmp_path.name.replace('-', '_')}"
    path = tmp_path / f"{name}.py"
    path.write_text(NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, path


def _spec(name: str, **model) -> dict:
    return {"name": "own", "datasets": [{"name": "digits", "options": {"limit": 64}}],
            "models": [{"spec": f"{name}:TinyNet", "options": {"width": 6},
                        "normalize": {"mean": [0.5], "std": [0.25]}, **model}],
            "batch_sizes": [1], "images": 1,
            "attacks": [{"name": "inverting-gradients", "options": {"iterations": 2}, "label": "ig"}]}


def test_own_class_sweep_through_cli_to_report(tmp_path, user_module):
    name, _ = user_module
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(_spec(name), sort_keys=False))
    db, rep = tmp_path / "results.db", tmp_path / "rep"
    result = runner.invoke(app, ["evaluate", str(spec), "--db", str(db), "--report", str(rep)])
    assert result.exit_code == 0, result.output
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*) FROM trials WHERE status = 'done'").fetchone()[0] >= 1
    index = rep / "index.html"
    assert index.is_file() and f"{name}:TinyNet" in index.read_text()


def test_digest_keys_trials_on_the_class_source(tmp_path, user_module):
    name, path = user_module
    before = load_spec(_spec(name)).models[0].build_options()
    assert before["source_digest"] == class_digest(f"{name}:TinyNet")
    assert before["normalize"] == [[0.5], [0.25]] and before["options"] == {"width": 6}
    path.write_text(NET.replace("nn.ReLU()", "nn.Tanh()"))
    after = load_spec(_spec(name)).models[0].build_options()
    assert after["source_digest"] != before["source_digest"]


@pytest.mark.parametrize("model, fragments", [
    ({"spec": "no_such_module_xyz:Net"}, ["models[0].spec", "no module 'no_such_module_xyz'", "PYTHONPATH"]),
    ({"spec": "{mod}:Missing"}, ["models[0].spec", "has no 'Missing'", "TinyNet"]),
    ({"spec": "{mod}:NotAModule"}, ["models[0].spec", "torch.nn.Module subclass"]),
])
def test_bad_class_is_one_line_naming_the_field(tmp_path, user_module, model, fragments):
    name, _ = user_module
    spec = tmp_path / "spec.yaml"
    data = _spec(name)
    data["models"] = [{"spec": model["spec"].format(mod=name)}]
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    result = runner.invoke(app, ["evaluate", str(spec), "--db", str(tmp_path / "r.db")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_failing_constructor_is_one_line(tmp_path, user_module):
    name, _ = user_module
    spec = tmp_path / "spec.yaml"
    data = _spec(name)
    data["models"] = [{"spec": f"{name}:Broken", "options": {"depth": 3}}]
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    result = runner.invoke(app, ["evaluate", str(spec), "--db", str(tmp_path / "r.db")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "models[0]" in lines[0] and "depth must be even" in lines[0] \
        and "options" in lines[0], result.output


def test_attack_cli_takes_own_class(tmp_path, user_module):
    name, _ = user_module
    result = runner.invoke(app, ["attack", "--data", "digits", "--data-option", "limit=16", "--model",
                                 f"{name}:TinyNet", "--model-option", "width=5", "--normalize", "0.5/0.25",
                                 "--attack", "inverting-gradients", "--option", "iterations=2", "--quiet",
                                 "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_unlabelled_folder_with_own_class(tmp_path, user_module):
    from PIL import Image
    import numpy as np

    name, _ = user_module
    (tmp_path / "imgs").mkdir()
    for i in range(3):
        Image.fromarray(np.full((6, 6), 60 * i, dtype=np.uint8)).save(tmp_path / "imgs" / f"img{i}.png")
    data = _spec(name)
    data["datasets"] = [{"name": "folder", "options": {"root": str(tmp_path / "imgs")}}]
    data["models"][0]["options"] = {"num_classes": 4}  # the model's own outputs; the folder's labels are unknown
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    result = runner.invoke(app, ["evaluate", str(spec), "--db", str(tmp_path / "r.db")])
    assert result.exit_code == 0, result.output
    from leakbench.evaluation import Store

    done = [r for r in Store(tmp_path / "r.db").rows(kind="attack") if r["status"] == "done"]
    assert done and all(r["label_acc"] is None for r in done), "unknown labels score no label accuracy"
    data["threat"] = {"labels_known": True}
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    refused = runner.invoke(app, ["evaluate", str(spec), "--db", str(tmp_path / "r2.db")])
    assert refused.exit_code == 2 and "labels are unknown" in refused.output, refused.output
