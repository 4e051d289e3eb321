"""train_target: reproducible training, save/load, schedules and refusals (kkt_residual: tests/analysis/test_stationarity.py)."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.analysis.stationarity import kkt_residual
from leakbench.errors import ConfigError
from leakbench.models.targets import (TrainedTarget,
                                      train_target)


pytestmark = pytest.mark.usefixtures("one_thread")



def test_training_is_reproducible_and_fits(sphere):
    a = train_target(sphere, model="mlp:30-30", lr=0.5, steps=300, seed=3)
    b = train_target(sphere, model="mlp:30-30", lr=0.5, steps=300, seed=3)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert a.history[-1][1] < a.history[0][1] / 10
    assert a.x.dtype == torch.float64 and a.y.dtype == torch.float64
    assert set(a.y.tolist()) <= {-1.0, 1.0}
    # homogeneous: only the first layer keeps a bias
    assert a.model.fc1.bias is not None and a.model.fc2.bias is None and a.model.fc.bias is None


def test_training_stops_at_loss_tolerance(sphere):
    t = train_target(sphere, model="twolayer:50", lr=0.5, steps=100_000, loss_tol=1e-2, init="small")
    assert t.final_loss < 1e-2 and t.history[-1][0] < 100_000
    assert bool((t.margins() > 0).all())


def test_save_load_round_trip(tmp_path, sphere):
    t = train_target(sphere, model="mlp:16", lr=0.5, steps=50, per_class=None, center=True)
    path = t.save(tmp_path / "target.pt")
    u = TrainedTarget.load(path)
    assert torch.equal(u.x, t.x) and torch.equal(u.y, t.y) and torch.equal(u.mean, t.mean)
    assert u.config == t.config and u.history == t.history
    assert torch.equal(u.outputs(), t.outputs())
    with pytest.raises(ConfigError, match="does not exist"):
        TrainedTarget.load(tmp_path / "missing.pt")


def test_binary_dataset_per_class_and_centering():
    digits = lb.load("digits", binary="odd-even")
    t = train_target(digits, per_class=5, model="mlp:20", steps=5, data_seed=1)
    assert t.x.shape == (10, 1, 8, 8)
    assert sorted(t.y.tolist()) == [-1.0] * 5 + [1.0] * 5
    assert torch.allclose(t.inputs.mean(0), torch.zeros(1, 8, 8, dtype=torch.float64), atol=1e-12)
    lo, hi = t.input_range
    assert lo <= float(t.inputs.min()) and float(t.inputs.max()) <= hi


def test_bad_input_is_named():
    digits = lb.load("digits")
    with pytest.raises(ConfigError, match="binary"):
        train_target(digits, per_class=2, steps=1)  # 10 classes with the logistic loss
    with pytest.raises(ConfigError, match="unknown option 'width'"):
        train_target(digits, width=3)
    with pytest.raises(ConfigError, match="field loss"):
        train_target(digits, loss="mse")
    with pytest.raises(ConfigError, match="per_class"):
        train_target(lb.load("digits", binary="odd-even"), per_class=10_000)
    with pytest.raises(ConfigError, match="labels"):
        train_target(torch.zeros(4, 3), None)


def test_adaptive_schedule_reaches_the_margin_far_out_and_checks_options(sphere):
    t = train_target(sphere, model="twolayer:200", loss="logistic", lr=0.5, steps=600, loss_tol=0,
                     schedule="adaptive", center=False, init="small")
    logs = [h[1] for h in t.history]
    assert t.history[-1][0] == 600 and min(logs) == logs[-1]  # accepted steps only: the loss never goes up
    r = kkt_residual(t.model, t.inputs, t.y)
    # measured: 11/12 samples within 10 % of the smallest margin (3 000 constant steps of lr 0.5: 5/12)
    assert int(r.on_margin.sum()) >= 10 and float(t.margins().min()) > 100
    with pytest.raises(ConfigError, match="field schedule"):
        train_target(sphere, schedule="normalized", steps=1)


def test_adaptive_training_stops_gracefully_at_float_precision(tmp_path):
    # d = 100: the margins grow to ≈ 6·10²² (log L ≈ −6·10²²) within ~1 000 steps, where no step the weights can
    # resolve decreases the loss any more; this used to raise "training stalled" (a float64 limit, not a bug)
    data = lb.load("sphere", n=10, d=100, rule="random", seed=1)
    t = train_target(data, model="twolayer:200", loss="logistic", lr=0.5, steps=2000, loss_tol=0,
                     schedule="adaptive", center=False, init="small")
    assert t.stop_reason == "precision" and t.history[-1][0] < 2000
    assert float(t.margins().min()) > 1e20
    logs = [h[1] for h in t.history]
    assert min(logs) == logs[-1]
    assert TrainedTarget.load(t.save(tmp_path / "t.pt")).stop_reason == "precision"
    short = train_target(data, model="twolayer:200", loss="logistic", lr=0.5, steps=50, loss_tol=0,
                         schedule="adaptive", center=False, init="small")
    assert short.stop_reason == "steps"
    done = train_target(data, model="twolayer:50", loss="logistic", lr=0.5, steps=10_000, loss_tol=1e-2,
                        center=False, init="small")
    assert done.stop_reason == "loss_tol"


class _Payload:
    """Unpickling this calls os.mkdir(marker): what a crafted target file could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.mkdir, (self.marker,))


def test_load_refuses_a_pickle_payload_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": "leakbench-target-1", "config": {}, "x": _Payload(marker)}, path)
    with pytest.raises(ConfigError, match="weights_only=True.*data only"):
        TrainedTarget.load(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the control: the payload is live when unpickled as code
    assert marker.is_dir()


@pytest.mark.parametrize("content", [b"", b"not a torch file", b"PK\x03\x04truncated"])
def test_load_refuses_a_corrupt_file_in_one_line(tmp_path, content):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="bad.pt") as err:
        TrainedTarget.load(path)
    assert "\n" not in str(err.value)


def test_load_refuses_a_wrong_schema(tmp_path):
    path = tmp_path / "partial.pt"
    torch.save({"format": "leakbench-target-1", "config": {"model": "mlp:4", "colour": 3}}, path)
    with pytest.raises(ConfigError, match="not a complete leakbench target"):
        TrainedTarget.load(path)
