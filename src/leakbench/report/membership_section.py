"""The report's membership section for reference-model attacks (loss, LiRA, RMIA) against trained targets.

Per (dataset, model): the verdict (:func:`~leakbench.evaluation.membership.verdict.membership_verdicts`, in the
reconstruction verdict's form: decided / tied / stops, with its n and interval), a table attack × defense with
AUC ± its 95 % interval and TPR at 1 % and 0.1 % FPR (or "not measurable at n = …" below 10/FPR
non-members), TPR with no false positive, the utility cost and ε; ROC curves on log–log axes with the chance
diagonal; and for DP-SGD the audit: Opacus's ε beside the empirical lower bound of Jagielski et al. 2020
(:mod:`leakbench.evaluation.membership.audit`), with a red flag where the bound exceeds the accountant's ε.

The audit's flag takes the largest bound over the attacks of a setting, each bound at confidence
1 − 0.05/k for k bounds (Bonferroni), so a correct DP-SGD is flagged with probability at most 5 %.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..evaluation.membership.audit import epsilon_lower_bound
from ..evaluation.membership.verdict import MembershipDefense, MembershipVerdict, membership_verdicts
from ..evaluation.trials.plan import split_round
from ..evaluation.verdicts.stats import CONFIDENCE, MIN_N, Interval
from ..evaluation.verdicts.rows import finite
from ..evaluation.verdicts.weights import roc_curve
from .attack_section import Drawn
from .markup import MISSING, esc, figure, hover, muted, num, slug, table
from .plots import roc_plot
from .verdict_text import SUMMARY_BUDGET, budget_text, ci, ci_n

__all__ = ["reference_section", "rounds_table", "reference_summary", "membership_decision", "audit_rows", "BROKEN"]

#: the words of the red flag.
BROKEN = "this DP-SGD implementation is broken"


def _names(names: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(f"<b>{esc(n)}</b>" for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def membership_decision(v: MembershipVerdict) -> str:
    """The decision of one membership verdict in a few words (HTML), in the reconstruction verdict's form."""
    eps = f" (ε = {v.epsilon:.2f})" if finite(v.epsilon) else ""
    if v.status == "none" or v.defense is None:
        text = "no defense fits this budget"
    elif v.status == "stops":
        if v.defense == "none":
            text = f"no membership attack run here beats chance even without a defense (n = {v.n} points)"
        else:
            text = (f"<b>{esc(v.defense)}</b>{eps} stops every membership attack run here (n = {v.n} points)"
                    + (f"; equivalent: {_names(v.tied)}" if v.tied else ""))
    elif v.status == "undecided":
        text = f"undecided: <b>{esc(v.defense)}</b> leads on n = {v.n} point(s), too few to decide (needs ≥ {MIN_N})"
    else:
        head = ("no defense within it leaks significantly less than none" if v.defense == "none" else
                f"<b>{esc(v.defense)}</b>{eps} leaks least")
        head += f" (strongest attack {esc(v.attack)}: AUC {ci(v.auc)}, n = {v.n} points)"
        if v.status == "tied" and v.tied:
            text = f"{head}, tied with {_names(v.tied)}"
        else:
            text = head + (f", ahead by {ci(v.margin)} AUC" if v.margin.n else "")
    if v.edge:
        text += (f"; {'or ' if v.defense is not None and v.status != 'none' else ''}{_names(v.edge)}, whose cost "
                 "interval straddles the budget (more training seeds decide it)")
    return text


def _summary_verdict(defenses: Sequence[MembershipDefense], dataset: str, model: str,
                     found: Sequence[MembershipVerdict]) -> MembershipVerdict | None:
    measured = any(d.utility.mean is not None for d in defenses
                   if d.defense != "none" and (d.dataset, d.model) == (dataset, model))
    budget = SUMMARY_BUDGET if measured else math.inf
    return next((v for v in found if (v.dataset, v.model) == (dataset, model) and v.budget == budget), None)


def reference_summary(defenses: Sequence[MembershipDefense]) -> list[str]:
    """One verdict sentence per (dataset, model) for the report's summary (HTML), plus any red DP-SGD flag."""
    found = membership_verdicts(defenses, (SUMMARY_BUDGET, math.inf))
    out = []
    for dataset, model in dict.fromkeys((d.dataset, d.model) for d in defenses):
        v = _summary_verdict(defenses, dataset, model, found)
        if v is None:
            continue
        text = f"{esc(dataset)} · {esc(model)}: {budget_text(v.budget)[0].upper()}{budget_text(v.budget)[1:]} — " \
               f"{membership_decision(v)}."
        broken = [d.defense for d in defenses if (d.dataset, d.model) == (dataset, model) and _violated(d)]
        if broken:
            text += f' <span class="broken">{esc(", ".join(broken))}: {BROKEN}.</span>'
        out.append(text)
    return out


def audit_rows(d: MembershipDefense) -> list[dict[str, Any]]:
    """The DP-SGD audit of a setting: per attack (and seed) the ε lower bound at confidence 1 − 0.05/k (k
    bounds, Bonferroni), with its counts and the accountant's ε."""
    k = max(1, len(d.audits))
    level = 1 - (1 - CONFIDENCE) / k
    out = []
    for a in d.audits:
        try:
            eps, tpr, fpr = epsilon_lower_bound(int(a["audit_tp"]), int(a["audit_members"]), int(a["audit_fp"]),
                                                int(a["audit_nonmembers"]), delta=float(a["audit_delta"]),
                                                confidence=level)
        except (TypeError, ValueError, KeyError):
            continue
        out.append({**a, "bound": eps, "tpr": tpr, "fpr": fpr, "confidence": level,
                    "violated": finite(a.get("epsilon")) and eps > float(a["epsilon"])})
    return out


def _violated(d: MembershipDefense) -> bool:
    return any(r["violated"] for r in audit_rows(d)) or any(o.get("violated") for o in d.one_run.values())


def _tpr_cell(interval: Interval | None, fpr: float, nonmembers: int) -> Any:
    if interval is None:
        need = math.ceil(10 / fpr - 1e-9)
        return (hover(f"not measurable at n = {nonmembers}", f"TPR at {100 * fpr:g} % FPR needs at least {need} "
                                                           "non-members (ten false positives at that rate)"), "na")
    return f"{100 * interval.mean:.1f} % [{100 * interval.low:.1f}, {100 * interval.high:.1f}]"


def _table(defenses: Sequence[MembershipDefense]) -> str:
    header = ["defense", "attack", "AUC ± 95 % CI (n points)", "TPR at 1 % FPR [95 % CI]", "TPR at 0.1 % FPR",
              "TPR at 0 false positives", "members / non-members", "utility loss ± 95 % CI",
              "test accuracy (non-members)", "ε (Opacus)"]
    rows = []
    for d in defenses:
        for a in d.attacks:
            lead = [esc(d.defense), esc(a.attack) + (" <b>(strongest)</b>" if a is d.strongest else "")]
            if not a.trials:
                why = a.not_applicable or "; ".join(a.reasons) or "no result"
                rows.append([*lead, (hover("n/a" if a.not_applicable else "failed", why), "na"),
                             *[("", "na")] * (len(header) - 3)])
                continue
            rows.append([*lead, ci_n(a.auc), _tpr_cell(a.tpr.get(0.01), 0.01, a.nonmembers),
                         _tpr_cell(a.tpr.get(0.001), 0.001, a.nonmembers),
                         f"{100 * a.tpr0.mean:.1f} % (no false positive among {a.nonmembers})" if a.tpr0.n else MISSING,
                         f"{a.members} / {a.nonmembers}",
                         "0" if d.defense == "none" else ci_n(d.utility.interval, unit="runs"),
                         num(d.test_accuracy), num(d.epsilon, 2)])
    return table(header, rows, left=2, css="membership")


def _audit(defenses: Sequence[MembershipDefense]) -> str:
    parts = []
    for d in defenses:
        found = audit_rows(d)
        for seed, o in sorted(d.one_run.items()):
            line = (f"<b>{esc(d.defense)}</b>, one run (Steinke, Nasr &amp; Jagielski 2023): ε ≥ {num(o.get('epsilon'), 3)} "
                    f"from {o.get('correct')} of {o.get('guesses')} guesses right about {o.get('canaries')} canaries "
                    f"each trained on by a fair coin (chance: half right; {100 * float(o.get('confidence') or 0):.1f} %, "
                    f"seed {seed}), beside the accountant's ε = {num(o.get('claimed'), 3)}")
            if o.get("violated"):
                line += f' — <span class="broken">{BROKEN} (or its accounting is).</span>'
            parts.append(f"<li>{line}</li>")
        if not found:
            continue
        best = max(found, key=lambda r: r["bound"])
        claimed = best.get("epsilon")
        line = (f"<b>{esc(d.defense)}</b>: Opacus's accountant ε = {num(claimed, 3)} (δ = {best['audit_delta']:g}); "
                f"empirical lower bound ε ≥ {num(best['bound'], 3)} ({esc(best['attack'])}: TP {best['audit_tp']} of "
                f"{best['audit_members']}, FP {best['audit_fp']} of {best['audit_nonmembers']} on the held-out half, "
                f"{100 * best['confidence']:.1f} % Clopper–Pearson, the largest of {len(found)} bound(s))")
        if any(r["violated"] for r in found):
            line += (f' — <span class="broken">the empirical bound exceeds the accountant\'s ε: {BROKEN} (or its '
                     "accounting is).</span>")
        else:
            line += " — consistent with the accountant (a lower bound below ε proves nothing more)."
        parts.append(f"<li>{line}</li>")
    if not parts:
        return ""
    return ("<h4>DP-SGD audited</h4><p>An (ε, δ)-DP training bounds every membership test: "
            "ε ≥ log((TPR − δ)/FPR) (Jagielski et al. 2020), with TPR at its Clopper–Pearson lower end and FPR at "
            "its upper end, the threshold chosen on one half of the points and counted on the other.</p><ul>"
            + "".join(parts) + "</ul>")


def _pooled(a) -> tuple[np.ndarray, np.ndarray] | None:
    if not a.points:
        return None
    s = np.concatenate([v[0] for v in a.points.values()])
    m = np.concatenate([v[1] for v in a.points.values()])
    return s, m


def _rocs(defenses: Sequence[MembershipDefense], dataset: str, model: str, out: Path, drawn: Drawn) -> list[str]:
    figures = []
    mine = [d for d in defenses if (d.dataset, d.model) == (dataset, model)]
    panels = [("strongest", [(f"{d.defense} · {d.strongest.attack} (AUC {num(d.strongest.auc.mean)})", d.strongest)
                             for d in mine if d.strongest is not None]),
              ("none", [(f"{a.attack} (AUC {num(a.auc.mean)})", a) for d in mine if d.defense == "none"
                        for a in d.attacks if a.trials])]
    for name, chosen in panels:
        curves = []
        for label, a in chosen:
            pooled = _pooled(a)
            if pooled is not None:
                try:
                    curves.append((label, *roc_curve(*pooled)))
                except ValueError:
                    continue
        if not curves or (name == "none" and len(curves) < 2):
            continue
        what = ("the strongest attack per defense" if name == "strongest" else "every attack without a defense")
        path = roc_plot(curves, out / "plots" / f"roc-ref-{slug(dataset, model, name)}.png",
                        title=f"{dataset} · {model}: {what}", loglog=True)
        if path is not None:
            drawn.plots.append(path)
            figures.append(figure(path, out, f"ROC of {what}, {dataset} · {model} (log–log axes; grey dashed: "
                                             "chance, TPR = FPR)"))
    return figures


def _verdict_table(found: Sequence[MembershipVerdict]) -> str:
    rows = [[esc(budget_text(v.budget)), esc(v.status), membership_decision(v), ci_n(v.auc),
             ci_n(v.utility.interval, unit="runs") if v.defense not in (None, "none") else "0", ci_n(v.baseline)]
            for v in sorted(found, key=lambda v: v.budget)]
    return table(["budget", "status", "decision", "AUC of the pick's strongest attack",
                  "utility loss ± 95 % CI", "strongest AUC without a defense"], rows, css="verdicts")


def rounds_table(defenses: Sequence[MembershipDefense]) -> str:
    """Membership along training: per federated run (a model named "… · round t"), a table defense × round of the
    strongest attack's AUC with its interval, beside the run's test accuracy; "" when no run was attacked."""
    runs: dict[tuple[str, str], dict[tuple[str, int], MembershipDefense]] = {}
    for d in defenses:
        base, round_ = split_round(d.model)
        if round_ is not None:
            runs.setdefault((d.dataset, base), {})[(d.defense, round_)] = d
    if not runs:
        return ""
    parts = ["<h4>Membership along training</h4>",
             muted("A model named “… · round t” is the global model of a federated run at round t: the checkpoint "
                   "the reconstruction attacks of that round see. Members are the clients' samples, non-members as "
                   "many of the run's test split, attacked without reference models (a run has none); round 0 is "
                   "the untrained model, which no sample has touched: its AUC is the run's own chance control. "
                   "Each cell: the strongest attack's AUC with its 95 % interval (n = points) and the run's test "
                   "accuracy at that round; bold where the AUC lies significantly above 0.5.")]
    for (dataset, base), cells in runs.items():
        rounds = sorted({r for _, r in cells})
        rows = []
        for defense in dict.fromkeys(d for d, _ in cells):
            row: list[Any] = [esc(defense)]
            for r in rounds:
                d = cells.get((defense, r))
                if d is None or d.strongest is None or not d.strongest.trials:
                    row.append((MISSING, "na"))
                    continue
                auc = d.strongest.auc
                text = (f"{ci_n(auc, 3)}<br><small>accuracy {num(d.test_accuracy, 2)}</small>")
                row.append((text, "best" if d.strongest.beats_chance else ""))
            rows.append(row)
        parts.append(f"<p><b>{esc(dataset)} · {esc(base)}</b></p>"
                     + table(["defense", *(f"round {r}" for r in rounds)], rows))
    return "".join(parts)


def reference_section(defenses: Sequence[MembershipDefense], out: Path, drawn: Drawn) -> str:
    """The section's HTML (module docstring)."""
    trained = any(split_round(d.model)[1] is None for d in defenses)  # a reference-model entry's targets
    parts = ["<h3>Reference-model attacks (loss, LiRA, RMIA)</h3>" if trained else
             "<h3>Membership attacks on a federated run's rounds</h3>",
             "<p>Each target is trained with the recipe and the defense on a seeded half of a pool of points (its "
             "members; the other half are its non-members); reference models are trained the same way on "
             "complementary halves. Chance is AUC 0.5 and TPR = FPR. AUC with a 95 % stratified bootstrap interval "
             "over points; TPR at an FPR is given with its Clopper–Pearson interval only with at least 10 / FPR "
             "non-members (1 000 for 1 %, 10 000 for 0.1 %), otherwise <i>not measurable at n</i>. The strongest "
             "attack per defense has the highest AUC; a defense <i>stops</i> the attacks when none has AUC "
             "significantly above 0.5 (nor TPR at 1 % FPR above 1 %). The utility loss is the increase of the final "
             "training loss over the undefended run, paired over the target and its reference models (each trains "
             "with the defense).</p>" if trained else ""]
    found = membership_verdicts(defenses)
    parts.append(rounds_table(defenses))
    for dataset, model in dict.fromkeys((d.dataset, d.model) for d in defenses):
        mine = [d for d in defenses if (d.dataset, d.model) == (dataset, model)]
        here = [v for v in found if (v.dataset, v.model) == (dataset, model)]
        v = _summary_verdict(defenses, dataset, model, here)
        parts.append(f"<h4>{esc(dataset)} · {esc(model)}</h4>")
        if v is not None:
            parts.append(f'<p class="verdict"><b>Verdict</b> ({esc(budget_text(v.budget))}): '
                         f"{membership_decision(v)}.</p>")
        parts.append(_verdict_table(here))
        parts.append(_table(mine))
        parts.append(_audit(mine))
        figures = _rocs(defenses, dataset, model, out, drawn)
        if figures:
            parts.append('<div class="grids">' + "".join(figures) + "</div>")
    return "".join(parts)
