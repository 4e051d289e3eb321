"""Robbing the Fed: exact recovery of samples alone in a bin, and the expected count."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.analysis.imprint import imprint_expected
from leakbench.models.malicious import ImprintBlock, find_module, imprint


@pytest.fixture(scope="module")
def photos():
    return lb.load("photos", size=16)


def _bins_of(shipped, x):
    block = find_module(shipped, ImprintBlock)
    scores = x.reshape(x.shape[0], -1).to(block.query.dtype) @ block.query
    return (scores[:, None] > block.thresholds[None, :]).sum(1) - 1  # index of the highest bin that fires


def _recovered(rec, x, tol=1e-6):
    """Which originals have a reconstruction within relative error ``tol``."""
    flat_r = rec.images.reshape(rec.images.shape[0], -1)
    flat_x = x.reshape(x.shape[0], -1)
    rel = (flat_r[None, :, :] - flat_x[:, None, :]).norm(dim=-1) / flat_x.norm(dim=-1)[:, None]
    return rel.min(dim=1).values < tol


def test_every_lone_sample_is_recovered_exactly(photos):
    """Bins calibrated on public photos (even indices); clients hold the others."""
    model = lb.build("mlp:32", input_shape=photos.shape, classes=photos.num_classes, seed=0, dtype=torch.float64)
    shipped = imprint(model, bins=16, seed=3, calibration=photos.images[0::2].double())
    private = torch.arange(1, len(photos.images), 2)
    checked = 0
    for seed in range(10):
        pick = private[torch.randperm(len(private), generator=torch.Generator().manual_seed(seed))[:8]]
        x, y = photos.batch(indices=pick.tolist())
        x = x.double()
        obs = lb.observe(shipped, x, y)
        rec = lb.attack("robbing-the-fed", obs)
        bins = _bins_of(shipped, x)
        alone = torch.tensor([(bins == b).sum() == 1 for b in bins])
        got = _recovered(rec, x)
        assert bool(got[alone].all()), f"seed {seed}: a lone sample was not recovered exactly"
        assert rec.trace["bins_occupied"] == len(set(bins.tolist()))
        assert rec.images.shape == x.shape
        assert int(rec.confidence.sum()) == rec.trace["bins_occupied"]
        checked += int(alone.sum())
    assert checked >= 30


def test_mean_recovered_count_matches_expected_formula():
    """Over 200 random batches the mean number recovered is within 5% of imprint_expected(K, B).

    Clients draw images with i.i.d. uniform pixels, the distribution the server's default prior
    models (a Gaussian query score), so the bins have equal mass.
    """
    bins, batch, shape = 32, 8, (3, 16, 16)
    model = lb.build("mlp:16", input_shape=shape, classes=10, seed=1, dtype=torch.float64)
    shipped = imprint(model, bins=bins, seed=0)
    gen = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(200):
        x = torch.rand((batch, *shape), generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (batch,), generator=gen)
        rec = lb.attack("robbing-the-fed", lb.observe(shipped, x, y))
        counts.append(int(_recovered(rec, x).sum()))
    mean = sum(counts) / len(counts)
    expected = imprint_expected(bins, batch)
    assert abs(mean - expected) / expected < 0.05, (mean, expected)


def test_requirements_explain_missing_block(photos):
    model = lb.build("mlp:16", input_shape=photos.shape, classes=photos.num_classes, seed=0)
    x, y = photos.batch(2, seed=0)
    obs = lb.observe(model, x, y)
    reasons = lb.attacks.create("robbing-the-fed").requirements(obs)
    assert reasons and "imprint" in reasons[0]
    with pytest.raises(lb.UnsupportedThreatModel, match="imprint"):
        lb.attack("robbing-the-fed", obs)


def test_bad_option_is_config_error():
    with pytest.raises(lb.ConfigError, match="threshold"):
        lb.attacks.create("robbing-the-fed", threshold=2.0)
