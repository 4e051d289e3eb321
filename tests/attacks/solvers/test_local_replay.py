"""The replay of a client's local steps agrees with observe's own simulation of the client."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks.solvers.local_replay import replay_misfit, replay_update


@pytest.fixture(scope="module")
def batch():
    data = lb.load("digits", size=8)
    x, y = data.batch(12, seed=4)
    return lb.build("mlp:64", input_shape=data.shape, classes=10, seed=1), x, y


@pytest.mark.parametrize("local", [{"local_steps": 3}, {"local_steps": 2, "local_batch": 5}])
def test_the_replay_equals_the_shared_update(batch, local):
    model, x, y = batch
    obs = lb.observe(model, x, y, local_lr=0.2, **local)
    replayed = replay_update(obs, x, y)
    assert len(replayed) == len(obs.shared)
    for mine, shared in zip(replayed, obs.shared):
        torch.testing.assert_close(mine, shared.double(), rtol=0, atol=1e-6 * float(shared.abs().max()) + 1e-9)


def test_a_clipped_update_fits_at_its_clipping_factor(batch):
    model, x, y = batch
    obs = lb.observe(model, x, y, local_steps=3, local_lr=0.2, defense="clip:0.01")
    full = torch.cat([t.reshape(-1) for t in replay_update(obs, x, y)])
    misfit, factor = replay_misfit(obs, x, y)
    assert misfit < 1e-5
    assert factor == pytest.approx(0.01 / float(full.norm()), rel=1e-4)
