"""Reporting: image grids and metric tables (the HTML report lands here later).

- :func:`save_grid` — originals (top) vs reconstructions (bottom) as a PNG,
  with per-column PSNR captions.
- :func:`metrics_table` — the mean scores of :func:`leakbench.compare` as a
  small markdown table.

This package may read every stage to its left (metrics, attacks, ...).
"""
from __future__ import annotations

from .grid import COLUMN_PX, MAX_COLUMNS, ROW_PAIR_PX, grid_size, save_grid
from .tables import METRIC_ROWS, format_metric, metrics_table

__all__ = ["save_grid", "grid_size", "metrics_table", "format_metric", "METRIC_ROWS",
           "COLUMN_PX", "ROW_PAIR_PX", "MAX_COLUMNS"]
