"""Two tensors that must match element for element are compared by shape, exactly, by one helper
(:func:`leakbench.errors.expect_same_shape`): broadcasting never passes for a match."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.errors import ConfigError, expect_same_shape
from leakbench.threat import Observation

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    data = lb.load("digits", size=8)
    return lb.build("mlp:16", input_shape=data.shape, classes=10, act="relu", seed=0)


def _with(model, name, shape):
    other = copy.deepcopy(model)
    module_name, attr = name.rsplit(".", 1)
    setattr(other.get_submodule(module_name), attr, nn.Parameter(torch.zeros(shape)))
    return other


@pytest.mark.parametrize("shape", [(1,), (1, 10), ()])
def test_from_update_refuses_a_broadcastable_bias(model, shape):
    bias = [n for n, p in model.named_parameters() if p.dim() == 1][-1]
    after = _with(model, bias, shape)
    with pytest.raises(ConfigError, match="model_after"):
        Observation.from_update(model, after, batch_size=4, lr=0.1)


def test_from_gradients_refuses_a_broadcastable_gradient(model):
    grads = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    bias = [n for n, p in model.named_parameters() if p.dim() == 1][-1]
    grads[bias] = torch.zeros(1)
    with pytest.raises(ConfigError, match="with shape"):
        Observation.from_gradients(model, grads, batch_size=4)


def test_the_helper_compares_shapes_exactly():
    expect_same_shape(torch.zeros(2, 3), torch.ones(2, 3), "x", "argument x")
    expect_same_shape(torch.zeros(2, 3), (2, 3), "x", "argument x")
    for bad in (torch.zeros(1, 3), torch.zeros(3), torch.zeros(2, 3, 1), 5.0):
        with pytest.raises(ConfigError, match=r"expected x with shape \(2, 3\), got .* \(argument x\)"):
            expect_same_shape(bad, torch.zeros(2, 3), "x", "argument x")
