"""Observations from a captured gradient or update equal observe() on the same batch; normalisation in pixel space."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import leakbench as lb
from leakbench.models.custom import Normalize
from leakbench.errors import ConfigError
from leakbench.threat import Observation

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    data = lb.load("digits", size=8)
    model = lb.build("mlp:32", input_shape=data.shape, classes=10, act="relu", seed=0)
    x, y = data.batch(4, seed=0)
    return model, x, y


def _client_gradient(model, x, y):
    model = copy.deepcopy(model)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_from_gradients_equals_observe(setup):
    model, x, y = setup
    captured = Observation.from_gradients(model, _client_gradient(model, x, y), batch_size=4, labels=y)
    reference = lb.observe(model, x, y, labels_known=True)
    assert captured.kind == reference.kind == "gradient"
    assert captured.param_names == reference.param_names and captured.num_classes == reference.num_classes == 10
    for a, b in zip(captured.shared, reference.shared):
        torch.testing.assert_close(a, b)
    assert torch.equal(captured.labels, reference.labels)
    # and an attack on it recovers the batch-1 sample exactly, as on observe()'s
    one = Observation.from_gradients(model, _client_gradient(model, x[:1], y[:1]), batch_size=1)
    rec = lb.attack("fc-inversion", one)
    assert lb.compare(rec, x[:1], y[:1])["mse"] < 1e-10


def test_from_update_equals_observe_with_local_steps(setup):
    model, x, y = setup
    client = copy.deepcopy(model)
    opt = torch.optim.SGD(client.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(client(x), y).backward()
        opt.step()
    captured = Observation.from_update(model, client, batch_size=4, lr=0.1, steps=3)
    reference = lb.observe(model, x, y, local_steps=3, local_lr=0.1)
    assert captured.kind == reference.kind == "update" and captured.local_steps == 3
    for a, b in zip(captured.shared, reference.shared):
        torch.testing.assert_close(a, b)
    minibatch = Observation.from_update(model, client, batch_size=4, lr=0.1, epochs=2, minibatch=2)
    assert minibatch.local_steps == 4 and minibatch.extras["minibatch"] == 2


def test_normalisation_is_part_of_the_threat_model(setup):
    model, x, y = setup
    mean, std = [0.3], [0.2]
    client_view = (x - 0.3) / 0.2  # what the user's data loader fed the model
    grads = _client_gradient(model, client_view[:1], y[:1])
    obs = Observation.from_gradients(model, grads, batch_size=1, normalize=(mean, std))
    assert isinstance(obs.model.normalize, Normalize) and obs.param_names[0].startswith("model.")
    # the attacker's model takes pixels: at the client's pixel image it reproduces the captured gradient, so a
    # matching attack's optimum is the image in pixel space, not the normalised tensor the model saw
    at_pixels = lb.observe(obs.model, x[:1], y[:1])
    for a, b in zip(at_pixels.shared, obs.shared):
        torch.testing.assert_close(a, b)
    assert at_pixels.param_names == obs.param_names


@pytest.mark.parametrize("call,match", [
    (lambda m: Observation.from_gradients(m, [torch.zeros(1)], batch_size=1), "expected 4 gradient tensors"),
    (lambda m: Observation.from_gradients(m, {"fc1.weight": torch.zeros(1)}, batch_size=1), "missing"),
    (lambda m: Observation.from_gradients(m, [torch.full_like(p, float("nan")) for p in m.parameters()],
                                          batch_size=1), "finite"),
    (lambda m: Observation.from_gradients(m, [torch.zeros_like(p) for p in m.parameters()], batch_size=0),
     "batch_size ≥ 1"),
    (lambda m: Observation.from_gradients(m, [torch.zeros_like(p) for p in m.parameters()], batch_size=2,
                                          labels=torch.tensor([0, 11])), "labels in 0..9"),
    (lambda m: Observation.from_gradients(m, [torch.zeros_like(p) for p in m.parameters()], batch_size=1,
                                          normalize=([0.5], [0.0])), "positive standard deviations"),
    (lambda m: Observation.from_update(m, m, batch_size=2, lr=0.0), "expected lr > 0"),
    (lambda m: Observation.from_update(m, m, batch_size=2, lr=0.1, epochs=1, minibatch=3), "minibatch"),
])
def test_bad_captures_get_one_clear_error(setup, call, match):
    with pytest.raises(ConfigError, match=match):
        call(setup[0])
