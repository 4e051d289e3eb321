"""Robbing the Fed: exact recovery of samples alone in a bin, honest confidence, and the expected count."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.analysis.imprint import imprint_expected
from leakbench.models import malicious
from leakbench.models.malicious import ImprintBlock, find_module, imprint


@pytest.fixture(scope="module")
def photos():
    return lb.load("photos", size=16)


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")


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
        assert int(rec.confidence.sum()) == int(alone.sum())  # confident = the lone samples (float64)
        checked += int(alone.sum())
    assert checked >= 30


def _held_out_block(data, bins, dtype, seed=1, calibration=200, holdout=400):
    """Edges from one public slice, masses from another; clients draw from the rest."""
    perm = torch.randperm(len(data.images), generator=torch.Generator().manual_seed(0))
    cal, hold, pool = perm[:calibration], perm[calibration:calibration + holdout], perm[calibration + holdout:]
    model = lb.build("mlp:16", input_shape=data.shape, classes=data.num_classes, seed=0, dtype=dtype)
    shipped = imprint(model, bins=bins, seed=seed, calibration=data.images[cal].to(dtype),
                      holdout=data.images[hold].to(dtype))
    return shipped, pool


@pytest.mark.parametrize("name", ["digits", "photos"])
def test_confident_slots_are_exactly_the_lone_ones(name, digits, photos):
    """Batches of 16 in 8 bins collide often: confidence marks the lone samples and nothing else."""
    data = digits if name == "digits" else photos
    shipped, pool = _held_out_block(data, 8, torch.float64, calibration=100, holdout=100)
    collisions = 0
    for seed in range(4):
        pick = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[:16]]
        x, y = data.images[pick].double(), data.labels[pick]
        rec = lb.attack("robbing-the-fed", lb.observe(shipped, x, y))
        bins = _bins_of(shipped, x)
        counts = torch.bincount(bins, minlength=8)
        occupied = torch.tensor(rec.trace["occupied"])
        lone_bins = (counts[occupied] == 1)
        assert rec.trace["lone"] == lone_bins.tolist(), f"seed {seed}: confident bins are not the lone ones"
        conf = rec.confidence[: len(occupied)] > 0
        flat = rec.images[: len(occupied)].reshape(len(occupied), -1)
        for slot in conf.nonzero().flatten().tolist():  # each confident slot is its bin's sample, exactly
            sample = x[bins == occupied[slot]].reshape(-1)
            assert torch.allclose(flat[slot], sample, atol=1e-9)
        assert not bool(rec.confidence[len(occupied):].any())  # padded repeats are never confident
        labels = torch.tensor(rec.trace["lone_labels"])[conf]
        truth = torch.stack([y[bins == b][0] for b in occupied[conf]]) if bool(conf.any()) else labels
        assert torch.equal(labels, truth)  # the label the consistency check found is the sample's
        collisions += int((counts > 1).sum())
    assert collisions >= 8  # the batches did hold blended bins


def test_float32_never_claims_a_blend(digits):
    """In float32 the check works at round-off: no blended bin is claimed, nearly every lone one is."""
    shipped, pool = _held_out_block(digits, 16, torch.float32, calibration=100, holdout=100)
    lone = claimed = 0
    for seed in range(6):
        pick = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[:24]]
        x, y = digits.images[pick], digits.labels[pick]
        rec = lb.attack("robbing-the-fed", lb.observe(shipped, x, y))
        counts = torch.bincount(_bins_of(shipped, x), minlength=16)
        flags = torch.tensor(rec.trace["lone"], dtype=torch.bool)
        solo = counts[torch.tensor(rec.trace["occupied"])] == 1
        assert not bool((flags & ~solo).any()), f"seed {seed}: a blended bin was claimed"
        lone, claimed = lone + int(solo.sum()), claimed + int(flags.sum())
    assert claimed >= 0.9 * lone and lone >= 20


def test_no_claim_under_a_defense(digits):
    shipped, pool = _held_out_block(digits, 16, torch.float64, calibration=100, holdout=100)
    x, y = digits.images[pool[:8]].double(), digits.labels[pool[:8]]
    rec = lb.attack("robbing-the-fed", lb.observe(shipped, x, y, defense="noise:1e-6"))
    assert not bool(rec.confidence.any()) and "defense" in rec.trace["lone_check"]


@pytest.mark.slow  # 200 batches: `make test-slow`
def test_realised_masses_predict_the_mean_recovery_on_held_out_digits(digits):
    """imprint_expected with the block's held-out masses is within 5 % of the mean recovered over
    200 batches of held-out digits (edges from 200 public images, masses from 400 others, clients
    draw from the remaining 1 197); the equal-mass prediction over-predicts by > 10 %."""
    bins, batch = 64, 32
    shipped, pool = _held_out_block(digits, bins, torch.float32)
    block = find_module(shipped, ImprintBlock)
    assert block.masses_source == "holdout"
    gen = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(200):
        pick = pool[torch.randperm(len(pool), generator=gen)[:batch]]
        rec = lb.attack("robbing-the-fed", lb.observe(shipped, digits.images[pick], digits.labels[pick]))
        counts.append(float(rec.confidence.sum()))
    mean = sum(counts) / len(counts)
    predicted = imprint_expected(shipped, batch)  # the holdout's counts: an unbiased estimate
    assert abs(mean - predicted) / predicted < 0.05, (mean, predicted)
    plug_in = imprint_expected(bins, batch, masses=block.masses)
    assert abs(mean - plug_in) / plug_in < 0.05, (mean, plug_in)
    assert imprint_expected(bins, batch) > 1.1 * mean  # what equal masses would have promised


@pytest.mark.slow  # 200 batches: `make test-slow`
def test_mean_recovered_count_matches_expected_formula(monkeypatch):
    """Over 200 random batches the mean number recovered is within 5% of imprint_expected(K, B).

    Clients draw images with i.i.d. uniform pixels, the distribution the server's default prior
    models (a Gaussian query score), so the bins have equal mass.
    """
    bins, batch, shape = 32, 8, (3, 16, 16)
    model = lb.build("mlp:16", input_shape=shape, classes=10, seed=1, dtype=torch.float64)
    monkeypatch.setattr(malicious, "_WARNED", set())
    with pytest.warns(malicious.UncalibratedImprintWarning):  # uncalibrated: the uniform-pixel assumption is announced
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
