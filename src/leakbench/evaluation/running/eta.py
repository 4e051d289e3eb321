"""The time a sweep has left, weighted by what its trials cost: :class:`CostEstimate`.

A count-based ETA (rich's, "trials left × mean seconds a trial") is wrong whenever trials differ in cost: the demo
runs its cheap analytic trials early and Liu et al.'s attack (≈ 12 s a trial) late, so a count-based ETA said
"24 s" at 89 % and the rest took minutes.  Here each trial has a *shape* (kind, attack, preset, options, batch
size, model); the estimate is Σ over the trials still to run of their shape's mean measured seconds, divided by
the workers.  A shape not measured yet is priced at the dearest mean measured for its kind (attack, utility...)
— a guess that the first trial of the shape replaces.  So that it is replaced early, a sweep runs one trial of
every shape first (:func:`probes_first`): the order does not change any trial's result.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable

from ..trials.trial import TrialSpec

__all__ = ["CostEstimate", "shape_of", "probes_first", "cheapest_groups_first"]


def shape_of(trial: TrialSpec) -> tuple:
    """What decides a trial's cost (not its images, seed or defense draw)."""
    return (trial.kind, trial.attack, trial.preset, json.dumps(trial.options, sort_keys=True, default=str),
            trial.batch_size, trial.model, json.dumps(trial.utility, sort_keys=True, default=str))


class CostEstimate:
    """Seconds left for ``trials`` on ``workers`` parallel workers, from the trials finished so far."""

    def __init__(self, trials: Iterable[TrialSpec], workers: int = 1) -> None:
        self.left: Counter = Counter(shape_of(t) for t in trials)
        self.workers = max(1, int(workers))
        self.sums: dict[tuple, float] = {}
        self.counts: Counter = Counter()

    def done(self, trial: TrialSpec, seconds: float | None) -> None:
        """``trial`` finished after ``seconds`` (None or non-finite: counted as finished, not as a cost)."""
        shape = shape_of(trial)
        if self.left[shape] > 0:
            self.left[shape] -= 1
        if isinstance(seconds, (int, float)) and seconds == seconds and 0 <= seconds < float("inf"):
            self.sums[shape] = self.sums.get(shape, 0.0) + float(seconds)
            self.counts[shape] += 1

    def learn_from(self, other: CostEstimate) -> None:
        """Start from ``other``'s measured seconds (a replication round priced by the trials before it)."""
        for shape, total in other.sums.items():
            self.sums[shape] = self.sums.get(shape, 0.0) + total
        self.counts.update(other.counts)

    def _prices(self) -> tuple[dict[tuple, float], dict[str, float], float]:
        """(mean measured seconds per shape, the dearest mean per kind, the dearest of all; 0.0 before any)."""
        means = {s: self.sums[s] / self.counts[s] for s in self.counts}
        dearest: dict[str, float] = {}
        for shape, mean in means.items():
            dearest[shape[0]] = max(dearest.get(shape[0], 0.0), mean)
        return means, dearest, max(means.values(), default=0.0)

    @staticmethod
    def _price(shape: tuple, prices: tuple[dict[tuple, float], dict[str, float], float]) -> float:
        means, dearest, overall = prices
        return means.get(shape, dearest.get(shape[0], overall))

    def seconds(self, trial: TrialSpec) -> float:
        """``trial``'s expected seconds: its shape's mean measured, else the dearest mean of its kind, else of any
        shape (0.0 before any trial was measured)."""
        return self._price(shape_of(trial), self._prices())

    def seconds_left(self) -> float | None:
        """The estimate, or None before any trial was measured."""
        prices = self._prices()
        if not prices[0]:
            return None
        return sum(n * self._price(shape, prices) for shape, n in self.left.items() if n > 0) / self.workers


def probes_first(trials: Iterable[TrialSpec]) -> list[TrialSpec]:
    """``trials`` with the first trial of each shape moved to the front (each group's order kept otherwise)."""
    seen: set[tuple] = set()
    first: list[TrialSpec] = []
    rest: list[TrialSpec] = []
    for t in trials:
        shape = shape_of(t)
        (rest if shape in seen else first).append(t)
        seen.add(shape)
    return first + rest


def cheapest_groups_first(trials: Iterable[TrialSpec], estimate: CostEstimate, group) -> list[TrialSpec]:
    """``trials`` by ``group(trial)``, the groups in ascending order of their expected seconds (``estimate``), each
    group's order kept: under a time bound the cheap groups finish whole, and as many of them as the time allows."""
    groups: dict = {}
    for t in trials:
        groups.setdefault(group(t), []).append(t)
    cost = {g: sum(estimate.seconds(t) for t in members) for g, members in groups.items()}
    return [t for g in sorted(groups, key=lambda g: cost[g]) for t in groups[g]]
