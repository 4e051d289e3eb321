"""Per-sample reconstruction scores: pure functions on torch tensors.

Every function takes two tensors of the same shape, a batch ``B×C×H×W`` of
images or ``B×d`` of vectors (any leading batch size, any device), and returns
a float64 tensor of shape ``(B,)`` with one score per sample pair
``(a[i], b[i])``.  No matching happens here: pair the batch first with
:func:`leakbench.metrics.matching.match` (Liu et al. 2024, eq. (1)).

Scores are computed in float64 (on the input's device, or on the CPU for MPS
tensors, which lack float64); SSIM goes through scikit-image on the CPU.
Inputs are scored as given: nothing is clamped to the data range, so callers
that want the usual [0, 1] box clamp the reconstruction first.

- :func:`mse`   — mean squared error over all entries of a sample.
- :func:`rmse`  — ``sqrt(mse)``.
- :func:`psnr`  — ``10·log10(data_range² / mse)``; MSE is clamped at 1e-20, so
  identical samples score ``10·log10(data_range² / 1e-20)`` (200 dB for a
  range of 1) instead of +inf, and batch means stay finite.
- :func:`ssim`  — structural similarity (Wang et al. 2004, "Image quality
  assessment: from error visibility to structural similarity", IEEE TIP 13),
  scikit-image's implementation with the Gaussian-window settings of the
  paper (and torchmetrics' defaults).
- :func:`cosine` — cosine similarity of the flattened samples.
- :func:`ncc`   — normalised cross-correlation (Pearson correlation of the
  flattened samples), the similarity Haim et al. (2022) use to pair
  reconstructions with training points.

mse, rmse, psnr, cosine and ncc are differentiable (torch ops only); ssim is not.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError

__all__ = ["mse", "rmse", "psnr", "ssim", "cosine", "ncc"]

#: MSE floor used by :func:`psnr` (caps PSNR at 10·log10(range²/1e-20)).
MSE_FLOOR = 1e-20
#: Norm floor of :func:`cosine` and :func:`ncc` (a zero vector scores 0).
_EPS = 1e-12


def _as_tensor(value: object, field: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise ConfigError(f"expected a torch.Tensor, got {type(value).__name__} (field {field})")


def _f64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float64 (moved to the CPU if its device has no float64)."""
    if t.device.type == "mps":
        t = t.cpu()
    return t.to(torch.float64)


def _pair(a: object, b: object, *, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a reconstruction/original pair and return both as flat float64 (B, D)."""
    a = _as_tensor(a, "a")
    b = _as_tensor(b, "b")
    if a.shape != b.shape:
        raise ConfigError(
            f"expected tensors of the same shape for {what}, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.ndim == 0 or a.numel() == 0:
        raise ConfigError(f"expected a non-empty batch B×… for {what}, got shape {tuple(a.shape)}")
    a64 = _f64(a)
    b64 = _f64(b).to(a64.device)
    return a64.reshape(a.shape[0], -1), b64.reshape(b.shape[0], -1)


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean squared error per sample: ``mean((a[i] - b[i])²)`` over all entries; shape (B,)."""
    fa, fb = _pair(a, b, what="mse")
    return (fa - fb).square().mean(dim=1)


def rmse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Root mean squared error per sample, ``sqrt(mse(a, b))``; shape (B,)."""
    return mse(a, b).sqrt()


def psnr(a: torch.Tensor, b: torch.Tensor, *, data_range: float = 1.0) -> torch.Tensor:
    """Peak signal-to-noise ratio per sample in dB: ``10·log10(data_range² / mse)``; shape (B,).

    ``data_range`` is the span of valid values (1 for images in [0, 1]; note
    that Chen & Campbell's appendix E uses 255 on [0, 1] images, which adds
    48.13 dB).  The MSE is clamped at ``MSE_FLOOR`` = 1e-20, so identical
    samples give 200 dB (for ``data_range`` 1) rather than +inf.
    """
    if not data_range > 0:
        raise ConfigError(f"expected data_range > 0, got {data_range!r} (field data_range)")
    err = mse(a, b).clamp_min(MSE_FLOOR)
    return 10.0 * torch.log10(float(data_range) ** 2 / err)


def _ssim_win_size(height: int, width: int) -> int | None:
    """None (scikit-image's 11-pixel Gaussian window) or the largest odd size that fits."""
    side = min(height, width)
    if side >= 11:
        return None
    return side if side % 2 == 1 else side - 1


def ssim(a: torch.Tensor, b: torch.Tensor, *, data_range: float = 1.0) -> torch.Tensor:
    """Structural similarity per image (Wang et al. 2004); images B×C×H×W, shape (B,).

    Each image pair is scored by ``skimage.metrics.structural_similarity`` with
    ``gaussian_weights=True, sigma=1.5, use_sample_covariance=False`` (the
    paper's settings and torchmetrics' defaults; K1 = 0.01, K2 = 0.03) and the
    given ``data_range``, channels on axis 0 (SSIM averaged over channels), in
    float64 on the CPU.

    The Gaussian filter always has 11 taps; scikit-image additionally needs
    the window size (which sets the border it ignores) to fit in the image.
    For images whose smaller side is below 11 pixels ``win_size`` is set to
    the largest odd number ≤ that side (7 for 8×8 images), so such SSIMs are
    averaged over the few central pixels only.  Not differentiable.
    """
    a = _as_tensor(a, "a")
    b = _as_tensor(b, "b")
    if a.shape != b.shape:
        raise ConfigError(
            f"expected tensors of the same shape for ssim, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.ndim != 4 or a.numel() == 0:
        raise ConfigError(f"expected a non-empty image batch B×C×H×W for ssim, got shape {tuple(a.shape)}")
    if not data_range > 0:
        raise ConfigError(f"expected data_range > 0, got {data_range!r} (field data_range)")
    from skimage.metrics import structural_similarity

    na = a.detach().cpu().to(torch.float64).numpy()
    nb = b.detach().cpu().to(torch.float64).numpy()
    win = _ssim_win_size(a.shape[2], a.shape[3])
    values = [
        structural_similarity(
            na[i], nb[i],
            win_size=win,
            data_range=float(data_range),
            channel_axis=0,
            gaussian_weights=True,
            sigma=1.5,
            use_sample_covariance=False,
        )
        for i in range(a.shape[0])
    ]
    return torch.tensor(values, dtype=torch.float64)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the flattened samples, in [-1, 1]; a zero sample scores 0; shape (B,)."""
    fa, fb = _pair(a, b, what="cosine")
    na = fa.norm(dim=1).clamp_min(_EPS)
    nb = fb.norm(dim=1).clamp_min(_EPS)
    return (fa * fb).sum(dim=1) / (na * nb)


def ncc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Normalised cross-correlation per sample, in [-1, 1]; shape (B,).

    The cosine similarity of the flattened samples after subtracting each
    sample's own mean (Pearson correlation).  Invariant to a positive affine
    change ``s·a + t`` of either sample, so it compares reconstructions whose
    scale and offset are unknown (Haim et al. 2022, appendix B.3).  A constant
    sample scores 0.
    """
    fa, fb = _pair(a, b, what="ncc")
    fa = fa - fa.mean(dim=1, keepdim=True)
    fb = fb - fb.mean(dim=1, keepdim=True)
    na = fa.norm(dim=1).clamp_min(_EPS)
    nb = fb.norm(dim=1).clamp_min(_EPS)
    return (fa * fb).sum(dim=1) / (na * nb)
