"""Files written next to the store for a finished trial: ``<key>.npz`` (arrays) and ``<key>.png`` (a tile).

The PNG is a plain tile — originals on the top row, their matched
reconstructions below, clipped to [0, 1] — written with matplotlib's
``imsave`` (no figure, a few milliseconds).  The HTML report draws captioned
grids from the NPZ files.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..trials.trial import TrialResult


def _prep(a: np.ndarray) -> np.ndarray:
    """N×3×H×W in [0, 1] from images N×C×H×W (grey repeated, other channel counts averaged) or vectors N×d."""
    a = np.clip(np.nan_to_num(np.asarray(a, dtype=np.float32), nan=0.0), 0.0, 1.0)
    if a.ndim == 2:  # vector data: one grey row per sample
        a = a[:, None, None, :]
    if a.shape[1] not in (1, 3):
        a = a.mean(axis=1, keepdims=True)
    return np.repeat(a, 3, axis=1) if a.shape[1] == 1 else a


def strip(images: np.ndarray, *, columns: int | None = None, pad: int = 1) -> np.ndarray:
    """One row of images side by side on white, ``pad`` pixels above and between: (H+pad)×W'×3."""
    a = _prep(images)
    n, _, h, w = a.shape
    columns = max(columns or n, 1)
    canvas = np.ones((h + pad, columns * (w + pad) + pad, 3), dtype=np.float32)
    for i in range(min(n, columns)):
        x0 = pad + i * (w + pad)
        canvas[pad:, x0:x0 + w] = a[i].transpose(1, 2, 0)
    return canvas


def tile(originals: np.ndarray, reconstructions: np.ndarray, *, pad: int = 1) -> np.ndarray:
    """An image in [0, 1]: originals over reconstructions (same order), one column per sample."""
    n = originals.shape[0]
    rows = [strip(originals, columns=n, pad=pad), strip(reconstructions, columns=n, pad=pad)]
    bottom = np.ones((pad, rows[0].shape[1], 3), dtype=np.float32)
    return np.concatenate(rows + [bottom], axis=0)


def save_trial_files(directory: str | Path, result: TrialResult, *, png: bool = True) -> dict[str, Path]:
    """Write the trial's arrays (and a tile PNG); ``{}`` when the trial has no arrays."""
    if not result.arrays:
        return {}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = {"npz": directory / f"{result.key}.npz"}
    tmp = directory / f".{result.key}.{os.getpid()}.npz"
    np.savez_compressed(tmp, **result.arrays)
    os.replace(tmp, files["npz"])
    # token ids (a text trial) have no picture: the report shows their sentences
    if (png and "x" in result.arrays and "reconstruction" in result.arrays
            and np.issubdtype(np.asarray(result.arrays["x"]).dtype, np.floating)):
        from matplotlib.image import imsave

        arrays = result.arrays
        matched = arrays["reconstruction"][arrays["order"]] if "order" in arrays else arrays["reconstruction"]
        files["png"] = directory / f"{result.key}.png"
        image = tile(arrays["x"], matched)
        scale = max(1, 64 // max(1, image.shape[0] // 2))  # small images are upscaled (nearest) to stay visible
        imsave(files["png"], np.kron(image, np.ones((scale, scale, 1), dtype=np.float32)))
    return files


__all__ = ["tile", "save_trial_files"]
