"""Training seeds stacked (train_seeds, utility_seeds): each seed's run equals its run alone."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.defenses import parse
from leakbench.evaluation.training.seeds import seeds_refusal
from leakbench.evaluation.training.utility import utility_seeds

DATA = lb.load("digits").subset(torch.arange(160))  # 120 train / 40 test: 15 steps an epoch
COMMON = dict(epochs=2, batch_size=8, lr=0.05, model_options={"act": "tanh"}, cache_dir=False, test_fraction=0.25)


def _alone_and_stacked(defense: str, model: str = "cnn:3-4-2-1") -> tuple[list, list]:
    seeds = [0, 1, 2]
    alone = utility_seeds(model, DATA, defense, seeds=seeds, stacked=False, **COMMON)
    stacked = utility_seeds(model, DATA, defense, seeds=seeds, stacked=True, **COMMON)
    for a, b in zip(alone, stacked):
        assert not isinstance(b, Exception), b
        assert b.train_loss == pytest.approx(a.train_loss, rel=1e-5)
        assert b.losses == pytest.approx(a.losses, rel=1e-5)
        assert b.test_loss == pytest.approx(a.test_loss, rel=1e-5)
        assert (b.train_accuracy, b.test_accuracy) == (a.train_accuracy, a.test_accuracy)
        assert (b.epsilon, b.steps, b.samples_seen) == (a.epsilon, a.steps, a.samples_seen)
    assert len({r.train_loss for r in stacked}) == 3, "three seeds, three different runs"
    return alone, stacked


def test_plain_training_stacked_equals_alone():
    _alone_and_stacked("none")


def test_dpsgd_stacked_equals_alone_with_each_seeds_noise_and_the_same_epsilon():
    _, stacked = _alone_and_stacked("dpsgd:1,0.5", model="mlp:16")
    assert stacked[0].epsilon is not None and stacked[0].epsilon > 0


@pytest.mark.parametrize("defense", ["noise:0.01", "prune:0.5"])
def test_shared_stage_defenses_stacked_equal_alone(defense):
    _alone_and_stacked(defense, model="mlp:16")


def test_defenses_that_cannot_stack_say_why_and_still_train_each_seed():
    model = lb.build("mlp:16", input_shape=DATA.shape, classes=10)
    assert "dropout" in seeds_refusal(parse("dropout:0.2"), model)
    assert "local steps" in seeds_refusal(parse("local:2,0.05"), model)
    assert seeds_refusal(parse("dpsgd:1,1+noise:0.1"), model) is None
    out = utility_seeds("mlp:16", DATA, "dropout:0.2", seeds=[0, 1], stacked=True, **COMMON)
    assert all(isinstance(r, lb.evaluation.UtilityResult) for r in out)


def test_seeds_stack_by_default_on_cuda_only():
    from unittest import mock

    from leakbench.evaluation.training import utility

    with mock.patch.object(utility, "train_seeds", side_effect=AssertionError("stacked on a CPU")) as called:
        out = utility_seeds("mlp:16", DATA, "none", seeds=[0, 1], **COMMON)
    assert not called.called and all(isinstance(r, lb.evaluation.UtilityResult) for r in out)
