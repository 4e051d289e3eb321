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
from ..evaluation.verdicts.stats import auc_interval, binomial, measurable_fpr
from ..evaluation.verdicts.weights import SSIM_THRESHOLDS, MembershipScore, WeightsSummary, roc_curve
from ..evaluation.verdicts.rows import finite, npz_path
from .attack_section import Drawn
from .grid import save_grid
from .markup import MISSING, esc, figure, hover, num, pct, slug, table
from .plots import roc_plot

EVIDENCE_NOTE = ("A count is evidence that the attack recovered training data only where it exceeds its "
                 "control (the same count for non-member images, i.e. chance); at small image sizes SSIM "
                 "thresholds alone are passed by random non-members.")


def _proportion(k: int, n: int) -> str:
    ci = binomial(k, n)
    return f"{k} / {n} [{ci.low:.2f}, {ci.high:.2f}]" if ci.n else f"{k} / {n}"


def excess(count: int, control: int, of: int, of_control: int) -> float:
    """One-sided p-value of Fisher's exact test: the members' rate exceeds the control's (1.0 when undefined)."""
    from scipy.stats import fisher_exact  # lazy: `import leakbench` skips scipy
    if of <= 0 or of_control <= 0:
        return 1.0
    table_ = [[count, of - count], [control, of_control - control]]
    return float(fisher_exact(table_, alternative="greater")[1])


def _versus(count: int, control: int, of: int, of_control: int) -> Any:
    """"k / n [95 % Clopper–Pearson] vs control", bold where Fisher's exact test puts the count above its control
    (one-sided p < 0.05)."""
    text = f"{_proportion(count, of)} vs {_proportion(control, of_control)}"
    p = excess(count, control, of, of_control)
    if p < 0.05:
        return (hover(f"<b>{esc(text)}</b>", f"above its control: Fisher's exact test p = {p:.3g}"), "evidence")
    return (hover(esc(text), f"not significantly above chance at this n (Fisher's exact test p = {p:.2g})"),
            "chance")


def weights_summary_line(found: Sequence[WeightsSummary]) -> str:
    """One sentence: the attack with the largest nearest-neighbour excess over its control."""
    ran = [w for w in found if w.trials]
    if not ran:
        return "no weights attack produced a usable result."
    w = min(ran, key=lambda w: (excess(w.members_nn, w.nonmembers_nn, w.n_train, w.n_nonmembers),
                                -(w.members_nn - w.nonmembers_nn), w.attack))
    p = excess(w.members_nn, w.nonmembers_nn, w.n_train, w.n_nonmembers)
    verdict = (f"above chance (Fisher's exact test p = {p:.2g})" if p < 0.05 else
               f"not significantly above chance at this n (p = {p:.2g}): no evidence of reconstruction")
    return (f"best: {esc(w.attack)} on {esc(w.dataset)} · {esc(w.model)} — {_proportion(w.members_nn, w.n_train)} "
            f"training points are the nearest neighbour of a reconstruction, against "
            f"{_proportion(w.nonmembers_nn, w.n_nonmembers)} non-members (chance; 95 % Clopper–Pearson): {verdict}.")


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


def _pooled(score: MembershipScore) -> tuple[np.ndarray, np.ndarray] | None:
    """A setting's per-example ``scores`` / ``is_member`` arrays, pooled over its trials; None when absent."""
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
    return np.concatenate(s), np.concatenate(m)


def _roc_arrays(score: MembershipScore) -> tuple[np.ndarray, np.ndarray] | None:
    """The ROC of a setting from its pooled per-example arrays; None when absent."""
    pooled = _pooled(score)
    try:
        return None if pooled is None else roc_curve(*pooled)
    except ValueError:
        return None


def _auc(score: MembershipScore):
    pooled = _pooled(score)
    try:
        return None if pooled is None else auc_interval(*pooled)
    except ValueError:
        return None


def _tpr(value: float | None, fpr: float, nonmembers: int) -> Any:
    """TPR at ``fpr`` where ≥ 10 / fpr non-members resolve it; otherwise greyed with the reason."""
    if measurable_fpr(fpr, nonmembers):
        return pct(value)
    need = math.ceil(10 / fpr - 1e-9)
    return (hover("not measurable", f"at n = {nonmembers} non-members: TPR at {100 * fpr:g} % FPR needs at least "
                                    f"{need} (ten false positives at that rate)"), "na")


def membership_summary_line(found: Sequence[MembershipScore]) -> str:
    ran = [m for m in found if m.trials and finite(m.auc)]
    if not ran:
        return "no membership attack produced a usable result."
    m = max(ran, key=lambda m: (m.auc, m.setting))
    auc = _auc(m)
    auc_text = num(m.auc) + (f" [{auc.low:.2f}, {auc.high:.2f}]" if auc is not None and auc.known else "")
    tpr = (f"TPR {pct(m.tpr_at_1pct)} at 1 % FPR (chance: 1 %)" if measurable_fpr(0.01, m.nonmembers) else
           f"TPR at 1 % FPR not measurable with {m.nonmembers} non-members (needs 1000)")
    return (f"highest AUC {auc_text} ({esc(m.setting)} on {esc(m.dataset)} · {esc(m.model)}; "
            f"{m.members} members, {m.nonmembers} non-members), {tpr}.")


def membership_section(found: Sequence[MembershipScore], out: Path, drawn: Drawn) -> str:
    defended = any(m.defense != "none" for m in found)
    header = ["dataset", "model", *(["defense"] if defended else []), "setting", "AUC [95 % CI]", "TPR at 1 % FPR",
              "TPR at 0.1 % FPR", "members", "non-members", "trials"]
    rows = []
    for m in found:
        lead = [esc(m.dataset), esc(m.model), *([esc(m.defense)] if defended else []), esc(m.setting)]
        if not m.trials:
            rows.append([*lead, (hover("failed", "; ".join(m.reasons) or "failed"), "na"),
                         *[("", "na")] * (len(header) - len(lead) - 1)])
            continue
        auc = _auc(m)
        auc_text = num(m.auc) + (f" [{auc.low:.2f}, {auc.high:.2f}]" if auc is not None and auc.known else "")
        trials = str(m.trials) + (hover(f" (+{m.failed} failed)", "; ".join(m.reasons)) if m.failed else "")
        rows.append([*lead, auc_text, _tpr(m.tpr_at_1pct, 0.01, m.nonmembers),
                     _tpr(m.tpr_at_01pct, 0.001, m.nonmembers), str(m.members), str(m.nonmembers), trials])
    parts = ["<p>Chance is AUC 0.5 and TPR = FPR (1 % at 1 % FPR). AUC with a 95 % stratified bootstrap interval "
             "over the pooled examples; a TPR at an FPR is given only with at least 10 / FPR non-members (1 000 for "
             "1 %, 10 000 for 0.1 %), otherwise it reads <i>not measurable</i>. The setting says what the attacker "
             "knows of the margin distribution (known / leaked / bounded).</p>",
             table(header, rows, left=3 + defended)]
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
            parts.append(figure(path, out, f"ROC, {dataset} · {model} (log-scale FPR; grey dashed: chance"
                                             + ("; below, one panel per setting)" if len(curves) > 1 else ")")))
    return "".join(parts)


__all__ = ["weights_section", "membership_section", "weights_summary_line", "membership_summary_line",
           "EVIDENCE_NOTE"]
