"""Verdict tables of trials on published weights: members recovered from weights against a control
(:class:`WeightsSummary`), membership-inference scores with their intervals (:class:`MembershipScore`), and ROC
curves."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .rows import _mean, _reason, finite

#: thresholds of the SSIM counts of a weights trial (Haim et al. report SSIM ≥ 0.4 and 0.6).
SSIM_THRESHOLDS = (0.4, 0.6)



@dataclass
class WeightsSummary:
    """Counts of one weights attack on one trained target, summed over its usable trials, with their controls.

    ``members_nn`` / ``nonmembers_nn``: training points / non-members that are the nearest neighbour (among
    both) of some reconstruction (the latter is the chance level); ``members_ssim[t]`` / ``control_ssim[t]``:
    training points matched at SSIM ≥ t by some reconstruction / by non-member images used as candidates.
    """

    dataset: str
    model: str
    defense: str
    attack: str
    trials: int = 0
    failed: int = 0
    reasons: list[str] = field(default_factory=list)
    n_train: int = 0
    n_nonmembers: int = 0
    candidates: int = 0
    diverged: int = 0
    members_nn: int = 0
    nonmembers_nn: int = 0
    members_ssim: dict[float, int] = field(default_factory=dict)
    control_ssim: dict[float, int] = field(default_factory=dict)
    kkt_residual: float | None = None
    rows: list[Mapping[str, Any]] = field(default_factory=list)


def _int(value: Any) -> int:
    return int(value) if finite(value) else 0


def _tally(summary: Any, row: Mapping[str, Any], usable_row: bool) -> bool:
    """Count ``row`` into a weights/membership summary: a usable trial (True) or a failure with its reason."""
    if not usable_row:
        summary.failed += 1
        summary.reasons = list(dict.fromkeys([*summary.reasons, _reason(row)]))
        return False
    summary.trials += 1
    summary.rows.append(row)
    return True


def weights_table(rows: Iterable[Mapping[str, Any]]) -> list[WeightsSummary]:
    """One :class:`WeightsSummary` per (dataset, model, defense, attack) of the ``weights`` rows."""
    out: dict[tuple, WeightsSummary] = {}
    residuals: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("kind") != "weights":
            continue
        key = (r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none", r.get("attack") or "")
        s = out.setdefault(key, WeightsSummary(*key))
        m = r.get("metrics") or {}
        if not _tally(s, r, r.get("status") == "done" and finite(m.get("n_train"))):
            continue
        for name in ("n_train", "n_nonmembers", "candidates", "diverged", "members_nn", "nonmembers_nn"):
            setattr(s, name, getattr(s, name) + _int(m.get(name)))
        for t in SSIM_THRESHOLDS:
            s.members_ssim[t] = s.members_ssim.get(t, 0) + _int(m.get(f"members_ssim_{t}"))
            s.control_ssim[t] = s.control_ssim.get(t, 0) + _int(m.get(f"control_ssim_{t}"))
        if finite(m.get("kkt_residual")):
            residuals.setdefault(key, []).append(float(m["kkt_residual"]))
    for key, vals in residuals.items():
        out[key].kkt_residual = sum(vals) / len(vals)
    return list(out.values())


@dataclass
class MembershipScore:
    """A membership attack in one margin-knowledge setting: mean AUC and TPR at low FPR over usable trials."""

    dataset: str
    model: str
    defense: str
    setting: str
    auc: float | None = None
    tpr_at_1pct: float | None = None
    tpr_at_01pct: float | None = None
    members: int = 0
    nonmembers: int = 0
    trials: int = 0
    failed: int = 0
    reasons: list[str] = field(default_factory=list)
    rows: list[Mapping[str, Any]] = field(default_factory=list)


def membership_setting(row: Mapping[str, Any]) -> str:
    """The margin-knowledge setting of a membership row (``spec.options.setting``, else its attack label)."""
    options = (row.get("spec") or {}).get("options") or {}
    return str(options.get("setting") or row.get("attack") or "membership-margin")


def membership_table(rows: Iterable[Mapping[str, Any]]) -> list[MembershipScore]:
    """One :class:`MembershipScore` per (dataset, model, defense, setting) of the margin attack's ``membership``
    rows (the reference-model rows are :func:`~.membership_verdict.membership_defenses`')."""
    out: dict[tuple, MembershipScore] = {}
    values: dict[tuple, dict[str, list]] = {}
    for r in rows:
        if r.get("kind") != "membership" or ((r.get("spec") or {}).get("membership") or {}).get("form") in (
                "reference", "run"):
            continue  # reference-model rows: :mod:`.membership_verdict`
        key = (r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none", membership_setting(r))
        s = out.setdefault(key, MembershipScore(*key))
        m = r.get("metrics") or {}
        if not _tally(s, r, r.get("status") == "done" and finite(m.get("auc"))):
            continue
        s.members += _int(m.get("members"))
        s.nonmembers += _int(m.get("nonmembers"))
        for name in ("auc", "tpr_at_fpr_0.01", "tpr_at_fpr_0.001"):
            values.setdefault(key, {}).setdefault(name, []).append(m.get(name))
    for key, v in values.items():
        out[key].auc = _mean(v.get("auc", []))
        out[key].tpr_at_1pct = _mean(v.get("tpr_at_fpr_0.01", []))
        out[key].tpr_at_01pct = _mean(v.get("tpr_at_fpr_0.001", []))
    return list(out.values())


def roc_curve(scores: Any, is_member: Any) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) at every threshold on ``scores`` (higher = member), from (0, 0) to (1, 1).

    Raises ``ValueError`` unless both classes are present, lengths match and every score is finite.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    m = np.asarray(is_member).astype(bool).ravel()
    if s.shape != m.shape or not np.isfinite(s).all():
        raise ValueError(f"expected finite scores, one per is_member flag; got {s.shape} and {m.shape}")
    pos, neg = int(m.sum()), int((~m).sum())
    if pos == 0 or neg == 0:
        raise ValueError("expected members and non-members both present")
    order = np.argsort(-s, kind="stable")
    s, m = s[order], m[order]
    last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]  # the last index of each distinct score
    tp = np.cumsum(m)[last]
    fp = np.cumsum(~m)[last]
    return np.r_[0.0, fp / neg], np.r_[0.0, tp / pos]


__all__ = ["SSIM_THRESHOLDS", "WeightsSummary", "MembershipScore", "weights_table", "membership_setting", "membership_table", "roc_curve"]
