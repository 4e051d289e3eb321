"""Shared fixtures."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one torch thread (small models are faster and steadier so), then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def sphere():
    """12 points on the sphere in d = 20 with random ±1 labels (the targets' and KKT residual's tests)."""
    import leakbench as lb

    return lb.load("sphere", n=12, d=20, rule="random", seed=1)


@pytest.fixture(scope="session")
def twolayer(sphere):
    """A two-layer net trained 3 000 steps towards max margin on ``sphere`` (trained once per session)."""
    from leakbench.models.targets import train_target

    return train_target(sphere, model="twolayer:200", loss="exponential", lr=0.5, steps=3000, loss_tol=0,
                        center=False, init="small")
