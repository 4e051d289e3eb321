"""Image grids: originals (top row) against reconstructions (bottom row).

``save_grid(path, x, rec.images, scores=lb.compare(rec, x, y))`` writes a PNG
with one column per sample and its PSNR under the reconstruction.  Figures are
drawn on matplotlib's Agg canvas directly (no pyplot, no global backend
change), so this works headless and never opens a window.

Layout: each column is :data:`COLUMN_PX` pixels wide and each original /
reconstruction pair of rows :data:`ROW_PAIR_PX` pixels high; batches wider
than ``columns`` wrap onto further row pairs.  Images (N×C×H×W) are shown with
values clipped to [0, 1]: 1 channel in grey, 3 channels in colour, any other
count as the channel mean in grey, each scaled (nearest neighbour) into a
:data:`BOX_PX` square and pasted into one pixel canvas: a grid costs one
figure and a few text labels, not two axes per sample (a report draws ~100
grids).  Vector data (N×d) is drawn as line plots of the features, original
above reconstruction.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..errors import ConfigError
from ..metrics import compare
from .plots import plain

#: dots per inch of the saved PNG.
DPI = 100
#: width of one column in pixels.
COLUMN_PX = 160
#: height of one original + reconstruction pair of rows in pixels.
ROW_PAIR_PX = 360
#: columns per row pair before the grid wraps.
MAX_COLUMNS = 8
#: side of the square each image is scaled into, in pixels.
BOX_PX = 128

__all__ = ["save_grid", "grid_size", "DPI", "COLUMN_PX", "ROW_PAIR_PX", "MAX_COLUMNS", "BOX_PX"]


def grid_size(count: int, *, columns: int = MAX_COLUMNS) -> tuple[int, int]:
    """(width, height) in pixels of the grid :func:`save_grid` draws for ``count`` samples."""
    cols = max(1, min(count, columns))
    return cols * COLUMN_PX, math.ceil(count / cols) * ROW_PAIR_PX


def _as_array(values: Any, field: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float32).numpy()
    try:
        arr = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        raise ConfigError(f"expected an array or tensor, got {type(values).__name__} (field {field})") from None
    if arr.ndim not in (2, 4) or arr.shape[0] == 0:
        raise ConfigError(f"expected a non-empty batch N×C×H×W (images) or N×d (vectors), "
                          f"got shape {arr.shape} (field {field})")
    return arr


def _pair_up(originals: np.ndarray, reconstructions: np.ndarray,
             scores: Mapping[str, Any] | Sequence[float] | None) -> tuple[np.ndarray, list[float]]:
    """Reconstructions reordered to match the originals column by column, and one PSNR per column."""
    if originals.shape[1:] != reconstructions.shape[1:]:
        raise ConfigError(f"expected reconstructions of per-sample shape {originals.shape[1:]} like the "
                          f"originals, got {reconstructions.shape[1:]} (field reconstructions)")
    if scores is None:
        scores = compare(torch.from_numpy(np.nan_to_num(reconstructions)), torch.from_numpy(originals))
    if isinstance(scores, Mapping):
        order = scores.get("order")
        if order is not None:
            reconstructions = reconstructions[np.asarray(order, dtype=np.int64)]
        psnrs = list(scores.get("per_sample", {}).get("psnr", []))
    else:
        psnrs = [float(s) for s in scores]
    n = originals.shape[0]
    if reconstructions.shape[0] != n:
        raise ConfigError(f"expected one reconstruction per original ({n}), got {reconstructions.shape[0]}; "
                          "pass scores=compare(...) so they are matched first (field reconstructions)")
    if len(psnrs) != n:
        raise ConfigError(f"expected {n} per-column scores, got {len(psnrs)} (field scores)")
    return reconstructions, psnrs


def _rgb(sample: np.ndarray) -> np.ndarray:
    """An H×W×3 array in [0, 1]: 3 channels as colour, 1 as grey, any other count as the channel mean in grey."""
    sample = np.clip(np.nan_to_num(sample, nan=0.0), 0.0, 1.0)
    img = np.transpose(sample, (1, 2, 0)) if sample.shape[0] == 3 else sample.mean(axis=0)
    return img if img.ndim == 3 else np.repeat(img[..., None], 3, axis=2)


def _plot(ax, values: np.ndarray, *, reference: np.ndarray | None = None) -> None:
    """A feature vector as a line plot (with ``reference``: the original dashed behind it, the same y-range)."""
    values = np.nan_to_num(values)
    if reference is not None:
        ax.plot(reference, color="0.6", linestyle="--", linewidth=1.0)
        both = np.concatenate([values, reference])
        low, high = float(both.min()), float(both.max())
        pad = 0.05 * (high - low) or 0.5
        ax.set_ylim(low - pad, high + pad)
    ax.plot(values, linewidth=1.0)
    ax.set_xticks([])
    ax.set_yticks([])


def _caption(value: float) -> str:
    return "PSNR n/a" if value is None or not math.isfinite(value) else f"PSNR {value:.1f} dB"


def save_grid(
    path: str | Path,
    originals: Any,
    reconstructions: Any,
    *,
    titles: Sequence[str] | None = None,
    scores: Mapping[str, Any] | Sequence[float] | None = None,
    columns: int = MAX_COLUMNS,
) -> Path:
    """Write a PNG of ``originals`` (top row) over ``reconstructions`` (bottom row).

    ``originals``/``reconstructions``: tensors or arrays N×C×H×W (or N×d).
    ``scores``: the dict of :func:`leakbench.compare` (reconstructions are
    reordered by its ``order`` and captioned with ``per_sample["psnr"]``), or
    one PSNR per column, or None to compute them here.  ``titles``: one label
    per column (e.g. class names), shown above the originals (``$`` printed literally,
    never parsed as mathtext).  Returns the path.
    """
    orig = _as_array(originals, "originals")
    rec, psnrs = _pair_up(orig, _as_array(reconstructions, "reconstructions"), scores)
    n = orig.shape[0]
    if titles is not None and len(titles) != n:
        raise ConfigError(f"expected {n} titles (one per column), got {len(titles)} (field titles)")
    if isinstance(columns, bool) or not isinstance(columns, int) or columns < 1:
        raise ConfigError(f"expected columns ≥ 1, got {columns!r} (field columns)")
    width, height = grid_size(n, columns=columns)
    cols = width // COLUMN_PX
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    if orig.ndim == 4:
        _paste_images(fig, orig, rec, psnrs, titles, cols, width, height)
        return _saved(fig, path)
    axes = fig.subplots(2 * (height // ROW_PAIR_PX), cols, squeeze=False)  # vectors: line plots on axes
    for ax in axes.flat:
        ax.set_axis_off()
    for i in range(n):
        block, col = divmod(i, cols)
        top, bottom = axes[2 * block, col], axes[2 * block + 1, col]
        top.set_axis_on()
        bottom.set_axis_on()
        _plot(top, orig[i])
        _plot(bottom, rec[i], reference=orig[i])
        top.set_ylim(bottom.get_ylim())
        top.set_title(plain(titles[i]) if titles is not None else f"#{i}", fontsize=9)
        bottom.set_xlabel(_caption(psnrs[i]), fontsize=9)
        if col == 0:
            top.set_ylabel("original", fontsize=9)
            bottom.set_ylabel("reconstruction", fontsize=9)
    fig.subplots_adjust(left=0.12 if cols == 1 else 0.06, right=0.98, top=0.93, bottom=0.06,
                        wspace=0.15, hspace=0.45)
    return _saved(fig, path)


def _saved(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, format="png")
    return out


def _scaled(sample: np.ndarray) -> np.ndarray:
    """``sample`` (C×H×W) as an RGB array fitted into a :data:`BOX_PX` square (nearest neighbour, aspect kept)."""
    rgb = _rgb(sample)
    h, w = rgb.shape[:2]
    scale = BOX_PX / max(h, w)
    rows = np.minimum((np.arange(max(1, round(h * scale))) / scale).astype(np.int64), h - 1)
    cols = np.minimum((np.arange(max(1, round(w * scale))) / scale).astype(np.int64), w - 1)
    return rgb[rows][:, cols]


def _paste_images(fig: Figure, orig: np.ndarray, rec: np.ndarray, psnrs: Sequence[float],
                  titles: Sequence[str] | None, cols: int, width: int, height: int) -> None:
    """Every original and reconstruction pasted into one white canvas (``figimage``, pixel for pixel), labels as
    figure text: per column the title above the original, the PSNR under the reconstruction."""
    canvas = np.ones((height, width, 3), dtype=np.float32)
    half = ROW_PAIR_PX // 2
    left = (COLUMN_PX - BOX_PX) // 2 + 6  # a little room on the left for the row labels of the first column
    top = 24                              # room for the title above each original (and the caption below)
    for i in range(orig.shape[0]):
        block, col = divmod(i, cols)
        for row, (sample, text) in enumerate(((orig[i], plain(titles[i]) if titles is not None else f"#{i}"),
                                              (rec[i], _caption(psnrs[i])))):
            img = _scaled(sample)
            x0 = col * COLUMN_PX + left + (BOX_PX - img.shape[1]) // 2  # centred in its box
            y0 = block * ROW_PAIR_PX + row * half + top + (BOX_PX - img.shape[0]) // 2
            canvas[y0:y0 + img.shape[0], x0:x0 + img.shape[1]] = img
            centre = (x0 + img.shape[1] / 2) / width
            if row == 0:
                fig.text(centre, 1 - (y0 - 4) / height, text, va="bottom", ha="center", fontsize=9)
            else:
                fig.text(centre, 1 - (y0 + img.shape[0] + 4) / height, text, va="top", ha="center", fontsize=9)
            if col == 0:
                fig.text(2 / width, 1 - (y0 + img.shape[0] / 2) / height, ("original", "reconstruction")[row],
                         rotation=90, va="center", ha="left", fontsize=8)
    fig.figimage(canvas, xo=0, yo=0, origin="upper")
