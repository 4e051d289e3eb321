"""Per-sample scores of leakbench.metrics.image against hand formulas and scikit-image."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from leakbench.errors import ConfigError
from leakbench.metrics import METRICS, cosine, mse, ncc, psnr, rmse, ssim


def _pair(shape, seed=0, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(shape, generator=g)
    b = (a + noise * torch.randn(shape, generator=g)).clamp(0, 1)
    return a, b


def test_mse_rmse_psnr_match_hand_formulas():
    a, b = _pair((5, 3, 6, 7))
    a, b = a.double(), b.double()
    na, nb = a.numpy().astype(np.float64), b.numpy().astype(np.float64)
    want_mse = ((na - nb) ** 2).reshape(5, -1).mean(axis=1)
    np.testing.assert_allclose(mse(a, b).numpy(), want_mse, rtol=1e-12)
    np.testing.assert_allclose(rmse(a, b).numpy(), np.sqrt(want_mse), rtol=1e-12)
    np.testing.assert_allclose(psnr(a, b).numpy(), 10 * np.log10(1.0 / want_mse), rtol=1e-12)
    np.testing.assert_allclose(
        psnr(a * 255, b * 255, data_range=255.0).numpy(), 10 * np.log10(255.0**2 / (want_mse * 255**2)), rtol=1e-10
    )


def test_scores_shape_dtype_and_vectors():
    a, b = _pair((4, 10))
    for f in (mse, rmse, psnr, cosine, ncc):
        out = f(a, b)
        assert out.shape == (4,) and out.dtype == torch.float64


def test_psnr_known_value_and_cap_for_identical():
    a = torch.zeros(2, 1, 4, 4, dtype=torch.float64)
    b = a + 0.1  # mse = 0.01 -> 20 dB
    np.testing.assert_allclose(psnr(a, b).numpy(), [20.0, 20.0], rtol=1e-12)
    same = psnr(a, a)
    assert torch.isfinite(same).all()
    np.testing.assert_allclose(same.numpy(), [200.0, 200.0])
    assert mse(a, a).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("channels,size", [(1, 32), (3, 32), (1, 8), (3, 8)])
def test_ssim_equals_skimage_per_sample(channels, size):
    a, b = _pair((3, channels, size, size), seed=channels + size)
    got = ssim(a, b).numpy()
    win = None if size >= 11 else 7
    for i in range(3):
        # independent layout: 2-D grayscale, H×W×C colour
        ia = a[i].double().numpy()
        ib = b[i].double().numpy()
        if channels == 1:
            ia, ib, axis = ia[0], ib[0], None
        else:
            ia, ib, axis = ia.transpose(1, 2, 0), ib.transpose(1, 2, 0), -1
        want = structural_similarity(
            ia, ib, win_size=win, data_range=1.0, channel_axis=axis,
            gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
        )
        assert got[i] == pytest.approx(want, abs=1e-12)


def test_ssim_identical_is_one_and_decreases_with_noise():
    a, _ = _pair((2, 3, 16, 16))
    np.testing.assert_allclose(ssim(a, a).numpy(), [1.0, 1.0], atol=1e-12)
    noise = torch.randn(a.shape, generator=torch.Generator().manual_seed(1))
    scores = [ssim(a, a + s * noise).mean().item() for s in (0.01, 0.1, 0.3)]
    assert scores[0] > scores[1] > scores[2]


def test_ssim_tiny_images_run():
    a, b = _pair((2, 1, 4, 5))
    out = ssim(a, b)
    assert out.shape == (2,) and torch.isfinite(out).all()
    assert ssim(a, a).tolist() == pytest.approx([1.0, 1.0])


def test_ssim_rejects_non_images():
    a, b = _pair((2, 10))
    with pytest.raises(ConfigError, match="B×C×H×W"):
        ssim(a, b)


def test_cosine_and_ncc_properties():
    a, _ = _pair((3, 2, 5, 5))
    np.testing.assert_allclose(cosine(a, 2 * a).numpy(), 1.0, atol=1e-12)
    np.testing.assert_allclose(cosine(a, -a).numpy(), -1.0, atol=1e-12)
    e1 = torch.tensor([[1.0, 0.0]])
    e2 = torch.tensor([[0.0, 3.0]])
    assert cosine(e1, e2).item() == 0.0
    assert cosine(e1, torch.zeros(1, 2)).item() == 0.0
    # ncc is invariant to positive affine maps and equals Pearson's r
    np.testing.assert_allclose(ncc(a, 3 * a + 2).numpy(), 1.0, atol=1e-12)
    np.testing.assert_allclose(ncc(a, 1 - a).numpy(), -1.0, atol=1e-12)
    x, y = _pair((4, 50), seed=3, noise=0.5)
    want = [np.corrcoef(x[i].numpy(), y[i].numpy())[0, 1] for i in range(4)]
    np.testing.assert_allclose(ncc(x, y).numpy(), want, rtol=1e-6)
    assert ncc(torch.ones(1, 5), x[:1, :5]).item() == 0.0


@pytest.mark.parametrize("f", [mse, rmse, psnr, ssim, cosine, ncc])
def test_shape_mismatch_names_both_shapes(f):
    a = torch.zeros(2, 1, 8, 8)
    b = torch.zeros(2, 1, 8, 9)
    with pytest.raises(ConfigError) as info:
        f(a, b)
    assert "(2, 1, 8, 8)" in str(info.value) and "(2, 1, 8, 9)" in str(info.value)


def test_bad_inputs_raise_config_error():
    with pytest.raises(ConfigError, match="torch.Tensor"):
        mse([[0.0]], torch.zeros(1, 1))
    with pytest.raises(ConfigError, match="data_range"):
        psnr(torch.zeros(1, 2), torch.ones(1, 2), data_range=0)
    with pytest.raises(ConfigError, match="non-empty"):
        mse(torch.zeros(0, 3), torch.zeros(0, 3))


def test_mse_is_differentiable_and_accepts_numpy():
    a = torch.rand(2, 4, requires_grad=True)
    b = torch.rand(2, 4)
    mse(a, b).sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), (2 * (a - b) / 4).detach().numpy(), rtol=1e-6)
    assert mse(np.ones((2, 3)), np.zeros((2, 3))).tolist() == [1.0, 1.0]


def test_metric_registry():
    assert METRICS.names() == ["cosine", "mse", "psnr", "psnr_registered", "rmse", "ssim"]
    assert METRICS.get("psnr") is psnr
    with pytest.raises(ConfigError, match="Known metrics"):
        METRICS.get("lpipz")
    assert math.isclose(METRICS.get("rmse")(torch.zeros(1, 4), torch.full((1, 4), 0.5)).item(), 0.5)
