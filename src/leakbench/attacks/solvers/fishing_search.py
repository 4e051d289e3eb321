"""The server's search in multi-round feature fishing (Wen, Geiping, Fowl, Goldblum & Goldstein, ICML 2022,
Sec. 3.2): thresholds τ on one feature φ_j of the head's input, queried round after round on the same client
data, until two rounds differ by exactly one sample.

A feature-fishing head sets p_target = σ(m·(φ_j − τ)) for every sample, whatever its class, so the bias gradient
of the mean loss is ∂L/∂b_t = (1/B)·Σ_i (p_t,i − 1[y_i = t]) and

    n(τ) := −B·∂L/∂b_t = N(φ_j < τ) − n_other,

a step function of τ that counts the batch's samples below τ up to a constant the server does not know (its labels
are the client's).  Two rounds τ_a < τ_b therefore hold n(τ_b) − n(τ_a) samples in [τ_a, τ_b), and below the head
their gradients differ by exactly those samples' −m·∇φ_j (a target-class sample there switches from 0 to −m·∇φ_j,
one of another class from +m·∇φ_j to 0): a difference of one is one sample's gradient alone.  The search
brackets the batch (widening by the public spread of φ_j until the bracket holds all B), then splits the interval
holding the most samples at its midpoint, and keeps every interval holding one.  A count that is not an integer
(a sample within ~10/m of τ: its p_target is neither 0 nor 1) is re-queried a seventh of the interval away.

Breaching's reference code (``MaliciousClassParameterServer.binary_attack``) moves τ to the mean feature of the
samples that passed; we split at midpoints of the feature axis, which needs no feature read-out and bounds the
rounds by the budget.  Everything here works on what one round returns, ``ask(τ) -> (n(τ), shared tensors)``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Round", "Isolated", "Search", "isolate"]

#: a count within this of an integer is taken as that integer (p_target is 0 or 1 up to e^(−m·distance))
INTEGRAL = 1e-4
#: widen the first bracket by at most 2^WIDEN public spreads on either side
WIDEN = 12


@dataclass
class Round:
    """One query: the threshold, the count n(τ) and the shared tensors the client sent."""

    threshold: float
    count: float
    shared: list[torch.Tensor]

    @property
    def integral(self) -> bool:
        return abs(self.count - round(self.count)) <= INTEGRAL


@dataclass
class Isolated:
    """One sample alone: the interval [low, high) of φ_j holding it and the difference of the two rounds."""

    low: float
    high: float
    shared: list[torch.Tensor]


@dataclass
class Search:
    """What the search found and how many rounds it spent."""

    isolated: list[Isolated]
    rounds: list[Round]
    bracket: tuple[float, float] | None
    notes: list[str] = field(default_factory=list)


def isolate(ask: Callable[[float], tuple[float, Sequence[torch.Tensor]]], *, start: float, spread: float,
            total: int, budget: int, want: int | None = None, known: Round | None = None,
            finest: float | None = None, inside: Callable[[float, float], int] | None = None) -> Search:
    """Query thresholds until ``want`` (default: all ``total``) samples are alone in an interval or ``budget``
    rounds are spent.  ``start``/``spread``: the server's public estimate of φ_j's location and spread;
    ``known``: a round already observed (the shipped model's), reused when its count is an integer; ``finest``: the
    narrowest interval still split (default 10⁻⁶ spreads; samples closer along φ_j are not told apart); ``inside(a,
    b)``: how many samples already read (on an earlier feature) lie in [a, b) — an interval holding one sample that
    was not read, and no other, is isolated; one holding only samples already read is left alone."""
    want = total if want is None else min(want, total)
    rounds: list[Round] = []
    notes: list[str] = []

    def query(tau: float) -> Round | None:
        if len(rounds) >= budget:
            return None
        count, shared = ask(float(tau))
        rounds.append(Round(float(tau), float(count), [t.detach() for t in shared]))
        return rounds[-1]

    points: list[Round] = [known] if known is not None and known.integral else []
    # the bracket: n(high) − n(low) = total (every sample inside), both ends widened by powers of two of the spread
    for k in range(WIDEN + 1):
        low, high = query(start - spread * 2.0 ** k), query(start + spread * 2.0 ** k)
        points += [r for r in (low, high) if r is not None]
        if low is None or high is None:
            break
        if low.integral and high.integral and _count(high) - _count(low) >= total:
            break
    good = sorted((p for p in points if p.integral), key=lambda p: p.threshold)
    if len(good) < 2 or _count(good[-1]) - _count(good[0]) < 1:
        off = max((abs(r.count - round(r.count)) for r in rounds), default=0.0)
        span = max((r.count for r in rounds), default=0.0) - min((r.count for r in rounds), default=0.0)
        notes.append(f"no two rounds with integral counts bracket a sample (the counts span {span:.2g} and sit up to "
                     f"{off:.2g} off an integer: noise or clipping on the shared gradient, or too few rounds for the "
                     "feature's spread)")
        return Search([], rounds, None, notes)
    bracket = (good[0].threshold, good[-1].threshold)
    if _count(good[-1]) - _count(good[0]) < total:
        notes.append(f"the bracket holds {_count(good[-1]) - _count(good[0])} of {total} samples "
                     f"(the rest sit beyond ±2^{WIDEN} public spreads or at a count that is not an integer)")
    finest = spread * 1e-6 if finest is None else finest
    read = inside or (lambda a, b: 0)
    blocked: set[tuple[float, float]] = set()

    def alone(a: Round, b: Round) -> bool:
        return _count(b) - _count(a) == 1 and read(a.threshold, b.threshold) == 0

    def mixed(a: Round, b: Round) -> bool:   # a sample not yet read shares the interval with another sample
        n = _count(b) - _count(a)
        return n >= 2 and n > read(a.threshold, b.threshold)

    while True:
        good.sort(key=lambda p: p.threshold)
        pairs = list(zip(good, good[1:]))
        if sum(alone(a, b) for a, b in pairs) >= want:
            break
        split = [(a, b) for a, b in pairs if mixed(a, b) and b.threshold - a.threshold > finest
                 and (a.threshold, b.threshold) not in blocked]
        if not split:
            notes.append("every interval left holds samples closer along the feature than it can split")
            break
        # the widest interval first: a cluster of samples at one value (a ReLU feature's zeros) narrows fast and
        # then waits, instead of taking every round
        a, b = max(split, key=lambda ab: (ab[1].threshold - ab[0].threshold, _count(ab[1]) - _count(ab[0])))
        mid = query((a.threshold + b.threshold) / 2)
        if mid is not None and not mid.integral:  # a sample within ~10/m of the midpoint: a seventh aside
            mid = query(a.threshold + (b.threshold - a.threshold) * 3 / 7)
        if mid is None:
            notes.append(f"stopped at the budget of {budget} rounds")
            break
        if mid.integral:
            good.append(mid)
        else:
            blocked.add((a.threshold, b.threshold))
            notes.append(f"counts that are not integers near τ = {mid.threshold:.6g}: samples within ~10/m of both "
                         "splits of one interval")
    good.sort(key=lambda p: p.threshold)
    isolated = [Isolated(a.threshold, b.threshold, [tb - ta for ta, tb in zip(a.shared, b.shared)])
                for a, b in zip(good, good[1:]) if alone(a, b)]
    return Search(isolated, rounds, bracket, notes)


def _count(r: Round) -> int:
    return int(round(r.count))
