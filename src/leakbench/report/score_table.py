"""Table 4 in another metric: attacks × defense settings at one batch size, scored by PSNR, SSIM or label accuracy.

Table 4 itself (:func:`leakbench.report.attack_section.table4`) shows RMSE with its interval, as S_D ranks by
it.  The tables here show the mean of another score of :func:`leakbench.compare` over the usable trials of each
attack and setting (n = trials), the best value of each column in bold, so a reader can pick the metric a paper
reports.  Both share the header of grouped defense settings (:func:`defense_header`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..evaluation.trials.plan import defense_family
from ..evaluation.verdicts.strongest import Strongest
from ..evaluation.verdicts.rows import batch_size, finite, threat_model, usable
from ..metrics.scores import SCORES
from .identify_section import attack_cell
from .markup import MISSING, esc, hover, num, table

#: digits each metric is printed with.
DIGITS = {"rmse": 3, "psnr": 2, "ssim": 3, "label_acc": 2}


def ordered_defenses(defenses: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Defense settings grouped by family, families and settings in first-seen order (``none`` first)."""
    groups: dict[str, list[str]] = {}
    for d in sorted(dict.fromkeys(defenses), key=lambda d: d != "none"):
        groups.setdefault(defense_family(d)[0], []).append(d)
    return list(groups.items())


def defense_header(groups: Sequence[tuple[str, list[str]]]) -> str:
    """Two header rows: the defense families, then each setting's parameter."""
    columns = [d for _, ds in groups for d in ds]
    return ('<tr><th class="l" rowspan="2">attack</th>'
            + "".join(f'<th colspan="{len(ds)}">{esc(fam)}</th>' for fam, ds in groups) + "</tr><tr>"
            + "".join(f"<th>{esc(defense_family(d)[1] or MISSING)}</th>" for d in columns) + "</tr>")


def metric_means(rows: Sequence[Mapping[str, Any]]) -> dict[tuple, dict[str, tuple[float, int]]]:
    """(threat model, dataset, model, defense, B, attack) → metric → (mean over usable trials, trials)."""
    sums: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        if (r.get("kind") or "attack") != "attack" or not usable(r):
            continue
        key = (threat_model(r), r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none",
               batch_size(r), r.get("attack") or "")
        into = sums.setdefault(key, {})
        for m in DIGITS:
            if finite(r.get(m)):
                into.setdefault(m, []).append(float(r[m]))
    return {k: {m: (sum(v) / len(v), len(v)) for m, v in by.items()} for k, by in sums.items()}


def _chance_psnr(rmse: float | None) -> float | None:
    return -20 * math.log10(rmse) if finite(rmse) and rmse > 0 else None


def metric_table(best: Sequence[Strongest], size: int, means: Mapping[tuple, Mapping[str, tuple[float, int]]],
                 metric: str) -> str:
    """Attacks (rows) × defense settings (columns) at batch size ``size``, each cell the mean ``metric``."""
    info = SCORES[metric]
    here = {s.defense: s for s in best if s.batch_size == size}
    groups = ordered_defenses(list(here))
    columns = [d for _, ds in groups for d in ds]
    attacks = sorted({a.attack for s in here.values() for a in s.scores})

    def value(d: str, attack: str) -> tuple[float, int] | None:
        s = here[d]
        return means.get((s.threat_model, s.dataset, s.model, d, size, attack), {}).get(metric)

    tops = {}
    for d in columns:
        vals = [v[0] for a in attacks if (v := value(d, a)) is not None]
        if vals:
            tops[d] = max(vals) if info.higher_is_better else min(vals)
    registry = {a.attack: a.name for s in here.values() for a in s.scores}
    rows = []
    for name in attacks:
        row: list[Any] = [attack_cell(name, registry.get(name))]
        for d in columns:
            score = next((a for a in here[d].scores if a.attack == name), None)
            v = value(d, name)
            if score is None:
                row.append((hover("·", "not run: the spec made no trial of this attack here"), "na"))
            elif score.not_applicable:
                row.append((hover("n/a", score.not_applicable), "na"))
            elif not score.trials:
                row.append((hover("failed", "; ".join(score.reasons) or "failed"), "na"))
            elif v is None:
                why = ("this attack does not recover labels" if metric == "label_acc" else f"no {info.label} stored")
                row.append((hover(MISSING, why), "na"))
            else:
                text = f"{num(v[0], DIGITS[metric])} (n = {v[1]})"
                row.append((text, "best" if v[0] == tops.get(d) else ""))
        rows.append(row)
    footer = [[hover("<b>strongest</b> (by RMSE)", "S_D: the attack with the lowest mean RMSE on the setting")]
              + [esc(here[d].attack or "none ran") for d in columns]]
    if metric == "psnr":
        chance = [_chance_psnr(here[d].chance_rmse) for d in columns]
        if any(finite(v) for v in chance):
            footer.append([hover("chance", "PSNR of a flat image at the data mean: an attack not above it learnt "
                                           "nothing about the batch")] + [num(v, 2) for v in chance])
    return table([], [*rows, *footer], head_html=defense_header(groups), css="t4")


__all__ = ["ordered_defenses", "defense_header", "metric_means", "metric_table", "DIGITS"]
