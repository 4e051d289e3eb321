"""Class fishing (Wen et al. 2022): only the target class reaches the body; its samples are read exactly."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError, UnsupportedThreatModel
from leakbench.models.active import fishing


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")


def test_the_head_keeps_the_target_row_and_silences_the_others(digits):
    model = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0)
    shipped = fishing(model, target=3, calibration=digits.images[-256:])
    w, b = shipped.fc.weight.detach(), shipped.fc.bias.detach()
    assert torch.equal(w[3], model.fc.weight[3].detach()) and float(b[3]) == float(model.fc.bias[3].detach())
    assert bool((w[torch.arange(10) != 3] == 0).all()) and len(set(b[torch.arange(10) != 3].tolist())) == 1
    assert shipped.fishing_target == 3 and torch.equal(model.fc.weight, lb.build("mlp:64", input_shape=digits.shape,
                                                                                    classes=10, seed=0).fc.weight)
    # every public image: the target class is (almost) never predicted
    probs = torch.softmax(shipped(digits.images[:200]), 1)[:, 3]
    assert float(probs.max()) < 1e-6


def test_the_fished_samples_are_read_exactly_and_no_other(digits):
    model = lb.build("mlp:1000", input_shape=digits.shape, classes=10, seed=0)
    shipped = fishing(model, target=3, calibration=digits.images[-256:])
    x, y = digits.images[:64], digits.labels[:64]
    rec = lb.attack("fishing", lb.observe(shipped, x, y))
    r = rec.images.reshape(64, -1).double()
    err = (r[None] - x.reshape(64, -1).double()[:, None]).abs().amax(-1).min(1).values
    exact = err < 1e-3
    target = y == 3
    assert int(exact[target].sum()) >= int(target.sum()) - 2 and not bool(exact[~target].any())
    assert rec.trace["fished_class"] == 3 and rec.trace["lone"] == int(exact[target].sum())


def test_fishing_needs_its_head_and_a_first_fc_layer(digits):
    x, y = digits.batch(4, seed=0)
    honest = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    with pytest.raises(UnsupportedThreatModel, match="fishing"):
        lb.attack("fishing", lb.observe(honest, x, y))
    cnn = fishing(lb.build("cnn:3-4-1-1", input_shape=digits.shape, classes=10, seed=0), target=1)
    with pytest.raises(UnsupportedThreatModel, match="gradient-matching"):
        lb.attack("fishing", lb.observe(cnn, x, y))
    with pytest.raises(ConfigError, match="target"):
        fishing(honest, target=10)
