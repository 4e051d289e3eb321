"""Reporting: image grids, metric tables and the HTML report of a sweep.

- :func:`save_grid` — originals (top) vs reconstructions (bottom) as a PNG,
  with per-column PSNR captions.
- :func:`metrics_table` — the mean scores of :func:`leakbench.compare` as a
  small markdown table.
- :func:`write_report` — the static HTML report of a sweep (tables, plots,
  image grids, CSV/Parquet export).

This package may read every stage to its left (metrics, attacks, ...).
"""
from __future__ import annotations

from .grid import BOX_PX, COLUMN_PX, MAX_COLUMNS, ROW_PAIR_PX, grid_size, save_grid
from .html import ReportFiles, write_report
from .tables import METRIC_ROWS, format_metric, metrics_table

__all__ = ["write_report", "ReportFiles", "save_grid", "grid_size", "metrics_table", "format_metric", "METRIC_ROWS",
           "COLUMN_PX", "ROW_PAIR_PX", "MAX_COLUMNS", "BOX_PX"]
