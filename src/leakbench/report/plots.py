"""Plots of a sweep: privacy–utility (Liu et al. 2024, Figure 3), S_D per defense, comparison grids.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no global
backend change), so this works headless.  Each function writes one PNG and
returns its path.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..evaluation.images import strip
from ..evaluation.strongest import PrivacyUtilityPoint, Strongest

MARKERS = "osD^v<>PX*"


def _save(fig: Figure, path: "str | Path") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def _finite(v: Optional[float]) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def privacy_utility_plot(points: Sequence[PrivacyUtilityPoint], path: "str | Path") -> Optional[Path]:
    """Best-attack RMSE against utility loss, a point per defense setting and batch size (Figure 3).

    Left: increase of the final training loss; right: drop of test accuracy.  Colour = defense family,
    marker = batch size; a hollow marker of the same colour is the lower bound where one was computed.
    ``None`` when no point has a utility loss (the sweep had no utility section).
    """
    axes_spec = [("train_loss_increase", "training-loss increase (utility loss)"),
                 ("accuracy_drop", "test-accuracy drop (utility loss)")]
    usable = [p for p in points if _finite(p.rmse) and any(_finite(getattr(p, k)) for k, _ in axes_spec)]
    if not usable:
        return None
    families = sorted({p.family for p in usable})
    sizes = sorted({p.batch_size for p in usable})
    colours = {f: f"C{i % 10}" for i, f in enumerate(families)}
    markers = {b: MARKERS[i % len(MARKERS)] for i, b in enumerate(sizes)}
    fig = Figure(figsize=(11, 4.6))
    for i, (key, label) in enumerate(axes_spec):
        ax = fig.add_subplot(1, 2, i + 1)
        for p in usable:
            x = getattr(p, key)
            if not _finite(x):
                continue
            ax.scatter([x], [p.rmse], color=colours[p.family], marker=markers[p.batch_size], s=46, zorder=3)
            if _finite(p.bound):
                ax.scatter([x], [p.bound], facecolors="none", edgecolors=colours[p.family],
                           marker=markers[p.batch_size], s=46, zorder=2)
                ax.plot([x, x], [p.bound, p.rmse], color=colours[p.family], linewidth=0.6, alpha=0.5)
            if p.family != "none":
                ax.annotate(p.defense.split("+")[-1].partition(":")[2] or p.defense, (x, p.rmse), fontsize=7,
                            xytext=(3, 3), textcoords="offset points", color="0.3")
        ax.set_xlabel(label)
        ax.set_ylabel("best-attack RMSE (S_D; higher = better defense)")
        ax.grid(True, alpha=0.3)
    handles = [fig.axes[0].scatter([], [], color=colours[f], marker="o", label=f) for f in families]
    handles += [fig.axes[0].scatter([], [], color="0.4", marker=markers[b], label=f"B = {b}") for b in sizes]
    if any(_finite(p.bound) for p in usable):
        handles.append(fig.axes[0].scatter([], [], facecolors="none", edgecolors="0.4", label="lower bound"))
    fig.legend(handles=handles, loc="upper center", ncol=min(8, len(handles)), fontsize=8, frameon=False)
    fig.subplots_adjust(top=0.84, bottom=0.12, left=0.07, right=0.98, wspace=0.22)
    return _save(fig, path)


def strongest_plot(best: Sequence[Strongest], path: "str | Path") -> Optional[Path]:
    """S_D (best-attack RMSE) per defense setting, one line per batch size (and dataset/model)."""
    usable = [s for s in best if _finite(s.rmse)]
    if not usable:
        return None
    defenses = list(dict.fromkeys(s.defense for s in best))
    series: dict[str, dict[str, float]] = {}
    for s in usable:
        series.setdefault(f"{s.dataset} {s.model} B={s.batch_size}", {})[s.defense] = s.rmse
    fig = Figure(figsize=(max(6.0, 0.55 * len(defenses) + 2), 4.2))
    ax = fig.add_subplot(1, 1, 1)
    xs = np.arange(len(defenses))
    for i, (name, values) in enumerate(series.items()):
        ys = [values.get(d, np.nan) for d in defenses]
        ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], label=name)
    ax.set_xticks(xs)
    ax.set_xticklabels(defenses, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("best-attack RMSE (S_D)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(bottom=0.3, left=0.1, right=0.98, top=0.95)
    return _save(fig, path)


def comparison_grid(originals: np.ndarray, rows: Mapping[str, Optional[np.ndarray]], path: "str | Path", *,
                    title: str = "", max_columns: int = 8) -> Path:
    """Originals (top row) and each attack's matched reconstruction (one row per attack, labelled).

    ``rows`` maps a row label (attack and its RMSE) to reconstructions in the originals' order, or ``None``
    for an attack that did not run there (drawn as a blank row).
    """
    originals = originals[:max_columns]
    n = originals.shape[0]
    strips = [strip(originals, columns=n)]
    labels = ["original"]
    for label, images in rows.items():
        strips.append(strip(np.ones_like(originals) if images is None else images[:max_columns], columns=n))
        labels.append(label)
    canvas = np.concatenate(strips + [np.ones((1, strips[0].shape[1], 3), dtype=np.float32)], axis=0)
    height = canvas.shape[0]
    cell, label_w, top = 0.9, 2.2, (0.45 if title else 0.1)
    width_in, height_in = max(4.8, label_w + cell * n + 0.15), cell * len(strips) + top + 0.1
    fig = Figure(figsize=(width_in, height_in))
    ax = fig.add_axes((label_w / width_in, 0.1 / height_in, cell * n / width_in, cell * len(strips) / height_in))
    ax.imshow(canvas, interpolation="nearest", aspect="auto")
    step = height / len(strips)
    ax.set_yticks([step * (i + 0.5) for i in range(len(strips))])
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


__all__ = ["privacy_utility_plot", "strongest_plot", "comparison_grid"]
