"""Models from files, read as data: state dicts for a spec, leakbench model files, refusals with the fix."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from typer.testing import CliRunner

import leakbench as lb
from leakbench.cli import app
from leakbench.errors import ConfigError
from leakbench.evaluation.running.run import run_trial
from leakbench.models.files import load_model, load_weights, save_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An MLP on digits after a few SGD steps (weights unlike a fresh build's), saved as a state dict."""
    data = lb.load("digits", size=8)
    model = lb.build("mlp:16", input_shape=data.shape, classes=10, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = data.batch(64, seed=1)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    root = tmp_path_factory.mktemp("files")
    torch.save(model.state_dict(), root / "weights.pt")
    return model, root


def test_state_dict_and_model_file_round_trip(trained):
    model, root = trained
    fresh = lb.build("mlp:16", input_shape=(1, 8, 8), classes=10, seed=0)
    load_weights(fresh, root / "weights.pt")
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    save_model(model, root / "model.pt")
    again = load_model(root / "model.pt")
    assert again.spec == "mlp:16" and all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_bad_files_are_refused_with_the_fix(trained, tmp_path):
    model, root = trained
    wrong = lb.build("mlp:32", input_shape=(1, 8, 8), classes=10, seed=0)
    with pytest.raises(ConfigError, match=r"do not fit model 'mlp:32'.*file \(16, 64\) vs model \(32, 64\)"):
        load_weights(wrong, root / "weights.pt")
    torch.jit.script(copy.deepcopy(model)).save(str(tmp_path / "scripted.pt"))
    with pytest.raises(ConfigError, match="TorchScript"):
        load_weights(wrong, tmp_path / "scripted.pt")

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(tmp_path / "pwned"),))

    torch.save({"w": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(ConfigError, match="tensors only"):
        load_weights(wrong, tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()  # refused unrun
    with pytest.raises(ConfigError, match="no model file"):
        load_weights(wrong, tmp_path / "missing.pt")
    with pytest.raises(ConfigError, match="bare state dict"):
        load_model(root / "weights.pt")


def test_cli_and_sweep_trial_give_identical_metrics_on_a_model_file(trained, tmp_path, monkeypatch):
    """`leakbench attack --model-file` runs the sweep's trial core: same inputs, same metrics."""
    _, root = trained
    monkeypatch.chdir(tmp_path)
    weights = str(root / "weights.pt")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["attack", "--data", "digits", "--data-option", "size=8", "--model", "mlp:16",
                                      "--model-file", weights, "--attack", "inverting-gradients", "--preset", "quick",
                                      "--option", "iterations=30", "--batch-size", "2", "--seed", "4", "--quiet",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    cli = json.loads((out / "metrics.json").read_text())
    spec = lb.evaluation.load_spec({
        "name": "one", "datasets": [{"name": "digits", "options": {"size": 8}}],
        "models": [{"spec": "mlp:16", "file": weights}], "batch_sizes": [2], "seeds": [4], "images": 2,
        "attacks": [{"name": "inverting-gradients", "preset": "quick", "options": {"iterations": 30}}],
        "defenses": ["none"]})
    (trial,) = [t for t in lb.evaluation.plan(spec) if t.kind == "attack"]
    swept = run_trial(trial)
    assert swept.status == "done"
    for key in ("mse", "psnr", "ssim", "label_acc", "chance_rmse"):
        assert cli[key] == pytest.approx(swept.metrics[key], rel=1e-6, abs=1e-9), key
    # the file's weights were used: a fresh build's gradient differs, so does its reconstruction
    fresh = lb.evaluation.load_spec({**spec.model_dump(mode="json"), "models": [{"spec": "mlp:16"}]})
    (other,) = [t for t in lb.evaluation.plan(fresh) if t.kind == "attack"]
    assert run_trial(other).metrics["mse"] != pytest.approx(swept.metrics["mse"], rel=1e-3)
    assert trial.model_options["file_digest"] and "[weights.pt]" in trial.model_key


def test_cli_names_the_flag_for_a_bad_model_file(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    result = CliRunner().invoke(app, ["attack", "--data", "digits", "--model", "mlp:16", "--model-file",
                                      str(tmp_path / "junk.pt"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--model-file" in result.output and "Traceback" not in result.output
