"""Adaptive replication (``replicate: {auto: true}``): more batches only where the verdict is still open.

After a sweep's planned trials, :func:`open_cells` reads the store's verdicts and returns the (threat model,
dataset, model, B) cells whose decision is not made at some budget: fewer than
:data:`~.stats.MIN_N` batches, or a statistical tie that is not exact (an exact tie — identical scores batch
by batch — never resolves, so it is reported and left alone).  :func:`more_trials` copies every attack trial
of such a cell to ``step`` new batch indices (the next images of the same seeded draw, so every defense and
attack of the cell still attacks the same images and stays paired), up to ``max_batches`` per cell and as
many as the dataset holds.  The sweep runs them, commits each at once, and asks again; a resumed sweep first
runs the added trials still pending, so nothing is lost or repeated.  What was done is kept in the store's
``replicate`` meta entry, which the report shows.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .stats import MIN_N, paired
from .rules import BUDGETS, PrivacyUtilityPoint, privacy_utility, verdicts
from .strongest import strongest
from .utility import utility_table
from ..trials.trial import TrialSpec

Cell = tuple[str, str, str, int]  # (threat model, dataset label, model label, batch size)


def _exact(pick: PrivacyUtilityPoint, other: PrivacyUtilityPoint) -> bool:
    d = paired(pick.sd_per_batch, other.sd_per_batch)
    return bool(d) and all(v == 0.0 for v in d.values())


def open_cells(rows: Sequence[Mapping[str, Any]], budgets: Sequence[float] = BUDGETS) -> dict[Cell, str]:
    """Cells whose verdict more batches could still decide → why (``undecided`` or the defenses tied)."""
    points = privacy_utility(strongest(rows), utility_table(rows))
    by_cell: dict[Cell, dict[str, PrivacyUtilityPoint]] = {}
    for p in points:
        by_cell.setdefault((p.threat_model, p.dataset, p.model, p.batch_size), {})[p.defense] = p
    out: dict[Cell, str] = {}
    for v in verdicts(points, budgets):
        cell = (v.threat_model, v.dataset, v.model, v.batch_size)
        here = by_cell.get(cell, {})
        if v.status == "undecided":
            out.setdefault(cell, f"undecided (n = {v.n} < {MIN_N})")
        elif v.status == "tied" and v.defense in here:
            open_ties = [d for d in v.tied if d in here and not _exact(here[v.defense], here[d])]
            if open_ties:
                out.setdefault(cell, f"{v.defense} tied with {', '.join(open_ties)} (n = {v.n})")
    return out


def cell_of(t: TrialSpec) -> Cell:
    """The verdict cell of a trial: (threat model, dataset, model, batch size)."""
    return (t.threat_model, t.dataset_key or t.dataset, t.model_key or t.model, int(t.batch_size))


def more_trials(trials: Iterable[TrialSpec], cells: Iterable[Cell], *, step: int, max_batches: int,
                limit: Mapping[Cell, int] | None = None) -> list[TrialSpec]:
    """``step`` more batches for every attack trial of ``cells`` (copies of the trials with the next batch
    indices), never past ``max_batches`` (or ``limit[cell]``, the batches the dataset holds) per cell."""
    wanted = set(cells)
    groups: dict[Cell, dict[tuple, TrialSpec]] = {}
    top: dict[Cell, int] = {}
    for t in trials:
        if t.kind != "attack" or t.indices:
            continue
        cell = cell_of(t)
        if cell not in wanted:
            continue
        top[cell] = max(top.get(cell, -1), int(t.batch))
        ident = (t.defense, t.attack_key, t.attack, json.dumps(t.options, sort_keys=True, default=str), t.seed)
        groups.setdefault(cell, {}).setdefault(ident, t)
    out = []
    for cell, templates in groups.items():
        most = min(max_batches, (limit or {}).get(cell, max_batches))
        for batch in range(top[cell] + 1, min(top[cell] + 1 + step, most)):
            out += [dataclasses.replace(t, batch=batch) for t in templates.values()]
    return out


__all__ = ["open_cells", "more_trials", "cell_of", "Cell"]
