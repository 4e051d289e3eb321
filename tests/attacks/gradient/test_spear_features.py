"""spear-features: SPEAR at a ConvNet's hidden ReLU FC layer, then the images through the known convolution."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.errors import UnsupportedThreatModel


def _net(width: int = 1000, channels: int = 8, hidden_act: type[nn.Module] = nn.ReLU, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(channels * 64, width), hidden_act(), nn.Linear(width, 10))


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")  # 8 × 8


def _matched_errors(rec, x):
    order = torch.tensor(lb.compare(rec, x)["order"])
    err = (x.reshape(len(x), -1).double() - rec.images.reshape(len(x), -1).double()[order]).abs().amax(1)
    return err, rec.confidence.bool()[order]


def test_a_batch_of_32_is_recovered_exactly_and_certified(digits):
    x, y = digits.batch(32, seed=3)
    rec = lb.attack("spear-features", lb.observe(_net(), x, y))
    err, certified = _matched_errors(rec, x)
    assert int(certified.sum()) == 32 and float(err.max()) < 1e-5
    assert sum(rec.trace["features_certified"]) == 32 and all(rec.trace["image_exact"])
    assert rec.trace["inversion"][0]["solver"] == "least squares" and rec.trace["inversion"][0]["full_rank"] == 32
    grey = torch.full_like(x, float(x.mean()))
    assert float((grey - x).abs().amax()) > 0.5          # the chance image is nowhere near exact


def test_no_sample_is_certified_wrongly_when_the_layer_is_too_narrow(digits):
    # 128 neurons for 32 non-negative, similar feature vectors: most share every neuron with another
    x, y = digits.batch(32, seed=3)
    rec = lb.attack("spear-features", lb.observe(_net(width=128), x, y), preset="quick")
    err, certified = _matched_errors(rec, x)
    assert 0 < int(certified.sum()) < 32
    assert float(err[certified].max()) < 1e-4
    assert "unrecovered" in rec.trace


def test_requirements_name_the_reason(digits):
    x, y = digits.batch(4, seed=0)
    mlp = lb.build("mlp:100", input_shape=digits.shape, classes=10, seed=0)
    cnn = lb.build("cnn:3-4-1-1", input_shape=digits.shape, classes=10, seed=0)
    cases = {
        "use spear": lb.observe(mlp, x, y),
        "needs a ReLU fully connected layer after the convolutions": lb.observe(cnn, x, y),
        "activation 'tanh'": lb.observe(_net(hidden_act=nn.Tanh), x, y),
        "after 2 local steps": lb.observe(_net(), x, y, local_steps=2, local_lr=0.1),
        "at least 2·B = 8 neurons": lb.observe(_net(width=6), x, y),
    }
    for fragment, obs in cases.items():
        with pytest.raises(UnsupportedThreatModel, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            lb.attack("spear-features", obs)


def test_bad_options_are_one_line(digits):
    x, y = digits.batch(4, seed=0)
    obs = lb.observe(_net(), x, y)
    for options, field in (({"steps": -1}, "steps"), ({"lr": 0.0}, "lr"), ({"image_tol": 2.0}, "image_tol")):
        with pytest.raises(lb.ConfigError, match=f"option {field}"):
            lb.attack("spear-features", obs, **options)


def test_samples_sharing_every_neuron_are_told_apart_on_the_whole_gradient(digits):
    # 256 neurons for 32 similar feature vectors: peeling stalls after 9 (the rest share every neuron with another),
    # and SPEAR's kernels shared by several samples, split by the rows exclusive to one of them within the kernel,
    # give the other 23 (before: 8 of 32 certified), certified and exact.  Four rounds: quick's two found 30 of the 32
    # directions on one machine and all 32 on another (the round-off of a different MKL code path), four find all
    x, y = digits.batch(32, seed=3)
    rec = lb.attack("spear-features", lb.observe(_net(width=256), x, y), preset="quick", rounds=4)
    err, certified = _matched_errors(rec, x)
    assert bool(certified.all()) and float(err.max()) < 1e-5, (int(certified.sum()), float(err.max()))
    first = rec.trace["passes"][0]
    assert first["peeled"] < 32 and first["peeled"] + first["spear"] == 32
