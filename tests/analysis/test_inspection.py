"""lb.inspect: the client's check flags the library's malicious models with evidence and passes honest ones."""
from __future__ import annotations

import copy

import pytest
import torch

import leakbench as lb
from leakbench.analysis.inspection import CHECKS, honest_draw, inspect
from leakbench.errors import ConfigError
from leakbench.models.active import fishing, trap_weights
from leakbench.models.malicious import imprint, random_head


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")


@pytest.fixture(scope="module")
def batch(digits):
    return digits.images[:64], digits.labels[:64]


def _public(digits):
    return digits.images[-256:]


def test_it_is_the_public_api(digits, batch):
    model = lb.build("mlp:32", input_shape=digits.shape, classes=10, seed=0)
    report = lb.inspect(None, model, x=batch[0], y=batch[1])
    assert lb.inspect is inspect and "inspect" in lb.__all__
    assert not report.suspicious and report.reason.startswith("no check fired")
    assert str(report).startswith("passed") and set(CHECKS) <= set(report.statistics)
    assert "architecture" in report.skipped and "weight-change" in report.skipped  # nothing held before


@pytest.mark.parametrize("spec", ["mlp:64", "mlp:1000", "mlp:256-128", "cnn:3-8-1-1", "lenet", "twolayer:100"])
def test_honest_initialisations_pass(digits, batch, spec):
    for init in ("default", "gaussian"):
        model = lb.build(spec, input_shape=digits.shape, classes=10, seed=1, act="relu", init=init)
        report = inspect(None, model, x=batch[0], y=batch[1])
        assert not report.suspicious, report.reason


def test_honest_training_passes_round_after_round(digits, batch):
    """Epochs of SGD at lr 0.1 (large steps on a wide layer): each checkpoint against the one before."""
    model = lb.build("mlp:1000", input_shape=digits.shape, classes=10, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = digits.images[256:1536], digits.labels[256:1536]
    for _ in range(3):
        before = copy.deepcopy(model)
        for s in range(0, len(x), 32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[s:s + 32]), y[s:s + 32]).backward()
            opt.step()
        report = inspect(before, model, x=batch[0], y=batch[1])
        assert not report.suspicious, report.reason
        assert report.statistics["weight-change"] > 0.2


def test_trap_weights_are_flagged_with_the_evidence(digits, batch):
    model = lb.build("mlp:256", input_shape=digits.shape, classes=10, seed=0)
    shipped = trap_weights(model, rate=1 / 64, calibration=_public(digits), seed=0)
    first = inspect(None, shipped, x=batch[0], y=batch[1])
    assert first.checks == ["sign-balance", "isolation"]
    balance = next(f for f in first.findings if f.check == "sign-balance")
    assert balance.where == "fc1.weight" and "256 of 256 rows have exactly 32 of 64" in balance.evidence
    later = inspect(model, shipped)  # no data: the replaced layer and its signs
    assert set(later.checks) == {"weight-change", "sign-balance"} and "isolation" in later.skipped
    assert later.statistics["weight-change"] < 0.2


def test_blocks_heads_and_fishing_are_flagged(digits, batch):
    cnn = lb.build("cnn:3-8-1-1", input_shape=digits.shape, classes=10, seed=0)
    mlp = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0)
    expected = {
        "trap block": (cnn, trap_weights(cnn, neurons=300, calibration=_public(digits)),
                       {"architecture", "duplicated-rows", "constant-rows", "sign-balance"}),
        "imprint": (mlp, imprint(mlp, bins=32, calibration=_public(digits)),
                    {"architecture", "duplicated-rows", "constant-rows"}),
        "random head": (cnn, random_head(cnn, width=300), {"architecture", "duplicated-rows", "constant-rows"}),
        "fishing": (mlp, fishing(mlp, target=2, calibration=_public(digits)), {"zero-rows"}),
        "feature fishing": (cnn, fishing(cnn, target=2, quantile=0.25,
                                         calibration=(digits.images[:400], digits.labels[:400])), {"zero-rows"}),
    }
    for name, (before, shipped, checks) in expected.items():
        report = inspect(before, shipped, x=batch[0], y=batch[1])
        assert checks <= set(report.checks), (name, report.reason)
        assert report.suspicious and report.reason
        alone = inspect(None, shipped)  # the first round, no data: the weights alone still tell
        assert alone.suspicious, name


def test_scaled_rows_and_a_rescaled_layer(digits):
    model = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0)
    magnified = copy.deepcopy(model)
    with torch.no_grad():
        magnified.fc.weight[4] *= 1000           # one row magnified (fishing's multiplier on the target row)
    report = inspect(model, magnified)
    assert "scaled-rows" in report.checks and any("fc.weight" in f.where for f in report.findings)
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        scaled.fc1.weight *= 20
    assert "weight-change" in inspect(model, scaled).checks


def test_isolation_is_relative_to_an_honest_model_of_the_architecture(digits, batch):
    """A wide honest layer isolates a quarter of the batch on its own: not a finding; trap rows far more."""
    model = lb.build("mlp:1000", input_shape=digits.shape, classes=10, seed=5)
    honest = inspect(None, model, x=batch[0], y=batch[1])
    assert honest.statistics["isolation"] > 0.25 and not honest.suspicious
    fresh = honest_draw(model)
    assert not torch.equal(fresh.fc1.weight, model.fc1.weight)
    assert torch.equal(honest_draw(model).fc1.weight, fresh.fc1.weight)  # seeded


def test_bad_arguments(digits, batch):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    with pytest.raises(ConfigError, match="model_received"):
        inspect(None, "not a model")
    with pytest.raises(ConfigError, match="x, y"):
        inspect(None, model, x=batch[0])
    report = inspect(None, model, x=torch.zeros(2, 3, 5, 5), y=torch.zeros(2, dtype=torch.long))
    assert "isolation" in report.skipped and not report.suspicious
