"""The verdict in words: one short sentence per threat model for the summary, and the per-B table behind it.

Every sentence carries the decision (:data:`~leakbench.evaluation.verdicts.rules.VERDICT_STATUSES`), its margin and
the n it rests on; the table gives each batch size and budget with S_D ± its interval, the utility loss ± its
interval over training seeds, the defenses tied with (or equivalent to) the pick, and those excluded because
their training diverged.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..evaluation.verdicts.stats import MIN_N, Interval
from ..evaluation.verdicts.rules import PrivacyUtilityPoint, Verdict, verdicts
from ..evaluation.verdicts.rows import finite
from .markup import MISSING, esc, hover, num, table

#: the budget whose verdict the report's summary (and the terminal) quotes.
SUMMARY_BUDGET = 0.1


def budget_text(u: float) -> str:
    return "at any utility cost" if math.isinf(u) else f"at a utility loss ≤ {u:g}"


def ci(interval: Interval, digits: int = 3) -> str:
    """``0.123 ± 0.010`` (``0.123`` without an interval, "–" when empty)."""
    if not interval.n or not finite(interval.mean):
        return MISSING
    text = num(interval.mean, digits)
    return text + (f" ± {num(interval.half_width, digits)}" if interval.known else "")


def ci_n(interval: Interval, digits: int = 3, unit: str = "n") -> str:
    """:func:`ci` followed by its n."""
    return f"{ci(interval, digits)} ({unit} = {interval.n})" if interval.n else MISSING


def _names(names: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(f"<b>{esc(n)}</b>" for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def decision(v: Verdict) -> str:
    """The decision of one verdict in a few words (HTML), with the settings at the budget's edge."""
    text = _decision(v)
    if v.edge:
        text += (f"; {'or ' if v.defense is not None and v.status != 'none' else ''}{_names(v.edge)}, whose cost "
                 "interval straddles the budget (more training seeds decide it)")
    return text


def _decision(v: Verdict) -> str:
    eps = f" (ε = {v.epsilon:.2f})" if finite(v.epsilon) else ""
    if v.status == "none" or v.defense is None:
        return "no defense fits this budget"
    if v.status == "stops":
        if v.defense == "none":
            return f"no attack run here beats chance even without a defense (n = {v.n})"
        more = f"; equivalent: {_names(v.tied)}" if v.tied else ""
        return f"<b>{esc(v.defense)}</b>{eps} stops every attack run here (n = {v.n}){more}"
    if v.status == "undecided":
        return (f"undecided: <b>{esc(v.defense)}</b> leads on n = {v.n} batch(es), too few to decide "
                f"(needs ≥ {MIN_N})")
    if v.status == "undetermined":
        return f"undetermined: <b>{esc(v.defense)}</b> leaks least here, but {esc(v.undetermined or '')}"
    if v.defense == "none":
        head = "no defense within it leaks significantly less than none"
    else:
        if v.metric == "token_error":  # text: S_D as token accuracy (1 − token error; higher = more leakage)
            from .text_section import accuracy

            sd = f"the strongest attack's token accuracy {ci(accuracy(v.sd))}"
        else:
            sd = f"S<sub>D</sub> {ci(v.sd)}"
        head = f"<b>{esc(v.defense)}</b>{eps} leaks least ({sd}, n = {v.n})"
    if v.status == "tied" and v.tied:  # (tied only at the budget's edge: :func:`decision` adds it)
        return f"{head}, tied with {_names(v.tied)}"
    if v.margin.n and not (v.status == "tied" and v.tied):
        head += f", ahead by {ci(v.margin)}"
    return head


def summary_sentence(found: Sequence[Verdict]) -> str:
    """One short sentence for one budget over the batch sizes of a (threat model, dataset, model)."""
    found = sorted(found, key=lambda v: v.batch_size)
    if not found:
        return "No setting to judge."
    u = found[0].budget
    seeds = max((v.seeds for v in found), default=0)
    how = "" if math.isinf(u) else f" (upper 95 % bound{f', {seeds} training seeds' if seeds else ''})"
    parts = [f"B = {v.batch_size}: {decision(v)}" for v in found]
    text = f"{budget_text(u)[0].upper()}{budget_text(u)[1:]}{how} — " + "; ".join(parts) + "."
    if any(v.incomplete for v in found):
        text += " " + hover("(S<sub>D</sub> is a lower bound: no gradient-matching attack ran)",
                            next(v.incomplete for v in found if v.incomplete))
    return text


def summaries(points: Sequence[PrivacyUtilityPoint]) -> dict[tuple[str, str, str], tuple[str, bool]]:
    """(threat model, dataset, model) → (:func:`summary_sentence` at :data:`SUMMARY_BUDGET`, or at any cost where
    no defense's utility was measured; whether it was measured), in first-seen order."""
    found = verdicts(points, (SUMMARY_BUDGET, math.inf))
    out = {}
    for where in dict.fromkeys((v.threat_model, v.dataset, v.model) for v in found):
        measured = any(finite(p.utility_loss) for p in points
                       if p.defense != "none" and (p.threat_model, p.dataset, p.model) == where)
        budget = SUMMARY_BUDGET if measured else math.inf
        out[where] = (summary_sentence([v for v in found if (v.threat_model, v.dataset, v.model) == where
                                        and v.budget == budget]), measured)
    return out


def verdict_table(found: Sequence[Verdict], metric: str = "RMSE") -> str:
    """Batch size × budget: the decision, S_D of the pick, its utility loss and the undefended S_D (HTML)."""
    rows = []
    for v in sorted(found, key=lambda v: (v.batch_size, v.budget)):
        excluded = "; ".join(f"{esc(d)} ({esc(why)})" for d, why in v.excluded.items()) or MISSING
        rows.append([f"B = {v.batch_size}", esc(budget_text(v.budget)), esc(v.status), decision(v),
                     ci_n(v.sd), ci_n(v.utility.interval, unit="seeds") if v.defense not in (None, "none") else "0",
                     ci_n(v.baseline_sd), num(v.chance_rmse if finite(v.chance_rmse) else v.baseline_chance),
                     excluded])
    of = "" if metric == "RMSE" else f" ({metric})"
    return table(["batch", "budget", "status", "decision", f"S_D of the pick{of} ± 95 % CI",
                  "utility loss ± 95 % CI", f"S_D without a defense{of}", f"chance {metric}", "excluded (diverged)"],
                 rows,
                 css="verdicts")


__all__ = ["SUMMARY_BUDGET", "summaries", "budget_text", "ci", "ci_n", "decision", "summary_sentence", "verdict_table"]
