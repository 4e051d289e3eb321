"""Hybrid (Chen & Campbell, Algorithm 1): gradient matching corrects R-GAP on rank-deficient CNNs."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks import create
from leakbench.errors import ConfigError


@pytest.mark.slow  # R-GAP then the corrective matching: `make test-slow`
def test_hybrid_beats_rgap_on_a_rank_deficient_cnn():
    data = lb.load("photos", size=16)
    x, y = data.batch(1, seed=0)
    x = x.double()
    model = lb.build("cnn:4-6-2-0", input_shape=data.shape, classes=data.num_classes, act="tanh",
                     bias={"conv": False, "linear": True}, init="uniform", seed=0, dtype=torch.float64)
    obs = lb.observe(model, x, y)
    rgap = lb.attack("rgap", obs)
    hybrid = lb.attack("hybrid", obs, preset="quick")
    mse = lambda a: float(((a - x) ** 2).mean())  # noqa: E731
    assert rgap.trace["layers"][0]["rank_deficiency"] < 0
    assert mse(hybrid.images) < 0.5 * mse(rgap.images)
    correction = hybrid.trace["corrections"][0]
    # eq. 16 decreased. The match term alone need not: R-GAP's solution already matches the
    # gradient up to round-off (rank deficiency leaves a null space), and TV pulls it off.
    assert correction["objective"][-1] < 0.5 * correction["objective"][0]
    assert max(correction["match"]) < 0.05
    # every solution of U x = V reproduces the tail's gradients (they are rows of U): the cosine term
    # starts at round-off and is blind to the null space, which only TV can choose in
    assert correction["match"][0] < 1e-10


def test_default_preset_is_the_papers_schedule():
    opts = create("hybrid").options
    assert (opts.iters_1, opts.iters_2, opts.iters_rest) == (10000, 8000, 1000)
    assert opts.schedule(1)[1:] == (1.0, 1.0, 0.05)
    assert opts.schedule(2)[1:] == (1.0, 1.0, 0.1)
    assert opts.schedule(3)[1:] == (10.0, 0.1, 1.0) and opts.lr == 1e-3


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="iters_1"):
        create("hybrid", iters_1=-1)
    with pytest.raises(ConfigError, match="lr"):
        create("hybrid", lr=0)
