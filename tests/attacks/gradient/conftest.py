"""Fixtures of the generative attacks' tests (gias, gifd): 8×8 digits, a tiny cached prior, an observation maker."""
from __future__ import annotations

import pytest

import leakbench as lb
from leakbench.models.prior import PriorConfig, learned_generator

#: a prior small enough to train in a second: latent 4, width 4, 20 steps
TINY_PRIOR = PriorConfig(latent=4, width=4, steps=20, batch=16, seed=0)


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits", size=8)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """A tiny auto generator's options (its own cache directory, trained once for the module)."""
    folder = tmp_path_factory.mktemp("generators")
    learned_generator((1, 8, 8), config=TINY_PRIOR, cache_dir=folder)
    return {"latent": TINY_PRIOR.latent, "prior_width": TINY_PRIOR.width, "prior_steps": TINY_PRIOR.steps,
            "cache_dir": str(folder)}


@pytest.fixture(scope="module")
def observe_digits(digits):
    """observe_digits(B, seed=, labels_known=) → (x, the gradient of a fresh sigmoid CNN on digits 1 000 + 7·seed …)."""
    def make(batch: int, *, seed: int = 0, labels_known: bool = True):
        model = lb.build("cnn:4-3-1-1", input_shape=digits.shape, classes=10, act="sigmoid", seed=seed)
        x, y = digits.batch(indices=list(range(1000 + 7 * seed, 1000 + 7 * seed + batch)))
        return x, lb.observe(model, x, y, labels_known=labels_known)
    return make
