"""local_train is the FedAvg client leakbench's own pipeline simulates (``local:E,lr,b``)."""
from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")

import torch  # noqa: E402

import leakbench as lb  # noqa: E402
from leakbench.defenses import share  # noqa: E402
from leakbench.errors import ConfigError  # noqa: E402
from leakbench.integrations.flower import local_train  # noqa: E402
from leakbench.losses import get_loss  # noqa: E402


def test_minibatch_epochs_equal_the_pipelines_fedavg_client():
    data = lb.load("digits")
    x, y = data.images[:6], data.labels[:6]
    model = lb.build("mlp:16", input_shape=data.shape, classes=10, act="tanh", seed=1)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = share("local:2,0.1,4", model, params, x, y, get_loss("ce"), generator=torch.Generator().manual_seed(0))
    result = local_train(model, x, y, lr=0.1, epochs=2, minibatch=4)
    assert result.steps == 4 and result.sample_rate == pytest.approx(4 / 6)
    for (name, p), want in zip(model.named_parameters(), expected.tensors):
        assert torch.allclose(p.detach() - params[name], want, atol=1e-6), name


def test_local_train_refuses_update_defenses_and_bad_counts():
    data = lb.load("digits")
    model = lb.build("mlp:16", input_shape=data.shape, classes=10, seed=1)
    x, y = data.images[:2], data.labels[:2]
    with pytest.raises(ConfigError, match="defense_mod"):
        local_train(model, x, y, lr=0.1, steps=1, defense="prune:0.9")
    with pytest.raises(ConfigError, match="either steps"):
        local_train(model, x, y, lr=0.1)
    with pytest.raises(ConfigError, match="minibatch"):
        local_train(model, x, y, lr=0.1, epochs=1, minibatch=5)
