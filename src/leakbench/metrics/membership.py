"""Membership-inference scores: ROC AUC, TPR at a fixed FPR, accuracy at a threshold.

Pure functions of per-point scores (higher = "more likely a member") and the true
membership (bool per point).  ``tpr_at_fpr`` reads the ROC curve the way the
membership-inference literature reports low-FPR operating points: the largest TPR
among thresholds whose FPR does not exceed the target (0 when none does).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError

__all__ = ["roc_auc", "tpr_at_fpr", "accuracy_at", "membership_scores", "MembershipScores"]


def _arrays(scores: object, members: object) -> tuple[np.ndarray, np.ndarray]:
    def to_np(v: object, field: str) -> np.ndarray:
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu().numpy()
        try:
            return np.asarray(v).reshape(-1)
        except (TypeError, ValueError):
            raise ConfigError(f"expected a 1-D array or tensor, got {type(v).__name__} (field {field})") from None

    s = to_np(scores, "scores").astype(np.float64)
    m = to_np(members, "members")
    if s.shape != m.shape or s.size == 0:
        raise ConfigError(f"expected one membership flag per score, got {s.size} scores and {m.size} flags "
                          "(fields scores, members)")
    if not set(np.unique(m).tolist()) <= {0, 1}:  # True == 1, False == 0
        raise ConfigError("expected members as booleans (True = in the training set) (field members)")
    m = m.astype(bool)
    if m.all() or not m.any():
        raise ConfigError("expected both members and non-members among the points (field members)")
    if not np.isfinite(s).all():
        raise ConfigError("expected finite scores (field scores)")
    return s, m


def roc_auc(scores: object, members: object) -> float:
    """Area under the ROC curve of ``scores`` for separating members from non-members."""
    from sklearn.metrics import roc_auc_score

    s, m = _arrays(scores, members)
    return float(roc_auc_score(m, s))


def tpr_at_fpr(scores: object, members: object, fpr: float) -> float:
    """The largest true-positive rate over thresholds whose false-positive rate is ≤ ``fpr``."""
    from sklearn.metrics import roc_curve

    if not 0 <= fpr <= 1:
        raise ConfigError(f"expected fpr in [0, 1], got {fpr!r} (field fpr)")
    s, m = _arrays(scores, members)
    f, t, _ = roc_curve(m, s)
    ok = f <= fpr + 1e-12
    return float(t[ok].max()) if ok.any() else 0.0


def accuracy_at(scores: object, members: object, threshold: float) -> float:
    """Fraction of points classified correctly by "member iff score ≥ threshold"."""
    s, m = _arrays(scores, members)
    return float(((s >= threshold) == m).mean())


@dataclass
class MembershipScores:
    """AUC, TPR at 1 % and 0.1 % FPR, and (when a threshold is given) accuracy, TPR and FPR at it."""

    auc: float
    tpr_at_1: float
    tpr_at_01: float
    accuracy: float | None = None
    tpr: float | None = None
    fpr: float | None = None
    threshold: float | None = None


def membership_scores(scores: object, members: object, *, threshold: float | None = None) -> MembershipScores:
    """Every membership metric at once (accuracy/TPR/FPR at ``threshold`` when given)."""
    s, m = _arrays(scores, members)
    out = MembershipScores(auc=roc_auc(s, m), tpr_at_1=tpr_at_fpr(s, m, 0.01), tpr_at_01=tpr_at_fpr(s, m, 0.001))
    if threshold is not None:
        pred = s >= threshold
        out.accuracy = float((pred == m).mean())
        out.tpr = float(pred[m].mean())
        out.fpr = float(pred[~m].mean())
        out.threshold = float(threshold)
    return out
