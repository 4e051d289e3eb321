"""Plots of a sweep: S_D heatmap, privacy–utility with its Pareto front (Liu et al. 2024, Figure 3), ROC curves.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no global
backend change), so this works headless.  Each function writes one PNG and
returns its path (or None when there is nothing to draw).  Every label drawn
goes through :func:`plain`, so a ``$`` in a user's label is printed, never
parsed as mathtext.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..evaluation.strongest import PrivacyUtilityPoint, Strongest, finite, pareto_front

MARKERS = "osD^v<>PX*hp"
#: the legend label of the Cramér–Rao value (it bounds unbiased estimators only).
CRAMER_RAO = "Cramér–Rao bound (unbiased estimators)"
#: the top of the S_D heatmap's colour scale (RMSE) unless a value exceeds it.
HEAT_TOP = 0.3


def plain(label: Any) -> str:
    """``label`` as literal text for matplotlib (``$`` escaped so mathtext never parses it)."""
    return str(label).replace("$", r"\$")


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def sd_heatmap(best: Sequence[Strongest], path: str | Path, *, title: str = "") -> Path | None:
    """S_D as a heatmap: defense settings (rows) × batch sizes (columns), colour and text = best-attack RMSE.

    Red = low RMSE (the strongest attack reconstructs well: the setting leaks), green = high; the scale runs
    from 0 to :data:`HEAT_TOP` (about what an uninformed guess scores on images in [0, 1]) or the largest
    value, so a sweep where every setting leaks stays red.  A setting where no attack produced a usable
    result is grey and reads "none ran"; "(≥ chance)" marks a strongest attack no closer than a flat image at
    the data mean.  ``None`` when ``best`` is empty.
    """
    if not best:
        return None
    defenses = list(dict.fromkeys(s.defense for s in best))
    sizes = sorted({s.batch_size for s in best})
    grid = np.full((len(defenses), len(sizes)), np.nan)
    names: dict[tuple[int, int], str] = {}
    for s in best:
        i, j = defenses.index(s.defense), sizes.index(s.batch_size)
        if finite(s.rmse):
            grid[i, j] = s.rmse
            names[i, j] = plain(s.attack or "") + ("\n(≥ chance)" if s.beats_chance is False else "")
    top = max(HEAT_TOP, float(np.nanmax(grid)) if np.isfinite(grid).any() else 0.0)
    fig = Figure(figsize=(max(4.5, 1.6 * len(sizes) + 2.6), max(2.8, 0.42 * len(defenses) + 1.4)))
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["RdYlGn"].with_extremes(bad="0.85")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=top, aspect="auto")
    for i in range(len(defenses)):
        for j in range(len(sizes)):
            v = grid[i, j]
            text = f"{v:.3f}\n{names[i, j]}" if math.isfinite(v) else "none ran"
            dark = math.isfinite(v) and not 0.2 < v / top < 0.8  # the ends of RdYlGn are dark
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"B = {b}" for b in sizes], fontsize=8)
    ax.set_yticks(range(len(defenses)))
    ax.set_yticklabels([plain(d) for d in defenses], fontsize=8)
    fig.colorbar(image, ax=ax, label="best-attack RMSE\n(higher = leaks less)", fraction=0.05)
    if title:
        ax.set_title(plain(title), fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def pareto_plot(points: Sequence[PrivacyUtilityPoint], path: str | Path, *, title: str = "") -> Path | None:
    """Best-attack RMSE against utility loss (Figure 3) with the Pareto front of each batch size.

    Marker = defense family, colour = batch size; the front (settings no other setting beats in both higher
    RMSE and lower loss) is a step line of the batch size's colour.  A utility *gain* is drawn at 0 with a
    ring around it (clamped, not a benefit).  ``x`` markers are the Cramér–Rao value where one was computed.
    ``None`` when no point has both a finite RMSE and a measured utility loss.
    """
    usable = [p for p in points if finite(p.rmse) and finite(p.utility_loss)]
    if not usable:
        return None
    families = list(dict.fromkeys(p.family for p in usable))
    sizes = sorted({p.batch_size for p in usable})
    colours = {b: f"C{i % 10}" for i, b in enumerate(sizes)}
    markers = {f: MARKERS[i % len(MARKERS)] for i, f in enumerate(families)}
    fig = Figure(figsize=(9, 5.2))
    ax = fig.add_subplot(1, 1, 1)
    right = max(p.utility_loss for p in usable)
    right = right * 1.05 if right > 0 else 0.05
    for b in sizes:
        # the front as the best RMSE reachable at each utility loss: a staircase to the right edge
        front = pareto_front(p for p in usable if p.batch_size == b)
        xs = [p.utility_loss for p in front] + [right]
        ys = [p.rmse for p in front] + [front[-1].rmse]
        ax.step(xs, ys, where="post", color=colours[b], linewidth=1.2, alpha=0.7, zorder=1)
        ax.scatter([p.utility_loss for p in front], [p.rmse for p in front], facecolors="none",
                   edgecolors=colours[b], s=110, linewidths=1.0, zorder=2)
    for p in usable:
        ax.scatter([p.utility_loss], [p.rmse], color=colours[p.batch_size], marker=markers[p.family], s=48,
                   zorder=3)
        if p.gain:
            ax.annotate("*", (p.utility_loss, p.rmse), fontsize=11, xytext=(-9, -3), textcoords="offset points",
                        color="0.1")
        if finite(p.bound):
            ax.scatter([p.utility_loss], [p.bound], color=colours[p.batch_size], marker="x", s=30, zorder=2)
        if p.family != "none":
            ax.annotate(plain(p.defense), (p.utility_loss, p.rmse), fontsize=6.5, xytext=(3, 3),
                        textcoords="offset points", color="0.3")
    ax.set_xlabel("utility loss: final training-loss increase over no defense (nats; gains clamped to 0)")
    ax.set_ylabel("best-attack RMSE (S_D; higher = leaks less)")
    ax.grid(True, alpha=0.3)
    handles = [ax.scatter([], [], color="0.4", marker=markers[f], label=plain(f)) for f in families]
    handles += [ax.plot([], [], color=colours[b], label=f"B = {b} (line: Pareto front)")[0] for b in sizes]
    handles.append(ax.scatter([], [], facecolors="none", edgecolors="0.4", s=110, label="on the Pareto front"))
    if any(p.gain for p in usable):
        handles.append(ax.scatter([], [], color="0.1", marker="$*$", s=60, label="* measured gain, clamped to 0"))
    if any(finite(p.bound) for p in usable):
        handles.append(ax.scatter([], [], color="0.4", marker="x", label=CRAMER_RAO))
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    if title:
        ax.set_title(plain(title), fontsize=9)
    fig.subplots_adjust(left=0.08, right=0.7, top=0.92, bottom=0.11)
    return _save(fig, path)


def roc_plot(curves: Sequence[tuple[str, np.ndarray, np.ndarray]], path: str | Path, *,
             title: str = "") -> Path | None:
    """ROC curves of membership attacks on a log-scale FPR axis, with the chance diagonal.

    ``curves``: (label, FPR, TPR).  FPR = 0 cannot be drawn on a log axis: the axis starts at the smallest
    positive FPR of any curve (1 / non-members).  ``None`` when ``curves`` is empty.
    """
    if not curves:
        return None
    low = min((float(f[f > 0].min()) for _, f, _ in curves if (f > 0).any()), default=1e-3)
    fig = Figure(figsize=(6.2, 4.8))
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, fpr, tpr) in enumerate(curves):
        keep = fpr > 0
        ax.plot(fpr[keep], tpr[keep], color=f"C{i % 10}", label=plain(label))  # ties: the diagonal segment
    chance = np.logspace(math.log10(low), 0, 50)
    ax.plot(chance, chance, color="0.5", linestyle="--", linewidth=1, label="chance (TPR = FPR)")
    ax.set_xscale("log")
    ax.set_xlim(low, 1.0)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("false-positive rate (log scale)")
    ax.set_ylabel("true-positive rate")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    if title:
        ax.set_title(plain(title), fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


__all__ = ["plain", "sd_heatmap", "pareto_plot", "roc_plot", "CRAMER_RAO"]
