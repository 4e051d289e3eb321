"""LOKI's customised models (Zhao et al. 2024): per-client kernels, disjoint blocks under the secure sum, errors."""
from __future__ import annotations

import copy

import pytest
import torch

import leakbench as lb
from leakbench.attacks.observed import shared_gradient
from leakbench.defenses.pipeline import mean_gradient, other_batches
from leakbench.errors import ConfigError
from leakbench.losses import get_loss
from leakbench.models.loki import LokiBlock, client_parameters, loki


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")


def _shipped(digits, clients=3, bins=32, **kw):
    model = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0, act="relu")
    return loki(model, clients=clients, bins=bins, calibration=digits.images[-128:], **kw)


def test_each_client_copies_its_image_into_its_own_channels_only(digits):
    shipped = _shipped(digits, scale=3.0)
    block: LokiBlock = shipped.loki
    x = digits.images[:5]
    for index in range(3):
        params = client_parameters(shipped, {n: p.detach() for n, p in shipped.named_parameters()}, index)
        h = torch.func.functional_call(block.conv, {"weight": params["loki.conv.weight"],
                                                     "bias": params["loki.conv.bias"]}, (x,))
        h = h.reshape(5, 3, 2, 8, 8)                       # (batch, client, [image, constant], H, W)
        assert torch.equal(h[:, index, 0], 3.0 * x[:, 0])  # the scaled identity kernel copies the image
        assert torch.all(h[:, index, 1] == 3.0)            # the client's constant channel
        others = [m for m in range(3) if m != index]
        assert torch.all(h[:, others] == 0)


def test_the_bins_are_the_same_for_every_client(digits):
    shipped = _shipped(digits)
    block = shipped.loki
    x = digits.images[:40]
    score = x.reshape(40, -1).double() @ block.query.double()
    expected = block.slope * (score[:, None] - block.thresholds.double()[None])
    for index in range(3):
        weight, bias = (t.to(block.conv.weight) for t in block.kernels(index))
        h = torch.nn.functional.conv2d(x, weight, bias, padding=1)
        z = block.fc0(h.flatten(1)).double()
        assert torch.allclose(z, expected, atol=1e-6)


def test_under_the_secure_sum_each_clients_block_holds_only_its_own_gradient(digits):
    shipped = _shipped(digits)
    x, y = digits.images[:8], digits.labels[:8]
    population = digits.subset(torch.arange(100, 400))
    obs = lb.observe(shipped, x, y, defense="secagg:3", population=population, seed=0)
    block = obs.model.loki
    total, _ = block.split(shared_gradient(obs, block.fc0.weight))
    # the independent computation: every client's own gradient on its own model, cut into the blocks
    start = {n: p.detach() for n, p in shipped.named_parameters()}
    gen = torch.Generator().manual_seed(0)  # the observation's seed: the same other clients' batches
    clients = [(x, y), *other_batches(population, 2, 8, like_x=x, like_y=y, generator=gen)]
    names = list(start)
    column = names.index("loki.fc0.weight")
    for index, (xb, yb) in enumerate(clients):
        own = mean_gradient(shipped, client_parameters(shipped, start, index), xb, yb, get_loss("ce"),
                            torch.Generator())[column]
        own_blocks, _ = block.split(own)
        assert torch.all(own_blocks[:, [m for m in range(3) if m != index]] == 0)
        assert torch.allclose(total[:, index], own_blocks[:, index], atol=1e-9, rtol=1e-5)


def test_an_honest_model_keeps_its_parameters(digits):
    model = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0)
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert client_parameters(model, params, 3) is params


@pytest.mark.parametrize("kwargs,field", [({"clients": 0}, "clients"), ({"bins": 1}, "bins"),
                                          ({"scale": 0.0}, "scale"), ({"slope": -1.0}, "slope"),
                                          ({"gain": float("nan")}, "gain"), ({"calibration": None}, "calibration")])
def test_bad_options_name_the_argument(digits, kwargs, field):
    model = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0)
    args = {"clients": 2, "bins": 8, "calibration": digits.images[-64:], **kwargs}
    with pytest.raises(ConfigError, match=field):
        loki(model, **args)


def test_a_flat_input_and_a_client_beyond_l_are_refused(digits):
    model = lb.build("mlp:64", input_shape=(64,), classes=10, seed=0)
    with pytest.raises(ConfigError, match="C×H×W"):
        loki(model, clients=2, bins=8, calibration=digits.images[-64:].reshape(64, 64))
    shipped = _shipped(digits, clients=2)
    population = digits.subset(torch.arange(100, 400))
    with pytest.raises(ConfigError, match="customised for 2 client"):
        lb.observe(shipped, digits.images[:4], digits.labels[:4], defense="secagg:3", population=population)


def test_the_clients_check_flags_every_clients_model_with_its_evidence(digits):
    from leakbench.analysis.inspection import inspect

    shipped = _shipped(digits, clients=3, bins=64)
    held = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0, act="relu")
    for index in range(3):
        received = copy.deepcopy(shipped)
        with torch.no_grad():
            for name, value in received.loki.client_overrides(index).items():
                received.loki.get_parameter(name).copy_(value)
        report = inspect(held, received, x=digits.images[:32], y=digits.labels[:32])
        assert report.suspicious and {"architecture", "duplicated-rows", "constant-rows"} <= set(report.checks)
        assert "loki.fc0.weight" in report.reason
