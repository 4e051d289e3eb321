"""Haim et al.'s post-processing (appendix B.3): scaling, NCC neighbours, voting, SSIM sorting."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.metrics.voting import ncc_matrix, scale_unit, vote


@pytest.fixture(scope="module")
def digits():
    x, _ = lb.load("digits", size=16).batch(12, seed=0)
    return x.double()


def test_scale_unit_maps_each_sample_to_the_unit_box():
    x = torch.randn(5, 3, 4, 4, dtype=torch.float64) * 7 + 3
    s = scale_unit(x)
    flat = s.reshape(5, -1)
    assert torch.allclose(flat.min(1).values, torch.zeros(5, dtype=torch.float64))
    assert torch.allclose(flat.max(1).values, torch.ones(5, dtype=torch.float64))
    assert torch.equal(scale_unit(torch.ones(2, 4)), torch.zeros(2, 4))


def test_ncc_matrix_is_affine_invariant_and_matches_metric():
    a, b = torch.randn(4, 30, dtype=torch.float64), torch.randn(6, 30, dtype=torch.float64)
    m = ncc_matrix(a, b)
    assert torch.allclose(ncc_matrix(3 * a + 2, b), m)
    assert torch.allclose(m[1, 2], lb.metrics.ncc(a[1:2], b[2:3])[0])


def test_permuted_noised_scaled_copy_pairs_with_its_originals_exactly(digits):
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(12, generator=g)
    noisy = digits[perm] + 0.05 * torch.randn(digits.shape, generator=g, dtype=torch.float64)
    noisy = noisy * 4.0 - 1.5  # unknown scale and offset, undone by step 1
    out = vote(noisy, digits)
    inverse = torch.argsort(perm)
    assert torch.equal(out.nearest, inverse)  # training sample i ↔ candidate perm⁻¹(i)
    assert torch.equal(out.votes, torch.ones(12, dtype=torch.long))
    assert out.metric == "ssim" and bool((out.score > 0.6).all())
    assert torch.equal(out.order, torch.argsort(out.score, descending=True))
    assert out.count(0.6) == 12


def test_voting_averages_candidates_within_ratio(digits):
    # three noisy copies of sample 0 and one of sample 1: sample 0 gets the mean of its three
    g = torch.Generator().manual_seed(1)
    base = torch.stack([digits[0]] * 3 + [digits[1]])
    cand = base + 0.02 * torch.randn(base.shape, generator=g, dtype=torch.float64)
    out = vote(cand, digits[:2])
    assert out.votes.tolist() == [3, 1]
    assert torch.allclose(out.images[0], scale_unit(cand[:3]).mean(0))
    assert out.score[0] > out.score[1] - 0.05


def test_vector_data_uses_ncc_and_bad_shapes_fail():
    x = torch.randn(5, 10, dtype=torch.float64)
    out = vote(x[[3, 1, 4, 0, 2]], x, scale=False)
    assert out.metric == "ncc" and out.nearest.tolist() == [3, 1, 4, 0, 2]
    with pytest.raises(ConfigError, match="same per-sample shape"):
        vote(torch.zeros(3, 9), torch.zeros(3, 10))
    with pytest.raises(ConfigError, match="ratio"):
        vote(x, x, ratio=0.0)
