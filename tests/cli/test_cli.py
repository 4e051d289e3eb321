"""The ``leakbench`` command line: outputs, listings and one-line errors (tiny budgets, < 60 s in all)."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import leakbench as lb
from leakbench.attacks import ATTACKS
from leakbench.cli import REGISTRIES, app, attack_presets, parse_assignments
from leakbench.errors import ConfigError

runner = CliRunner()
TINY = ["--data", "digits", "--model", "cnn:3-4-2-1", "--option", "iterations=5"]


def invoke(*args: str):
    return runner.invoke(app, list(args))


def assert_one_line_error(result, *fragments: str) -> None:
    """Exit code 2, a single 'error: …' line naming ``fragments``, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0]


#: wall-clock seconds of the ``attack_run`` command (its own time must fit inside).
ATTACK_RUN_SECONDS: dict[str, float] = {}


@pytest.fixture(scope="module")
def attack_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    start = time.perf_counter()
    result = invoke("attack", *TINY, "--batch-size", "3", "--seed", "1", "--out", str(out))
    ATTACK_RUN_SECONDS["elapsed"] = time.perf_counter() - start
    assert result.exit_code == 0, result.output
    return out, result


def test_attack_writes_consistent_files(attack_run):
    out, result = attack_run
    assert {p.name for p in out.iterdir()} >= {"grid.png", "metrics.json", "reconstruction.npz"}
    arrays = np.load(out / "reconstruction.npz")
    x, y, rec = arrays["x"], arrays["y"], arrays["reconstruction"]
    assert x.shape == (3, 1, 8, 8) and y.shape == (3,) and rec.shape == x.shape
    assert arrays["labels"].shape == (3,)
    data = lb.load("digits")
    want_x, want_y = data.batch(3, seed=1)
    np.testing.assert_array_equal(x, want_x.numpy())
    np.testing.assert_array_equal(y, want_y.numpy())

    metrics = json.loads((out / "metrics.json").read_text())
    again = lb.compare(torch.from_numpy(rec), torch.from_numpy(x), torch.from_numpy(y))
    assert math.isclose(metrics["psnr"], again["psnr"], rel_tol=1e-9)
    assert math.isclose(metrics["mse"], again["mse"], rel_tol=1e-9)
    assert metrics["attack"] == "inverting-gradients"
    assert metrics["options"]["iterations"] == 5
    assert metrics["spec"]["model"] == "cnn:3-4-2-1" and metrics["spec"]["batch_size"] == 3
    assert 0 < metrics["seconds"] <= ATTACK_RUN_SECONDS["elapsed"]  # the attack's own time, within the command's
    for name in ("mse", "rmse", "psnr", "ssim", "label_acc", "seconds"):
        assert name in result.output


def test_attack_indices_data_options_and_quiet(tmp_path):
    result = invoke("attack", *TINY, "--indices", "4,7", "--data-option", "size=12", "--labels-known",
                    "--quiet", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tmp_path)
    arrays = np.load(tmp_path / "reconstruction.npz")
    data = lb.load("digits", size=12)
    np.testing.assert_array_equal(arrays["x"], data.images[[4, 7]].numpy())
    spec = json.loads((tmp_path / "metrics.json").read_text())["spec"]
    assert spec["data_options"] == {"size": 12} and spec["indices"] == [4, 7] and spec["labels_known"]


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_list_shows_every_registered_name(kind):
    result = invoke("list", kind)
    assert result.exit_code == 0, result.output
    for name in REGISTRIES[kind].names():
        assert name in result.output


def test_list_attacks_shows_presets():
    result = invoke("list", "attacks")
    for name in ATTACKS.names():
        for preset in attack_presets(name):
            assert preset in result.output


def test_list_attacks_shows_threat_tags():
    from leakbench.attacks import attack_tags

    result = invoke("list", "attacks")
    assert "needs" in result.output
    for tag in {t for name in ATTACKS.names() for t in attack_tags(name)}:
        assert tag.split("-")[0] in result.output, tag


def test_list_unknown_kind():
    assert_one_line_error(invoke("list", "gizmos"), "gizmos", *REGISTRIES)


@pytest.mark.parametrize("args, fragments", [
    (["--attack", "no-such-attack"], ["no-such-attack", *ATTACKS.names()]),
    (["--data", "no-such-data"], ["no-such-data", "digits", "photos"]),
    (["--model", "no-such-model:3"], ["no-such-model", "mlp", "cnn", "convnet"]),
    (["--option", "iterations"], ["KEY=VALUE", "--option"]),
    (["--data-option", "size"], ["KEY=VALUE", "--data-option"]),
    (["--option", "no_such_option=1"], ["no_such_option", "iterations"]),
    (["--option", "iterations=many"], ["iterations", "many"]),
    (["--option", "iterations=1000000000000"], ["--option iterations=", "at most"]),  # a loop no budget bounds
    (["--option", "iterations=1000000", "--option", "restarts=100000"], ["--option", "optimisation steps"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--batch-size", "-3"], ["--batch-size"]),
    (["--indices", "1,x"], ["--indices"]),
    (["--preset", "no-such-preset"], ["no-such-preset", "quick"]),
    (["--defense", "no-such-defense"], ["no-such-defense", "none"]),
    (["--device", "no-such-device"], ["--device"]),
])
def test_attack_bad_input_is_one_line(tmp_path, args, fragments):
    result = invoke("attack", *TINY, "--out", str(tmp_path / "out"), *args)
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "out").exists()


def test_parse_assignments():
    assert parse_assignments(["a=1", "b = x=y"], "--option") == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_assignments(["=1"], "--option")


def test_demo_runs_the_bundled_sweep_spec():
    """`leakbench demo` is a sweep (tests/cli/test_evaluate.py runs it on a small spec; make demo runs it all)."""
    from leakbench.cli.demo import demo_spec_path
    from leakbench.evaluation import load_spec

    spec = load_spec(demo_spec_path())
    assert spec.name == "demo" and spec.batch_sizes == [1, 4, 8, 64]


def test_demo_rejects_bad_workers(tmp_path):
    assert_one_line_error(invoke("demo", "--out", str(tmp_path), "--workers", "0"), "--workers")


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and lb.__version__ in result.output
