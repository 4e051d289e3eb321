"""Metric tables: the mean scores of :func:`leakbench.compare` as markdown."""
from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from ..metrics.scores import SCORES, MetricInfo

#: how the attack's time is shown beside the scores.
SECONDS = MetricInfo("seconds", higher_is_better=False, fmt=".2f")

#: (key in the compare dict, row label) in display order, generated from :data:`leakbench.metrics.SCORES`;
#: keys absent or None are shown as "n/a".
METRIC_ROWS: tuple[tuple[str, str], ...] = (
    *((name, info.label) for name, info in SCORES.items() if info.column),
    ("seconds", SECONDS.label),
)

__all__ = ["METRIC_ROWS", "format_metric", "metrics_table"]


def format_metric(key: str, value: Any) -> str:
    """One metric value as text in its registered format (2 decimals for PSNR and seconds, 4 significant digits
    else); "n/a" for None."""
    info = SECONDS if key == "seconds" else SCORES.get(key, MetricInfo(key, higher_is_better=False))
    return info.format(value)


def metrics_table(scores: Mapping[str, Any]) -> str:
    """A markdown table ``| metric | value |`` of the mean scores in ``scores`` (a compare dict).

    Rows follow :data:`METRIC_ROWS`; ``lpips`` is added when it was computed.
    ``seconds`` appears when the dict carries it (the CLI adds the attack's time).
    """
    rows = [(label, format_metric(key, scores.get(key))) for key, label in METRIC_ROWS
            if key != "seconds" or "seconds" in scores]
    extra = [name for name, info in SCORES.items() if not info.column]
    rows += [(SCORES[name].label, format_metric(name, scores[name])) for name in extra if scores.get(name) is not None]
    width = max(len("metric"), *(len(r[0]) for r in rows))
    vwidth = max(len("value"), *(len(r[1]) for r in rows))
    lines = [f"| {'metric':<{width}} | {'value':>{vwidth}} |", f"|{'-' * (width + 2)}|{'-' * (vwidth + 1)}:|"]
    lines += [f"| {label:<{width}} | {value:>{vwidth}} |" for label, value in rows]
    return "\n".join(lines) + "\n"
