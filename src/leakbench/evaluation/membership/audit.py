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

**One training run** (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run", Sec. 3 and
App. D).  m canaries are each included in the training set independently with probability ½ (S_i = ±1:
:func:`include_canaries`); after the single run the auditor scores every canary and guesses T_i = +1 for the k₊
highest scores, −1 for the k₋ lowest, and abstains on the rest (r = k₊ + k₋ guesses).  Their Theorem 3.1: if
training is (ε, δ)-DP, the number W of correct guesses satisfies, for every v,

    P[W ≥ v] ≤ β + 2mδ·α,    β = P[Bin(r, q) ≥ v],    α = max_{1 ≤ i ≤ v} P[v − i ≤ Bin(r, q) < v] / i,

with q = e^ε / (1 + e^ε) (ε-DP randomized response's accuracy).  This bound is the p-value of v correct guesses
under "the training is (ε, δ)-DP" (:func:`one_run_p_value`; it increases with ε), and the audit reports the
largest ε it rejects at ``confidence`` — bisection on ε (:func:`one_run_audit`).  With δ = 0 this is the logit
of the one-sided Clopper–Pearson lower bound on v/r.  The guess counts (k₊, k₋) are a small fixed grid, each
tested at confidence 1 − (1 − c)/(grid size) (Bonferroni), so choosing the best of them keeps the level.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import ConfigError
from ..verdicts.stats import CONFIDENCE, Interval, binomial

__all__ = ["EpsilonAudit", "epsilon_lower_bound", "audit_scores", "OneRunAudit", "one_run_p_value",
           "one_run_epsilon", "one_run_audit", "include_canaries"]


class _Claimed:
    """An ε lower bound beside the accountant's claimed ε (``epsilon`` and ``claimed`` are the subclass's fields)."""

    epsilon: float
    claimed: float | None

    @property
    def violated(self) -> bool:
        """The empirical lower bound exceeds the accountant's ε: the DP implementation (or its accounting) is broken."""
        return self.claimed is not None and self.epsilon > self.claimed

    def _claim(self) -> str:
        return "" if self.claimed is None else f" vs claimed ε = {self.claimed:.3g}" + (
            " — VIOLATED: the implementation does not give the ε it claims" if self.violated else "")


@dataclass
class EpsilonAudit(_Claimed):
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

    def text(self) -> str:
        claim = self._claim()
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


# --------------------------------------------------------------------------- one training run (Steinke et al.)


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """Steinke et al.'s Theorem 3.1: the largest probability that an (ε, δ)-DP training lets r guesses about m
    canaries (each included with probability ½) be right v or more times (module docstring)."""
    from scipy import stats as _stats

    for name, value in (("m", m), ("r", r), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"expected a count ≥ 0, got {value!r} (argument {name})")
    if not v <= r <= m:
        raise ConfigError(f"expected correct ≤ guesses ≤ canaries, got v = {v}, r = {r}, m = {m}")
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0 and math.isfinite(epsilon)):
        raise ConfigError(f"expected epsilon ≥ 0, got {epsilon!r} (argument epsilon)")
    delta = _check_delta(delta)
    q = 1.0 / (1.0 + math.exp(-epsilon))
    beta = float(_stats.binom.sf(v - 1, r, q))  # P[Bin(r, q) ≥ v]
    if delta == 0 or v == 0:
        return min(1.0, beta)
    below = _stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[Bin = v − i], i = 1..v
    alpha = float((np.cumsum(below) / np.arange(1, v + 1)).max())
    return min(1.0, beta + 2 * m * delta * alpha)


def one_run_epsilon(m: int, r: int, v: int, *, delta: float = 0.0, confidence: float = CONFIDENCE,
                    upper: float = 50.0, steps: int = 60) -> float:
    """The largest ε whose p-value (:func:`one_run_p_value`) is below 1 − ``confidence`` (0 when none): training
    is not (ε, δ)-DP for any smaller ε, at that confidence."""
    if not 0 < confidence < 1:
        raise ConfigError(f"expected confidence in (0, 1), got {confidence!r} (argument confidence)")
    level = 1.0 - confidence
    if one_run_p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    lo, hi = 0.0, float(upper)
    if one_run_p_value(m, r, v, hi, delta) < level:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        if one_run_p_value(m, r, v, mid, delta) < level:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class OneRunAudit(_Claimed):
    """The one-run ε lower bound: the best guess counts of the grid, its correct guesses and the claimed ε."""

    epsilon: float
    canaries: int
    guesses_in: int
    guesses_out: int
    correct: int
    delta: float
    confidence: float
    claimed: float | None = None

    def text(self) -> str:
        claim = self._claim()
        return (f"one-run ε ≥ {self.epsilon:.3g} ({self.correct} of {self.guesses_in + self.guesses_out} guesses "
                f"right about {self.canaries} canaries, δ = {self.delta:g}, {self.confidence:.1%}){claim}")


def include_canaries(canaries: int, *, seed: int) -> np.ndarray:
    """Which of ``canaries`` canaries go into the training set: independent fair coins (Steinke et al. Sec. 3)."""
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 1:
        raise ConfigError(f"expected a number of canaries ≥ 1, got {canaries!r} (argument canaries)")
    return np.random.default_rng([int(seed), 29]).random(canaries) < 0.5


#: the default grid of (k₊, k₋) as fractions of the canaries
ONE_RUN_GRID = ((0.05, 0.0), (0.1, 0.0), (0.05, 0.05), (0.1, 0.1), (0.2, 0.2))


def min_canaries(grid=ONE_RUN_GRID) -> int:
    """The fewest canaries for which the default guess grid makes at least one guess (5 with
    :data:`ONE_RUN_GRID`): fewer audit nothing, so every such run would fail."""
    m = 1
    while not any(int(m * a) + int(m * b) >= 1 for a, b in grid):
        m += 1
    return m


def check_canaries(canaries: object, *, field: str = "canaries") -> int:
    """``canaries`` as a count the one-run audit can use (≥ :func:`min_canaries`), or a :class:`ConfigError`."""
    least = min_canaries()
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < least:
        raise ConfigError(f"expected canaries ≥ {least} (fewer make no guess in the one-run audit), got "
                          f"{canaries!r} (field {field})")
    return canaries


def one_run_audit(scores: object, included: object, *, delta: float = 0.0, claimed: float | None = None,
                  confidence: float = CONFIDENCE, grid: tuple[tuple[int, int], ...] | None = None) -> OneRunAudit:
    """The one-run audit of canary ``scores`` (higher = more likely included) against the coins ``included``:
    for each (k₊, k₋) of ``grid`` (counts; default :data:`ONE_RUN_GRID` fractions of the canaries) guess the k₊
    highest in and the k₋ lowest out, and keep the largest ε bound, each at the Bonferroni level."""
    s = np.asarray(scores.detach().cpu().numpy() if isinstance(scores, torch.Tensor) else scores,
                   dtype=np.float64).ravel()
    inc = np.asarray(included.detach().cpu().numpy() if isinstance(included, torch.Tensor) else included)
    inc = inc.astype(bool).ravel()
    if s.shape != inc.shape or not np.isfinite(s).all() or s.size == 0:
        raise ConfigError(f"expected one finite score per canary, got {s.shape} scores for {inc.shape} canaries")
    delta = _check_delta(delta)
    m = int(s.size)
    if grid is None:
        grid = tuple((int(m * a), int(m * b)) for a, b in ONE_RUN_GRID)
    grid = tuple((kp, kn) for kp, kn in grid if kp + kn >= 1)
    if not grid or any(kp < 0 or kn < 0 or kp + kn > m for kp, kn in grid):
        raise ConfigError(f"expected guess counts (k_in, k_out) with 1 ≤ k_in + k_out ≤ {m}, got {grid!r} "
                          "(argument grid)")
    level = 1.0 - (1.0 - confidence) / len(grid)
    order = np.argsort(-s, kind="stable")
    best = OneRunAudit(0.0, m, grid[0][0], grid[0][1], 0, delta, level,
                       None if claimed is None else float(claimed))
    for kp, kn in grid:
        right = int(inc[order[:kp]].sum()) + int((~inc[order[m - kn:]]).sum() if kn else 0)
        eps = one_run_epsilon(m, kp + kn, right, delta=delta, confidence=level)
        if eps > best.epsilon or (eps == best.epsilon and right > best.correct and best.epsilon == 0):
            best = OneRunAudit(eps, m, kp, kn, right, delta, level, best.claimed)
    return best
