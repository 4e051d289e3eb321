"""Metric tables: the mean scores of :func:`leakbench.compare` as markdown."""
from __future__ import annotations

import math
from typing import Any, Mapping

#: (key in the compare dict, row label) in display order; keys absent or None are shown as "n/a".
METRIC_ROWS: tuple[tuple[str, str], ...] = (
    ("mse", "MSE"),
    ("rmse", "RMSE"),
    ("psnr", "PSNR (dB)"),
    ("ssim", "SSIM"),
    ("label_acc", "label accuracy"),
    ("seconds", "seconds"),
)

__all__ = ["METRIC_ROWS", "format_metric", "metrics_table"]


def format_metric(key: str, value: Any) -> str:
    """One metric value as text: "n/a" for None, 2 decimals for PSNR and seconds, 4 significant digits else."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if key in ("psnr", "seconds"):
        return f"{value:.2f}"
    return f"{value:.4g}"


def metrics_table(scores: Mapping[str, Any]) -> str:
    """A markdown table ``| metric | value |`` of the mean scores in ``scores`` (a compare dict).

    Rows follow :data:`METRIC_ROWS`; ``lpips`` is added when it was computed.
    ``seconds`` appears when the dict carries it (the CLI adds the attack's time).
    """
    rows = [(label, format_metric(key, scores.get(key))) for key, label in METRIC_ROWS
            if key != "seconds" or "seconds" in scores]
    if scores.get("lpips") is not None:
        rows.append(("LPIPS", format_metric("lpips", scores["lpips"])))
    width = max(len("metric"), *(len(r[0]) for r in rows))
    vwidth = max(len("value"), *(len(r[1]) for r in rows))
    lines = [f"| {'metric':<{width}} | {'value':>{vwidth}} |", f"|{'-' * (width + 2)}|{'-' * (vwidth + 1)}:|"]
    lines += [f"| {label:<{width}} | {value:>{vwidth}} |" for label, value in rows]
    return "\n".join(lines) + "\n"
