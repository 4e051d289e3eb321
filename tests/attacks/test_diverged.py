"""A diverged optimisation is a failure, never a result: lr = inf is refused up front; a loss curve ending on
NaN/inf makes the attack raise, so a sweep stores the trial failed (not done with token accuracy 0)."""
from __future__ import annotations

import math

import pytest
import torch

import leakbench as lb
from leakbench.attacks import create
from leakbench.attacks.base import NonFiniteReconstruction, Reconstruction, check_reconstruction
from leakbench.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["tag", "lamp", "inverting-gradients", "dlg"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, "inf", "nan"])
def test_non_finite_float_options_are_refused_where_the_attack_is_made(name, value):
    with pytest.raises(ConfigError, match="expected a finite number"):
        create(name, lr=value)


def test_a_loss_curve_ending_on_nan_is_no_reconstruction():
    tokens = torch.zeros(1, 4, dtype=torch.long)
    for last in (math.nan, math.inf):
        with pytest.raises(NonFiniteReconstruction, match="diverged"):
            check_reconstruction(Reconstruction(images=tokens, trace={"loss": [1.0, last]}), "tag")
    check_reconstruction(Reconstruction(images=tokens, trace={"loss": [math.nan, 0.5]}), "tag")  # recovered


@pytest.fixture(scope="module")
def text_obs():
    data = lb.load("text", split="test", context=8)
    model = lb.build("gpt:layers=1,width=32,heads=2", input_shape=data.shape, classes=data.vocab_size, seed=0)
    x, y = data.batch(1, seed=2)
    return lb.observe(model, x, y)


@pytest.mark.slow  # a few seconds: the text model's first forward passes
@pytest.mark.parametrize("name", ["tag", "lamp"])
def test_text_attacks_with_an_exploding_step_fail(text_obs, name):
    options = {"iterations": 3} if name == "tag" else {"iterations": 3, "every": 2, "candidates": 2,
                                                       "prior_steps": 1}
    with pytest.raises(NonFiniteReconstruction, match="diverged"):
        lb.attack(name, text_obs, lr=1e30, seed=0, **options)
