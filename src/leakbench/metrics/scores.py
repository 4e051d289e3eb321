"""What each reported score is: its label, which direction is better, how it is printed, whether it is stored.

:data:`SCORES` is the one list of the batch scores :func:`leakbench.compare` reports; the results
table's columns (:mod:`leakbench.evaluation.store`), the report's tables and the CSV export are
generated from it, and each entry of the ``METRICS`` registry carries its :class:`MetricInfo`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MetricInfo", "SCORES", "BUILTIN_SCORES", "score_columns"]


@dataclass(frozen=True)
class MetricInfo:
    """Metadata of one score (as torchmetrics keeps ``higher_is_better`` on each metric class)."""

    label: str
    higher_is_better: bool
    fmt: str = ".4g"          # format spec of a value in tables
    column: bool = True       # a column of the results table (its mean over the batch)

    def format(self, value: Any) -> str:
        """``value`` as text: "n/a" for None, non-numbers and non-finite numbers as they are."""
        if value is None:
            return "n/a"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return str(value)
        return format(value, self.fmt)


#: the scores of :func:`leakbench.compare`, in display order.
SCORES: dict[str, MetricInfo] = {
    "mse": MetricInfo("MSE", higher_is_better=False),
    "rmse": MetricInfo("RMSE", higher_is_better=False),
    "psnr": MetricInfo("PSNR (dB)", higher_is_better=True, fmt=".2f"),
    "ssim": MetricInfo("SSIM", higher_is_better=True),
    "label_acc": MetricInfo("label accuracy", higher_is_better=True),
    "lpips": MetricInfo("LPIPS", higher_is_better=False, column=False),
    "psnr_registered": MetricInfo("registered PSNR (dB)", higher_is_better=True, fmt=".2f", column=False),
    "iip_pixel": MetricInfo("IIP (pixel)", higher_is_better=True, fmt=".3f", column=False),
    "iip_features": MetricInfo("IIP (features)", higher_is_better=True, fmt=".3f", column=False),
}


#: leakbench's own scores (a plug-in's metric is stored with the trial's metrics, never as a column: the store's
#: schema stays the same whatever is loaded)
BUILTIN_SCORES = frozenset(SCORES)


def score_columns() -> tuple[str, ...]:
    """The scores stored as columns of the results table, in order."""
    return tuple(name for name, info in SCORES.items() if info.column and name in BUILTIN_SCORES)
