"""The report's section on leakage along training: a federated sweep's rounds (:mod:`leakbench.evaluation.verdicts.rounds`).

Per (threat model, dataset, model, batch size): a table with one row per defense and round — the run's test
accuracy over the seeds, the strongest attack on the clients' batches (S_D ± its interval, n), the attack's power
on the public client at the same checkpoint, the chance level, and the round's verdict (leaks / holds /
undetermined / open) with its reason — and a plot of leakage and accuracy against the round.  The words are the
Flower audit's (:mod:`.federated_section`): a *round* is the global model after that many rounds of FedAvg, a
*client* one holder of data.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..evaluation.verdicts.rounds import RoundRow, round_table
from ..evaluation.verdicts.strongest import Strongest
from ..evaluation.verdicts.rows import finite
from .attack_section import Drawn
from .markup import MISSING, esc, figure, hover, muted, num, slug, table
from .plots import _save, plain
from .verdict_text import ci, ci_n

#: what each status means, shown once above the tables
STATUS_TEXT = {
    "leaks": "an attack is significantly closer than chance on the clients' batches",
    "holds": "no attack beats chance on the clients, and the attack's power on public images at this round is "
             "significantly above chance: the defense stops it here",
    "undetermined": "no attack beats chance on the clients, but the attack cannot see at this round (its power on "
                    "public images is at chance, or the update is too small to carry anything): no verdict",
    "open": "too few batches to decide",
}


def _sd(s: Strongest | None) -> str:
    if s is None or not s.n:
        return MISSING
    return ci_n(s.sd)


def _table(rows: Sequence[RoundRow]) -> str:
    body = []
    for r in rows:
        acc = ci(r.accuracy) + (f" ({r.accuracy.n} seeds)" if r.accuracy.n else "")
        if r.diverged:
            acc += " " + hover("diverged", r.diverged)
        power = MISSING if r.power is None else _sd(r.power) + (" · sees" if r.power.sees else " · blind")
        body.append([str(r.round), esc(r.defense), acc, _sd(r.sd), power, num(r.chance),
                     hover(esc(r.status), r.reason)])
    return table(["round", "defense", "test accuracy ± 95 % CI", "S_D on the clients (RMSE) ± 95 % CI",
                  "power: S_D on public images", "chance RMSE", "verdict"], body, left=2)


def _plot(key: tuple, rows: Sequence[RoundRow], out: Path, drawn: Drawn) -> str:
    fig = Figure(figsize=(6.4, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    drew = False
    for defense in dict.fromkeys(r.defense for r in rows):
        mine = [r for r in rows if r.defense == defense and r.sd.n]
        if not mine:
            continue
        line = ax.plot([r.round for r in mine], [r.sd.sd.mean for r in mine], marker="o",
                       label=plain(f"{defense}: clients"))[0]
        power = [r for r in mine if r.power is not None and r.power.n]
        if power:
            ax.plot([r.round for r in power], [r.power.sd.mean for r in power], marker="x", linestyle=":",
                    color=line.get_color(), label=plain(f"{defense}: public (power)"))
        drew = True
    if not drew:
        return ""
    chance = [r.chance for r in rows if r.chance is not None]
    if chance:
        ax.axhline(sum(chance) / len(chance), color="grey", linewidth=0.8, label="chance")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("S_D (RMSE, lower = more leakage)")
    acc = {}
    for r in rows:
        if r.defense == "none" and r.accuracy.n and finite(r.accuracy.mean):
            acc[r.round] = r.accuracy.mean
    if acc:
        twin = ax.twinx()
        twin.plot(list(acc), list(acc.values()), color="black", linestyle="--")
        twin.set_ylabel("test accuracy without a defense (dashed)")
        twin.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="best")
    threat, dataset, model, size = key
    ax.set_title(plain(f"{dataset} · {model} · B = {size}: leakage along training"), fontsize=10)
    fig.tight_layout()
    path = _save(fig, out / "plots" / f"rounds-{slug(threat, dataset, model, size)}.png")
    drawn.plots.append(path)
    return figure(path, out, f"{dataset} · {model} · B = {size}: S_D on the clients' batches (circles) and on the "
                             "public client's (crosses: the attack's power) per round and defense, chance (grey), "
                             "and the undefended run's test accuracy (dashed).")


def rounds_section(rows: Sequence[Mapping[str, Any]], out: Path, drawn: Drawn) -> str:
    """HTML of a federated sweep's rounds ("" when the store has none)."""
    found = round_table(rows)
    if not found:
        return ""
    parts = ['<section class="rounds" id="rounds"><h2>Leakage along training (federated sweep)</h2>',
             "<p>Each defense trained its own FedAvg run from the same start and seeds; the global model after each "
             "attacked round was attacked on the clients' batches under the defense, and on a public client "
             "(images the attacker holds, no defense) to measure what the attack can see at that round. A defense "
             "is credited with stopping the attack only where that power is above chance.</p>",
             "<ul>" + "".join(f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in STATUS_TEXT.items()) + "</ul>"]
    groups: dict[tuple, list[RoundRow]] = {}
    for r in found:
        groups.setdefault((r.threat_model, r.dataset, r.model, r.batch_size), []).append(r)
    for key, rows_here in groups.items():
        threat, dataset, model, size = key
        parts.append(f"<h3>{esc(threat)} · {esc(dataset)} · {esc(model)} · B = {size}</h3>")
        parts.append(_table(rows_here))
        parts.append(_plot(key, rows_here, out, drawn))
    if not any(r.power is not None for r in found):
        parts.append(muted("No public client ran (federated.public: 0): a round where no attack beats chance is "
                           "reported without its power."))
    parts.append("</section>")
    return "".join(parts)


__all__ = ["rounds_section", "STATUS_TEXT"]
