"""save_grid writes PNGs of a known pixel size; metrics_table formats the mean scores."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.report import COLUMN_PX, MAX_COLUMNS, ROW_PAIR_PX, metrics_table, save_grid


def _pixels(path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("count", [1, 3])
def test_grid_pixel_size(tmp_path, channels, count):
    x = torch.rand(count, channels, 16, 16)
    path = save_grid(tmp_path / "grid.png", x, x.flip(0), titles=[f"c{i}" for i in range(count)])
    assert _pixels(path).shape == (ROW_PAIR_PX, count * COLUMN_PX, 3)


def test_grid_wraps_wide_batches(tmp_path):
    x = torch.rand(MAX_COLUMNS + 2, 3, 8, 8)
    path = save_grid(tmp_path / "grid.png", x, x)
    assert _pixels(path).shape == (2 * ROW_PAIR_PX, MAX_COLUMNS * COLUMN_PX, 3)


def test_grid_shows_colour_and_clips(tmp_path):
    red = torch.zeros(1, 3, 16, 16)
    red[:, 0] = 5.0  # clipped to 1
    pixels = _pixels(save_grid(tmp_path / "red.png", red, red, scores=[200.0]))
    pure_red = (pixels[..., 0] == 255) & (pixels[..., 1] == 0) & (pixels[..., 2] == 0)
    assert pure_red.sum() > 2 * 50 * 50  # both panels drawn in saturated red


def test_grid_scales_images_by_nearest_neighbour(tmp_path):
    """A 4×4 checkerboard of red and blue fills its BOX_PX square in blocks of pure colour, nothing blended."""
    from leakbench.report import BOX_PX

    checker = torch.zeros(1, 3, 4, 4)
    board = (torch.arange(4)[:, None] + torch.arange(4)[None, :]) % 2 == 0
    checker[0, 0][board], checker[0, 2][~board] = 1.0, 1.0
    pixels = _pixels(save_grid(tmp_path / "checker.png", checker, checker, scores=[200.0]))
    red = ((pixels[..., 0] == 255) & (pixels[..., 1] == 0) & (pixels[..., 2] == 0)).sum()
    blue = ((pixels[..., 0] == 0) & (pixels[..., 1] == 0) & (pixels[..., 2] == 255)).sum()
    assert red == blue == 2 * BOX_PX * BOX_PX // 2  # two panels, half of each square in either colour


def test_grid_accepts_compare_scores_and_vectors(tmp_path):
    x = torch.rand(2, 1, 8, 8)
    scores = lb.compare(x.flip(0), x)
    assert scores["order"] == [1, 0]
    save_grid(tmp_path / "matched.png", x, x.flip(0), scores=scores)
    v = np.random.default_rng(0).normal(size=(2, 20)).astype(np.float32)
    assert _pixels(save_grid(tmp_path / "vectors.png", v, v + 0.1)).shape == (ROW_PAIR_PX, 2 * COLUMN_PX, 3)


def test_grid_titles_with_dollars_are_literal(tmp_path):
    x = torch.rand(2, 1, 8, 8)
    path = save_grid(tmp_path / "dollar.png", x, x, titles=["x$^$y", "a$b$c"])  # "x$^$y" crashes mathtext
    assert _pixels(path).shape == (ROW_PAIR_PX, 2 * COLUMN_PX, 3)


def test_grid_rejects_mismatched_inputs(tmp_path):
    with pytest.raises(ConfigError, match="per-sample shape"):
        save_grid(tmp_path / "g.png", torch.rand(2, 1, 8, 8), torch.rand(2, 1, 6, 6))
    with pytest.raises(ConfigError, match="titles"):
        save_grid(tmp_path / "g.png", torch.rand(2, 1, 8, 8), torch.rand(2, 1, 8, 8), titles=["a"])
    with pytest.raises(ConfigError, match="N×C×H×W"):
        save_grid(tmp_path / "g.png", torch.rand(2, 8, 8), torch.rand(2, 8, 8))


def test_metrics_table():
    x = torch.rand(2, 3, 8, 8)
    table = metrics_table({**lb.compare(x * 0.9, x), "seconds": 1.5})
    lines = table.strip().splitlines()
    assert lines[0].startswith("| metric") and set(lines[1]) <= set("|-:")
    assert len(lines) == 2 + 6 + 1  # the six columns, then the registered scores compare computed (registered PSNR)
    assert "registered PSNR" in table
    assert "PSNR" in table and "n/a" in table  # label accuracy without labels
    assert "| seconds" in table and "1.50" in table
