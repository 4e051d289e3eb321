"""Utility joined to a setting: the utility table of a sweep's training runs (Liu et al. 2024, Table 5), which
runs diverged, the bounds table, and the utility loss against the undefended run of the same seed (paired, a
Student-t interval over seeds).

**Utility** (Table 5) is joined to a setting on (dataset, model, defense, batch size), falling back to batch
size 0.  Several training seeds per setting: the utility loss is the increase of the final training loss over
the undefended run *of the same seed* (paired), with a Student-t interval over seeds.  A gain is reported as
measured (an interval that overlaps zero), never clamped.  A run is **diverged** when its training loss is not
finite or ends above the untrained model's: it gets no utility number, never competes within a budget and is
never placed on the utility axis.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .rows import _mean, batch_size, finite, threat_model
from .stats import EMPTY, Interval, paired, paired_t, t_mean

UTILITY_METRICS = ("train_loss", "train_accuracy", "test_accuracy", "epsilon", "samples_seen")


def _utility_seed(row: Mapping[str, Any]) -> int:
    spec = row.get("spec") or {}
    seed = (spec.get("utility") or {}).get("seed", row.get("seed", 0))
    return int(seed) if finite(seed) else 0


def diverged(row: Mapping[str, Any]) -> str | None:
    """Why a utility run diverged (a non-finite training loss, or one above the untrained model's), else None."""
    m = row.get("metrics") or {}
    if m.get("diverged"):
        return str(m["diverged"])
    if row.get("status") == "failed" and "non-finite" in (row.get("error") or ""):
        return "non-finite training loss"
    loss, start = m.get("train_loss"), m.get("initial_loss")
    if row.get("status") == "done":
        if not finite(loss):
            return "non-finite training loss"
        if finite(start) and loss > start:
            return f"final training loss {loss:.3g} above the untrained model's {start:.3g}"
    return None


def utility_table(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(dataset, model, defense, batch size) → utility over the training seeds of that setting.

    Each entry: the mean of every :data:`UTILITY_METRICS` over the usable seeds, ``trials`` (seeds averaged),
    ``per_seed`` (seed → metrics), ``train_loss_ci`` / ``test_accuracy_ci`` (Student-t over seeds) and
    ``diverged`` (the reason, for k of n seeds, or None).  A diverged setting has no utility means.
    Batch size 0 = a utility that applies to every batch size.
    """
    groups: dict[tuple, dict[int, Mapping[str, Any]]] = {}
    broken: dict[tuple, list[str]] = {}
    for r in rows:
        if r.get("kind") != "utility":
            continue
        key = (r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none", batch_size(r))
        why = diverged(r)
        if why is not None:
            broken.setdefault(key, []).append(why)
            groups.setdefault(key, {})
            continue
        metrics = r.get("metrics") or {}
        if r.get("status") == "done" and finite(metrics.get("train_loss")):
            groups.setdefault(key, {})[_utility_seed(r)] = metrics
    out: dict[tuple, dict[str, Any]] = {}
    for key in dict.fromkeys([*groups, *broken]):
        seeds = groups.get(key, {})
        why = broken.get(key)
        entry: dict[str, Any] = {"per_seed": dict(seeds), "trials": len(seeds), "diverged": None}
        if why:
            n = len(why) + len(seeds)
            entry["diverged"] = f"{len(why)} of {n} seed(s): {why[0]}"
            entry.update({name: None for name in UTILITY_METRICS})
            entry["epsilon"] = _mean(m.get("epsilon") for m in seeds.values())
            entry["train_loss_ci"] = entry["test_accuracy_ci"] = EMPTY
        else:
            entry.update({name: _mean(m.get(name) for m in seeds.values()) for name in UTILITY_METRICS})
            entry["train_loss_ci"] = t_mean(m.get("train_loss") for m in seeds.values() if finite(m.get("train_loss")))
            entry["test_accuracy_ci"] = t_mean(m.get("test_accuracy") for m in seeds.values()
                                               if finite(m.get("test_accuracy")))
        out[key] = entry
    return out


def utility_for(table: Mapping[tuple, Mapping[str, Any]], dataset: str, model: str, defense: str,
                size: int) -> Mapping[str, Any] | None:
    """The utility of a defense setting at a batch size, else the batch-size-0 one, else None."""
    return table.get((dataset, model, defense, size)) or table.get((dataset, model, defense, 0))


def bounds_table(rows: Iterable[Mapping[str, Any]], *, metric: str = "exact_rmse") -> dict[tuple, float]:
    """(threat model, dataset, model, defense, batch size) → mean Cramér–Rao value of the finished bound trials.

    The Cramér–Rao value bounds the RMSE of *unbiased* estimators only; box-clamped attacks can beat it.
    """
    values: dict[tuple, list[float]] = {}
    for r in rows:
        v = (r.get("metrics") or {}).get(metric)
        if r.get("kind") == "bound" and r.get("status") == "done" and finite(v):
            key = (threat_model(r), r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none",
                   batch_size(r))
            values.setdefault(key, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in values.items()}


@dataclass(frozen=True)
class UtilityLoss:
    """What a defense costs: the training-loss increase over the undefended run of the same seed (paired).

    ``interval`` is the Student-t interval over seeds (``EMPTY`` when unmeasured or diverged); ``diverged`` says
    why the defended (or undefended) training diverged.  ``none`` costs exactly 0.
    """

    interval: Interval = EMPTY
    diverged: str | None = None

    @property
    def mean(self) -> float | None:
        return self.interval.mean if self.interval.n and finite(self.interval.mean) else None

    @property
    def measured(self) -> bool:
        return self.diverged is None and self.mean is not None

    def within(self, budget: float) -> bool:
        """The cost fits ``budget``: any measured, non-diverged cost at u = inf; else the interval's upper end ≤ u."""
        if not self.measured:
            return False
        if math.isinf(budget):
            return True
        return self.interval.known and self.interval.high <= budget

    def at_edge(self, budget: float) -> bool:
        """The cost may or may not fit a finite ``budget`` at this n: not :meth:`within` it, yet its interval's
        lower end (the mean, with one seed) is ≤ u."""
        if not self.measured or math.isinf(budget) or self.within(budget):
            return False
        low = self.interval.low if self.interval.known else self.mean
        return low is not None and low <= budget

    @property
    def gain(self) -> bool:
        """The measured change is negative (a gain); :attr:`interval` says whether it overlaps zero."""
        return self.mean is not None and self.mean < 0


def utility_loss(table: Mapping[tuple, Mapping[str, Any]], dataset: str, model: str, defense: str,
                 size: int) -> UtilityLoss:
    """The defense's :class:`UtilityLoss` at batch size ``size`` (paired by training seed)."""
    u = utility_for(table, dataset, model, defense, size)
    base = utility_for(table, dataset, model, "none", size)
    if u is None:
        return UtilityLoss()
    if u.get("diverged"):
        return UtilityLoss(diverged=u["diverged"])
    if defense == "none":
        n = int(u.get("trials") or 0)
        return UtilityLoss(Interval(0.0, 0.0, 0.0, n, "t"))
    if base is None:
        return UtilityLoss()
    if base.get("diverged"):
        return UtilityLoss(diverged=f"the undefended run diverged ({base['diverged']})")
    loss = {s: m.get("train_loss") for s, m in (u.get("per_seed") or {}).items() if finite(m.get("train_loss"))}
    ref = {s: m.get("train_loss") for s, m in (base.get("per_seed") or {}).items() if finite(m.get("train_loss"))}
    if paired(loss, ref):
        return UtilityLoss(paired_t(loss, ref))
    return UtilityLoss()


__all__ = ["UTILITY_METRICS", "utility_table", "utility_for", "bounds_table", "utility_loss"]
