"""The report sections of the published-weights and membership threat models.

Published weights (``kind: weights``; Haim et al. 2022's KKT reconstruction, model inversion, the univariate
attack): per (dataset, model, attack) the counts of recovered training points *beside their chance controls*
— nearest-neighbour matches of members against those of an equal number of non-members, SSIM ≥ 0.4 / 0.6
matches against non-member images used as the candidates — with candidates, diverged runs and the KKT
residual of the target.  Membership (``kind: membership``): AUC and TPR at 1 % and 0.1 % FPR per setting,
and one ROC plot with a log-scale FPR axis and the chance diagonal.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError
from ..evaluation.strongest import SSIM_THRESHOLDS, MembershipScore, WeightsSummary, finite, npz_path, roc_curve
from .attack_section import Drawn
from .grid import save_grid
from .markup import MISSING, esc, figure, hover, num, pct, slug, table
from .plots import roc_plot

EVIDENCE_NOTE = ("A count is evidence that the attack recovered training data only where it exceeds its "
                 "control (the same count for non-member images, i.e. chance); at small image sizes SSIM "
                 "thresholds alone are passed by random non-members.")


def _versus(count: int, control: int, of: int, of_control: int) -> Any:
    """"count / n vs control / n", bold where the count exceeds its control."""
    text = f"{count} / {of} vs {control} / {of_control}"
    if count > control:
        return (f"<b>{esc(text)}</b>", "evidence")
    return (hover(esc(text), "not above chance: no evidence"), "chance")


def weights_summary_line(found: Sequence[WeightsSummary]) -> str:
    """One sentence: the attack with the largest nearest-neighbour excess over its control."""
    ran = [w for w in found if w.trials]
    if not ran:
        return "no weights attack produced a usable result."
    w = max(ran, key=lambda w: (w.members_nn - w.nonmembers_nn, w.attack))
    excess = w.members_nn - w.nonmembers_nn
    verdict = "above chance" if excess > 0 else "not above chance: no evidence of reconstruction"
    return (f"best: {esc(w.attack)} on {esc(w.dataset)} · {esc(w.model)} — {w.members_nn} of {w.n_train} training "
            f"points are the nearest neighbour of a reconstruction, against {w.nonmembers_nn} of "
            f"{w.n_nonmembers} non-members (chance): {verdict}.")


def _weights_grid(w: WeightsSummary, out: Path) -> tuple[Path, str] | None:
    """Reconstructions (bottom) under their nearest training points (top), first trial with images."""
    for r in w.rows:
        npz = npz_path(r)
        if not npz or not Path(npz).is_file():
            continue
        try:
            with np.load(npz, allow_pickle=False) as arrays:
                x, rec = arrays["x"], arrays["reconstruction"]
            n = min(8, len(x), len(rec))
            x, rec = x[:n], rec[:n]
            mse = ((np.clip(np.nan_to_num(rec), 0, 1) - x) ** 2).reshape(n, -1).mean(axis=1)
            psnr = [10 * math.log10(1.0 / m) if m > 0 else math.inf for m in mse.tolist()]
            path = save_grid(out / "grids" / f"{slug('weights', w.dataset, w.model, w.defense, w.attack)}.png",
                             x, rec, scores=psnr)
        except (OSError, ValueError, KeyError, IndexError, ConfigError):
            continue
        return path, f"{w.attack} on {w.dataset} · {w.model}: nearest training point (top), reconstruction (bottom)"
    return None


def weights_section(found: Sequence[WeightsSummary], out: Path, drawn: Drawn) -> str:
    defended = any(w.defense != "none" for w in found)
    header = ["dataset", "model", *(["defense"] if defended else []), "attack", "trials",
              "nearest neighbour: members vs non-members (chance)",
              *(f"SSIM ≥ {t}: members vs control" for t in SSIM_THRESHOLDS),
              "candidates", "diverged (dropped)", "KKT residual"]
    rows = []
    for w in found:
        lead = [esc(w.dataset), esc(w.model), *([esc(w.defense)] if defended else []), esc(w.attack)]
        if not w.trials:
            rows.append([*lead, hover("failed", "; ".join(w.reasons) or "failed"),
                         *[("", "na")] * (len(header) - len(lead) - 1)])
            continue
        trials = str(w.trials) + (hover(f" (+{w.failed} failed)", "; ".join(w.reasons)) if w.failed else "")
        rows.append([*lead, trials, _versus(w.members_nn, w.nonmembers_nn, w.n_train, w.n_nonmembers),
                     *(_versus(w.members_ssim.get(t, 0), w.control_ssim.get(t, 0), w.n_train, w.n_train)
                       for t in SSIM_THRESHOLDS),
                     str(w.candidates), str(w.diverged), num(w.kkt_residual, 4)])
    parts = [f"<p>{esc(EVIDENCE_NOTE)} Counts in bold exceed their control. The KKT residual says how far the "
             "trained target is from a KKT point of the max-margin problem the reconstruction assumes (smaller = "
             f"closer; {MISSING} where it was not computed). Runs that diverged are dropped from the candidates and "
             "counted.</p>", table(header, rows, left=3 + defended)]
    grids = [g for g in (_weights_grid(w, out) for w in found) if g is not None]
    drawn.grids += [p for p, _ in grids]
    if grids:
        parts.append('<div class="grids">' + "".join(figure(p, out, c) for p, c in grids) + "</div>")
    return "".join(parts)


def _roc_arrays(score: MembershipScore) -> tuple[np.ndarray, np.ndarray] | None:
    """The ROC of a setting from its trials' ``scores`` / ``is_member`` arrays, pooled; None when absent."""
    s, m = [], []
    for r in score.rows:
        npz = npz_path(r)
        if not npz or not Path(npz).is_file():
            continue
        try:
            with np.load(npz, allow_pickle=False) as arrays:
                if "scores" in arrays and "is_member" in arrays:
                    s.append(arrays["scores"].ravel())
                    m.append(arrays["is_member"].ravel())
        except (OSError, ValueError):
            continue
    if not s:
        return None
    try:
        return roc_curve(np.concatenate(s), np.concatenate(m))
    except ValueError:
        return None


def membership_summary_line(found: Sequence[MembershipScore]) -> str:
    ran = [m for m in found if m.trials and finite(m.auc)]
    if not ran:
        return "no membership attack produced a usable result."
    m = max(ran, key=lambda m: (m.auc, m.setting))
    return (f"highest AUC {num(m.auc)} ({esc(m.setting)} on {esc(m.dataset)} · {esc(m.model)}), TPR "
            f"{pct(m.tpr_at_1pct)} at 1 % FPR (chance: 1 %).")


def membership_section(found: Sequence[MembershipScore], out: Path, drawn: Drawn) -> str:
    defended = any(m.defense != "none" for m in found)
    header = ["dataset", "model", *(["defense"] if defended else []), "setting", "AUC", "TPR at 1 % FPR",
              "TPR at 0.1 % FPR", "members", "non-members", "trials"]
    rows = []
    for m in found:
        lead = [esc(m.dataset), esc(m.model), *([esc(m.defense)] if defended else []), esc(m.setting)]
        if not m.trials:
            rows.append([*lead, (hover("failed", "; ".join(m.reasons) or "failed"), "na"),
                         *[("", "na")] * (len(header) - len(lead) - 1)])
            continue
        low = pct(m.tpr_at_01pct)
        if m.nonmembers < 1000:
            low = hover(f"{low} ‡", f"only {m.nonmembers} non-members: an FPR of 0.1 % is not resolved "
                                    f"(the smallest non-zero FPR is 1/{m.nonmembers})")
        trials = str(m.trials) + (hover(f" (+{m.failed} failed)", "; ".join(m.reasons)) if m.failed else "")
        rows.append([*lead, num(m.auc), pct(m.tpr_at_1pct), low, str(m.members), str(m.nonmembers), trials])
    parts = ["<p>Chance is AUC 0.5 and TPR = FPR (1 % at 1 % FPR). The setting says what the attacker knows of "
             "the margin distribution (known / leaked / bounded).</p>", table(header, rows, left=3 + defended)]
    for dataset, model in dict.fromkeys((m.dataset, m.model) for m in found):
        curves = []
        for m in found:
            if (m.dataset, m.model) != (dataset, model):
                continue
            roc = _roc_arrays(m)
            if roc is not None:
                label = m.setting + (f" · {m.defense}" if defended else "") + f" (AUC {num(m.auc)})"
                curves.append((label, *roc))
        path = roc_plot(curves, out / "plots" / f"roc-{slug(dataset, model)}.png", title=f"{dataset} · {model}")
        if path is not None:
            drawn.plots.append(path)
            parts.append(figure(path, out, f"ROC, {dataset} · {model} (log-scale FPR; dashed: chance)"))
    return "".join(parts)


__all__ = ["weights_section", "membership_section", "weights_summary_line", "membership_summary_line",
           "EVIDENCE_NOTE"]
