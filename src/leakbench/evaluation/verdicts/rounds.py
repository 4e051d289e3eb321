"""Leakage along training: one row per (setting, round) of a federated sweep, beside the attack's own power.

For every attacked round of a federated sweep (:mod:`.federated`) and defense, :func:`round_table` joins
the strongest attack on the clients' batches (S_D, :func:`.strongest.strongest`), the strongest attack on the
public client at the same checkpoint (its *power*: the attacker's own images, observed without the defense)
and the run's utility there (test accuracy over the seeds, with its Student-t interval).  The status of a row:

- ``leaks``: some attack is significantly closer than chance on the clients' batches;
- ``holds``: no attack is, and the attack's power is significantly above chance — the defense stops it here;
- ``undetermined``: no attack is, but the attack cannot see at this checkpoint (power at chance, or an update too
  small to carry anything): no verdict, with the reason;
- ``open``: too few batches to decide either way (n < MIN_N).

Pure functions of store rows, like :mod:`.strongest`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..trials.plan import split_round
from .stats import EMPTY, MIN_N, Interval, t_mean
from .strongest import Strongest, strongest
from .rows import finite

#: a row's status, in the order the report explains them
ROUND_STATUSES = ("leaks", "holds", "undetermined", "open")

@dataclass
class RoundRow:
    """One defense at one round of one (threat model, dataset, model, batch size)."""

    threat_model: str
    dataset: str
    model: str
    round: int
    defense: str
    batch_size: int
    status: str
    reason: str
    sd: Strongest
    power: Strongest | None
    accuracy: Interval = EMPTY
    test_loss: float | None = None
    diverged: str | None = None

    @property
    def chance(self) -> float | None:
        return self.sd.chance_rmse if finite(self.sd.chance_rmse) else None


def _status(s: Strongest) -> tuple[str, str]:
    if s.sees:
        return "leaks", "an attack is significantly closer than chance on the clients' batches"
    if s.undetermined:
        return "undetermined", s.undetermined
    if s.stops:
        where = ("its power on public images at this checkpoint is above chance" if s.power is not None
                 else "no public client measured its power here")
        return "holds", f"no attack beats chance on the clients' batches; {where}"
    return "open", f"n = {s.n} batches: too few to decide (needs ≥ {MIN_N}), or no attack is significantly " \
                   "different from chance yet"


def round_table(rows: Iterable[Mapping[str, Any]]) -> list[RoundRow]:
    """The rows of a federated sweep's rounds (none for a sweep without rounds), by setting, defense and round."""
    rows = list(rows)
    utility: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("kind") == "utility" and split_round(r.get("model") or "")[1] is not None:
            utility.setdefault((r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none"),
                               []).append(r)
    out = []
    for s in strongest(rows):
        base, round_ = split_round(s.model)
        if round_ is None:
            continue
        status, reason = _status(s)
        runs = [u for u in utility.get((s.dataset, s.model, s.defense), []) if u.get("status") == "done"]
        metrics = [u.get("metrics") or {} for u in runs]
        diverged = next((str(m["diverged"]) for m in metrics if m.get("diverged")), None)
        losses = [float(m["test_loss"]) for m in metrics if finite(m.get("test_loss"))]
        out.append(RoundRow(threat_model=s.threat_model, dataset=s.dataset, model=base, round=round_,
                            defense=s.defense, batch_size=s.batch_size, status=status, reason=reason, sd=s,
                            power=s.power, accuracy=t_mean(m.get("test_accuracy") for m in metrics
                                                           if finite(m.get("test_accuracy"))),
                            test_loss=sum(losses) / len(losses) if losses else None, diverged=diverged))
    return sorted(out, key=lambda r: (r.threat_model, r.dataset, r.model, r.batch_size, r.defense, r.round))


def sentence(row: RoundRow) -> str:
    """``round 20 · strongest attack on public images 0.07 (chance 0.29): it can see; on the clients 0.28: the
    defense holds`` — one line per row, plain text."""
    def value(s: Strongest | None) -> str:
        if s is None or not s.n:
            return "–"
        return f"{s.sd.mean:.3g}"
    chance = (f"{row.power.chance_rmse:.3g}" if row.power is not None and finite(row.power.chance_rmse)
              else "?")
    power = ("no public client" if row.power is None
             else f"strongest attack on public images {value(row.power)} (chance {chance}): "
                  + ("it can see" if row.power.sees else "it cannot see at this round"))
    verdict = {"leaks": "it leaks", "holds": "the defense holds", "undetermined": "no verdict",
               "open": "not decided yet"}[row.status]
    acc = f"accuracy {row.accuracy.mean:.3f}" if row.accuracy.n and math.isfinite(row.accuracy.mean) else \
        "accuracy –"
    return (f"round {row.round} · {row.defense} · B = {row.batch_size} · {acc} · {power}; on the clients "
            f"{value(row.sd)} (n = {row.sd.n}): {verdict}")


__all__ = ["ROUND_STATUSES", "RoundRow", "round_table", "sentence"]
