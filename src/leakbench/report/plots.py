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
from matplotlib.colors import ListedColormap
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..evaluation.verdicts.rules import PrivacyUtilityPoint, pareto_front
from ..evaluation.verdicts.strongest import Strongest
from ..evaluation.verdicts.rows import finite

MARKERS = "osD^v<>PX*hp"
#: the legend label of the Cramér–Rao value (it bounds unbiased estimators only).
CRAMER_RAO = "Cramér–Rao bound (unbiased estimators)"
#: the S_D heatmap's colour of a setting that stops every attack (one class, outside the RMSE scale).
STOPS_COLOUR = "#b9d3ea"
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


def sd_heatmap(best: Sequence[Strongest], path: str | Path, *, title: str = "", metric: str = "RMSE") -> Path | None:
    """S_D as a heatmap: defense settings (rows) × batch sizes (columns), colour and text = best-attack RMSE.

    Red = low S_D (the strongest attack reconstructs well: the setting leaks); the scale runs from 0 to
    :data:`HEAT_TOP` or the largest value.  A setting that *stops every attack* (none significantly below
    chance) is one pale-blue class (:data:`STOPS_COLOUR`) whatever its RMSE — a diverged image far above chance is not "safer" than
    one at chance.  Each cell names the attack and the n (batches) it rests on.  A setting where no attack
    produced a usable result is grey and reads "none ran".  ``None`` when ``best`` is empty.
    """
    if not best:
        return None
    defenses = list(dict.fromkeys(s.defense for s in best))
    sizes = sorted({s.batch_size for s in best})
    grid = np.full((len(defenses), len(sizes)), np.nan)
    names: dict[tuple[int, int], str] = {}
    for s in best:
        i, j = defenses.index(s.defense), sizes.index(s.batch_size)
        value = s.sd.mean if s.sd.n else s.rmse
        if finite(value):
            grid[i, j] = value
            names[i, j] = plain(s.attack or "") + f"\nn = {s.sd.n}" + ("\nstops every attack" if s.stops else "")
            if s.stops:
                grid[i, j] = np.inf  # one class: not significantly below chance, whatever the RMSE
    stops = np.isposinf(grid)
    shown = np.where(stops, np.nan, grid)
    top = max(HEAT_TOP, float(np.nanmax(shown)) if np.isfinite(shown).any() else 0.0)
    values = {(s_.defense, s_.batch_size): (s_.sd.mean if s_.sd.n else s_.rmse) for s_ in best}
    fig = Figure(figsize=(max(4.5, 1.6 * len(sizes) + 2.6), max(2.8, 0.42 * len(defenses) + 1.4)))
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["RdYlGn"].with_extremes(bad="0.85")
    image = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, vmin=0.0, vmax=top, aspect="auto")
    if stops.any():  # one colour for every setting that stops the attacks: higher RMSE there is not "safer"
        ax.imshow(np.ma.masked_where(~stops, np.ones_like(grid)), cmap=ListedColormap([STOPS_COLOUR]),
                  vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(len(defenses)):
        for j in range(len(sizes)):
            v = grid[i, j]
            raw = values.get((defenses[i], sizes[j]), math.nan)
            text = f"{raw:.3f}\n{names[i, j]}" if (i, j) in names else "none ran"
            dark = math.isfinite(v) and not 0.2 < v / top < 0.8  # the ends of RdYlGn are dark
            ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color="white" if dark else "black")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"B = {b}" for b in sizes], fontsize=8)
    ax.set_yticks(range(len(defenses)))
    ax.set_yticklabels([plain(d) for d in defenses], fontsize=8)
    fig.colorbar(image, ax=ax, label=f"best-attack {metric}\n(higher = leaks less)", fraction=0.05)
    if title:
        ax.set_title(plain(title), fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def pareto_plot(points: Sequence[PrivacyUtilityPoint], path: str | Path, *, title: str = "",
                metric: str = "RMSE") -> Path | None:
    """Figure 3 as small multiples: one panel per batch size, S_D against utility loss, both with 95 % intervals.

    Marker = defense family; the Pareto front of each panel (settings no other beats in both higher S_D and lower
    utility loss) is a step line, and only its points are labelled.  Diverged settings have no utility loss:
    they are listed under their panel ("diverged: …"), never placed on the axis.  A dashed line marks the chance
    RMSE (S_D is capped there).  ``x`` markers are the Cramér–Rao value where one was computed.  ``None`` when no
    point has both a finite S_D and a measured utility loss.
    """
    usable = [p for p in points if finite(p.rmse) and finite(p.utility_loss)]
    if not usable:
        return None
    families = list(dict.fromkeys(p.family for p in points if finite(p.rmse)))
    sizes = sorted({p.batch_size for p in usable})
    markers = {f: MARKERS[i % len(MARKERS)] for i, f in enumerate(families)}
    colours = {f: f"C{i % 10}" for i, f in enumerate(families)}
    cols = min(3, len(sizes))
    rows = math.ceil(len(sizes) / cols)
    fig = Figure(figsize=(4.4 * cols + 0.6, 3.9 * rows + 0.4))
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(len(sizes))]
    for ax, b in zip(axes, sizes):
        mine = [p for p in usable if p.batch_size == b]
        front = pareto_front(mine)
        on_front = {id(p) for p in front}
        lows = [p.utility.interval.low if p.utility.interval.known else p.utility_loss for p in mine]
        highs = [p.utility.interval.high if p.utility.interval.known else p.utility_loss for p in mine]
        right = max(highs) if highs else 0.0
        right = right + 0.05 * max(abs(right), 0.05)
        xs = [p.utility_loss for p in front] + [right]
        ys = [p.rmse for p in front] + [front[-1].rmse]
        ax.step(xs, ys, where="post", color="0.35", linewidth=1.1, alpha=0.8, zorder=1)
        for p, lo, hi in zip(mine, lows, highs):
            y_lo = p.rmse - p.sd.low if p.sd.known else 0.0
            y_hi = p.sd.high - p.rmse if p.sd.known else 0.0
            ax.errorbar([p.utility_loss], [p.rmse], xerr=[[p.utility_loss - lo], [hi - p.utility_loss]],
                        yerr=[[max(y_lo, 0.0)], [max(y_hi, 0.0)]], fmt=markers[p.family], color=colours[p.family],
                        markersize=6, elinewidth=0.8, capsize=2, zorder=3,
                        markerfacecolor="none" if id(p) not in on_front else colours[p.family])
            if finite(p.bound):
                ax.scatter([p.utility_loss], [p.bound], color=colours[p.family], marker="x", s=24, zorder=2)
            if id(p) in on_front:
                ax.annotate(plain(p.defense), (p.utility_loss, p.rmse), fontsize=7, xytext=(4, 4),
                            textcoords="offset points", color="0.15")
        chance = [p.chance_rmse for p in mine if finite(p.chance_rmse)]
        if chance:
            ax.axhline(float(np.mean(chance)), color="0.5", linestyle="--", linewidth=0.9, zorder=0)
        ax.axvline(0.0, color="0.8", linewidth=0.8, zorder=0)
        n = max((p.sd.n for p in mine), default=0)
        ax.set_title(f"B = {b} (n = {n} batches per point)", fontsize=9)
        ax.set_xlabel("utility loss (nats, paired by seed)", fontsize=8)
        ax.set_ylabel(f"S_D: best-attack {metric} (higher = leaks less)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        gone = [p for p in points if p.batch_size == b and p.diverged]
        if gone:
            ax.text(0.0, -0.17, plain("diverged (off-axis): " + ", ".join(dict.fromkeys(p.defense for p in gone))),
                    transform=ax.transAxes, fontsize=7, color="C3", va="top", wrap=True)
    handles = [fig.axes[0].scatter([], [], color=colours[f], marker=markers[f], label=plain(f)) for f in families]
    handles.append(fig.axes[0].plot([], [], color="0.35", label="Pareto front (filled, labelled)")[0])
    handles.append(fig.axes[0].plot([], [], color="0.5", linestyle="--", label=f"chance {metric} (S_D capped)")[0])
    if any(finite(p.bound) for p in usable):
        handles.append(fig.axes[0].scatter([], [], color="0.4", marker="x", label=CRAMER_RAO))
    fig.legend(handles=handles, fontsize=7, loc="lower center", ncol=min(len(handles), 6), frameon=False)
    if title:
        fig.suptitle(plain(title), fontsize=10)
    height = 3.9 * rows + 0.4
    fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.55 / height, bottom=1.25 / height, wspace=0.3,
                        hspace=0.55)
    return _save(fig, path)


#: line styles of the ROC curves, in turn (the chance diagonal is thin, grey and dashed).
ROC_STYLES = ("-", (0, (6, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)), (0, (3, 1, 1, 1, 1, 1)))


def roc_plot(curves: Sequence[tuple[str, np.ndarray, np.ndarray]], path: str | Path, *,
             title: str = "", loglog: bool = False) -> Path | None:
    """ROC curves of membership attacks on a log-scale FPR axis (``loglog``: both axes, as Carlini et al. 2022
    Fig. 1 draw them, so the low-FPR regime is readable), with the chance diagonal.

    ``curves``: (label, FPR, TPR).  FPR = 0 cannot be drawn on a log axis: the axis starts at the smallest
    positive FPR of any curve (1 / non-members).  Curves that lie on top of each other stay distinguishable: each
    has its own colour, line style (:data:`ROC_STYLES`) and marker, and with more than one curve a row of small
    multiples (one panel per curve, the others in light grey) follows the overlay.  ``None`` when ``curves`` is
    empty.
    """
    if not curves:
        return None
    low = min((float(f[f > 0].min()) for _, f, _ in curves if (f > 0).any()), default=1e-3)
    low = min(low, 0.1)  # curves whose only positive FPR is 1 (every score tied) still get an axis
    low_tpr = min((float(t[t > 0].min()) for _, _, t in curves if (t > 0).any()), default=low)
    low_y = min(low, low_tpr)
    many = len(curves) > 1
    cols = min(len(curves), 4)
    small_rows = math.ceil(len(curves) / cols) if many else 0
    fig = Figure(figsize=(max(6.2, 2.6 * cols), 4.8 + 2.5 * small_rows))
    grid = fig.add_gridspec(1 + small_rows, cols, height_ratios=[4.8] + [2.5] * small_rows)
    chance = np.logspace(math.log10(low), 0, 50)

    def draw(ax, i: int, label: str | None, fpr: np.ndarray, tpr: np.ndarray, **style: Any) -> None:
        keep = (fpr > 0) & (tpr > 0) if loglog else fpr > 0
        n = int(keep.sum())
        ax.plot(fpr[keep], tpr[keep], color=style.pop("color", f"C{i % 10}"), label=label,
                linestyle=style.pop("linestyle", ROC_STYLES[i % len(ROC_STYLES)]),
                marker=style.pop("marker", MARKERS[i % len(MARKERS)]), markersize=style.pop("markersize", 5),
                markevery=(i % 5, max(1, n // 8)) if n else None, linewidth=style.pop("linewidth", 1.6), **style)

    def frame(ax, size: int) -> None:
        ax.plot(chance, chance, color="0.55", linestyle="--", linewidth=0.9, label="chance (TPR = FPR)")
        ax.set_xscale("log")
        ax.set_xlim(low, 1.0)
        if loglog:
            ax.set_yscale("log")
            ax.set_ylim(low_y, 1.05)
        else:
            ax.set_ylim(0.0, 1.02)
        ax.grid(True, alpha=0.3, which="both")
        ax.tick_params(labelsize=size)

    ax = fig.add_subplot(grid[0, :])
    for i, (label, fpr, tpr) in enumerate(curves):
        draw(ax, i, plain(label), fpr, tpr)
    frame(ax, 9)
    ax.set_xlabel("false-positive rate (log scale)")
    ax.set_ylabel("true-positive rate" + (" (log scale)" if loglog else ""))
    ax.legend(fontsize=7, loc="upper left")
    if title:
        ax.set_title(plain(title), fontsize=9)
    for i, (label, fpr, tpr) in enumerate(curves if many else []):
        small = fig.add_subplot(grid[1 + i // cols, i % cols])
        for j, (_, f_other, t_other) in enumerate(curves):
            if j != i:
                draw(small, j, None, f_other, t_other, color="0.82", linestyle="-", marker="", linewidth=1.0)
        draw(small, i, None, fpr, tpr)
        frame(small, 6)
        small.set_title(plain(label), fontsize=7)
    if loglog:  # fixed margins: tight_layout measures every log tick label (≈ 1.5 s a figure)
        height = 4.8 + 2.5 * small_rows
        fig.subplots_adjust(left=0.12, right=0.98, top=1 - 0.45 / height, bottom=0.55 / height, hspace=0.6,
                            wspace=0.3)
    else:
        fig.tight_layout()
    return _save(fig, path)


__all__ = ["plain", "sd_heatmap", "pareto_plot", "roc_plot", "CRAMER_RAO", "ROC_STYLES"]
