"""DP-SGD audited empirically: a lower bound on ε from a membership attack's true and false positives.

Jagielski, Ullman & Oprea (2020), "Auditing differentially private machine learning: how private is private
SGD?", Sec. 3 (Algorithm 2 and the bound after it): a mechanism M that is (ε, δ)-DP satisfies, for any test
with rejection region O run on neighbouring datasets D (with the point) and D' (without),
Pr[M(D) ∈ O] ≤ e^ε · Pr[M(D') ∈ O] + δ, so any membership test with true-positive rate TPR and false-positive
rate FPR shows

    ε ≥ log((TPR − δ) / FPR)        and, from the complementary region,        ε ≥ log((TNR − δ) / FNR).

Estimated from counts, the rates get exact Clopper–Pearson intervals (:func:`~.stats.binomial`, the intervals
Jagielski et al. use): the bound takes TPR at its interval's lower end and FPR at its upper end (and likewise
TNR, FNR), so it holds with probability at least ``confidence`` (each two-sided interval leaves (1 − c)/2 on
each side; the two ends used are a union bound).  The larger of the two bounds is reported.

A bound at a threshold chosen on the same points is optimistic (the best of many tests), so
:func:`audit_scores` chooses the threshold on a seeded half of the points and counts on the other half.
An empirical ε above the accountant's ε means the implementation is broken (or its accounting is):
:attr:`EpsilonAudit.violated`.

Not here: the one-run audit of Steinke, Nasr & Jagielski (2023), which inserts canaries in one training run
and turns the number of correct guesses into a bound through their Theorem 3.1 — see docs/membership.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError
from .stats import CONFIDENCE, Interval, binomial

__all__ = ["EpsilonAudit", "epsilon_lower_bound", "audit_scores"]


@dataclass
class EpsilonAudit:
    """An empirical lower bound on ε (0 when none is shown) with the counts it rests on and the claimed ε."""

    epsilon: float
    threshold: float
    true_positives: int
    members: int
    false_positives: int
    nonmembers: int
    tpr: Interval
    fpr: Interval
    delta: float
    confidence: float
    claimed: float | None = None

    @property
    def violated(self) -> bool:
        """The empirical lower bound exceeds the accountant's ε: the DP implementation (or its accounting) is broken."""
        return self.claimed is not None and self.epsilon > self.claimed

    def text(self) -> str:
        claim = "" if self.claimed is None else f" vs claimed ε = {self.claimed:.3g}" + (
            " — VIOLATED: the implementation does not give the ε it claims" if self.violated else "")
        return (f"empirical ε ≥ {self.epsilon:.3g} (TP {self.true_positives}/{self.members}, "
                f"FP {self.false_positives}/{self.nonmembers}, δ = {self.delta:g}, {self.confidence:.0%}){claim}")


def _check_delta(delta: float) -> float:
    if not (isinstance(delta, (int, float)) and 0 <= delta < 1):
        raise ConfigError(f"expected delta in [0, 1), got {delta!r} (argument delta)")
    return float(delta)


def epsilon_lower_bound(true_positives: int, members: int, false_positives: int, nonmembers: int, *,
                        delta: float = 0.0, confidence: float = CONFIDENCE) -> tuple[float, Interval, Interval]:
    """(ε lower bound, TPR interval, FPR interval) from counts at one threshold (module docstring)."""
    delta = _check_delta(delta)
    if members <= 0 or nonmembers <= 0:
        raise ConfigError(f"expected members and non-members, got {members} and {nonmembers}")
    tpr = binomial(true_positives, members, confidence=confidence)
    fpr = binomial(false_positives, nonmembers, confidence=confidence)
    fnr = binomial(members - true_positives, members, confidence=confidence)
    tnr = binomial(nonmembers - false_positives, nonmembers, confidence=confidence)

    def bound(high_rate: float, low_rate: float) -> float:
        top = high_rate - delta
        return math.log(top / low_rate) if top > 0 and low_rate > 0 else 0.0

    eps = max(0.0, bound(tpr.low, fpr.high), bound(tnr.low, fnr.high))
    return eps, tpr, fpr


def _best(scores: np.ndarray, members: np.ndarray, delta: float, confidence: float, candidates: int = 64) -> float:
    """The threshold with the largest bound on these points, among ``candidates`` quantiles of the scores."""
    best, best_t = -1.0, math.inf
    for t in np.unique(np.quantile(scores, np.linspace(0, 1, candidates))):
        pred = scores >= t
        eps, _, _ = epsilon_lower_bound(int(pred[members].sum()), int(members.sum()), int(pred[~members].sum()),
                                        int((~members).sum()), delta=delta, confidence=confidence)
        if eps > best:
            best, best_t = eps, float(t)
    return best_t


def audit_scores(scores: object, is_member: object, *, delta: float = 0.0, claimed: float | None = None,
                 threshold: float | None = None, confidence: float = CONFIDENCE, seed: int = 0) -> EpsilonAudit:
    """The ε lower bound of "member iff score ≥ threshold".  Without ``threshold`` it is chosen on a seeded half
    of the points (the best bound there over 64 quantiles of the scores) and the bound is counted on the other
    half."""
    delta = _check_delta(delta)
    s = np.asarray(scores.detach().cpu().numpy() if isinstance(scores, torch.Tensor) else scores,
                   dtype=np.float64).ravel()
    m = np.asarray(is_member.detach().cpu().numpy() if isinstance(is_member, torch.Tensor) else is_member).astype(bool)
    m = m.ravel()
    if s.shape != m.shape or not np.isfinite(s).all():
        raise ConfigError(f"expected finite scores, one per membership flag; got {s.shape} and {m.shape}")
    if m.all() or not m.any():
        raise ConfigError("expected members and non-members among the points (argument is_member)")
    if threshold is None:
        rng = np.random.default_rng([int(seed), 23])
        pick = np.zeros(s.size, dtype=bool)
        for flag in (True, False):  # stratified: half of the members and half of the non-members
            idx = np.flatnonzero(m == flag)
            pick[rng.permutation(idx)[: idx.size // 2]] = True
        threshold = _best(s[pick], m[pick], delta, confidence)
        s, m = s[~pick], m[~pick]
    pred = s >= float(threshold)
    tp, fp = int(pred[m].sum()), int(pred[~m].sum())
    eps, tpr, fpr = epsilon_lower_bound(tp, int(m.sum()), fp, int((~m).sum()), delta=delta, confidence=confidence)
    return EpsilonAudit(eps, float(threshold), tp, int(m.sum()), fp, int((~m).sum()), tpr, fpr, delta, confidence,
                        None if claimed is None else float(claimed))
