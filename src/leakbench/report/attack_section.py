"""The report section of one gradient threat model (eavesdropper, informed eavesdropper, malicious server).

Per (dataset, model): the verdict per utility budget, Table 4 (attacks × defense settings per batch size,
the strongest attack per setting highlighted; Liu et al. 2024), S_D as a heatmap, Table 5 (utility per
defense setting and batch size), Figure 3 (best-attack RMSE against utility loss with the Pareto front)
and the best reconstruction of every setting (originals on top).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import ConfigError
from ..evaluation.plan import defense_family
from ..evaluation.strongest import (BUDGETS, AttackScore, PrivacyUtilityPoint, Strongest, Verdict, batch_size,
                                    beats_chance, finite, npz_path, threat_model, usable, utility_for, utility_loss, verdicts)
from .grid import save_grid
from .markup import MISSING, esc, figure, hover, muted, num, slug, table
from .plots import CRAMER_RAO, pareto_plot, sd_heatmap

#: the budget whose verdict the report's summary quotes.
SUMMARY_BUDGET = 0.1
GAIN_NOTE = ("lower training loss than without a defense: both runs train on the same samples, so the "
             "difference is within run-to-run noise, not a benefit; shown as 0")


@dataclass
class Drawn:
    """Files a section wrote (the report lists them)."""

    plots: list[Path] = field(default_factory=list)
    grids: list[Path] = field(default_factory=list)


def budget_text(u: float) -> str:
    return "at any utility cost" if math.isinf(u) else f"at a utility loss ≤ {u:g}"


def _at_b(pairs: Sequence[tuple[int, float | None]]) -> str:
    parts = [f"{num(v)}" + (f" at B = {b}" if len(pairs) > 1 else "") for b, v in pairs]
    return ", ".join(parts)


def verdict_sentence(found: Sequence[Verdict], *, upto: float | None = None) -> str:
    """One plain sentence (HTML) for the verdicts of one budget over the batch sizes of a dataset and model."""
    found = sorted(found, key=lambda v: v.batch_size)
    if not found:
        return "No setting to judge."
    u = found[0].budget
    head = budget_text(u)
    if upto is not None and upto != u:
        head += f" (the same up to {'any cost' if math.isinf(upto) else f'{upto:g}'})"
    picked = [v for v in found if v.defense is not None]
    blind = [v for v in found if beats_chance(v.baseline_rmse, v.baseline_chance) is False]
    if found and len(blind) == len(found):
        return (f"{head[0].upper()}{head[1:]}, the strongest attack does not beat chance even without a defense "
                f"(RMSE {_at_b([(v.batch_size, v.baseline_rmse) for v in found])} against a flat image's "
                f"{_at_b([(v.batch_size, v.baseline_chance) for v in found])}), so the attacks as run cannot rank "
                "the defenses here.")
    if not picked:
        answer = "no defense setting with a usable attack result fits this budget"
    else:
        names = list(dict.fromkeys(v.defense for v in picked))

        def name(d: str) -> str:
            if d == "none":
                return "no defense (every setting within the budget leaks as much or more)"
            eps = sorted({f"{v.epsilon:.2f}" for v in picked if v.defense == d and finite(v.epsilon)})
            return f"<b>{esc(d)}</b>" + (f" (ε = {' / '.join(eps)})" if eps else "")

        def cost(vs: Sequence[Verdict]) -> str:
            losses = sorted({num(v.utility_loss) for v in vs if v.utility_loss is not None})
            gain = " — its measured loss was lower than without a defense, within noise" if any(
                v.gain for v in vs) else ""
            return f"; utility loss {' / '.join(losses)}{gain}" if losses and names != ["none"] else ""

        if len(names) == 1:
            answer = (f"the defense that leaks least against the strongest attack is {name(names[0])} "
                      f"(RMSE {_at_b([(v.batch_size, v.rmse) for v in picked])}{cost(picked)})")
        else:
            answer = "the defense that leaks least against the strongest attack is " + "; ".join(
                f"{name(v.defense)} at B = {v.batch_size} (RMSE {num(v.rmse)}{cost([v])})" for v in picked)
    if picked and all(beats_chance(v.rmse, v.chance_rmse) is False for v in picked) and names != ["none"]:
        answer += " — no better than chance there: no attack run here recovers anything under it"
    base = [(v.batch_size, v.baseline_rmse) for v in found if v.baseline_rmse is not None]
    tail = (f"; without a defense the strongest attack reaches {_at_b(base)}" if base
            else "; the sweep ran no undefended setting to compare with")
    if blind:
        where = " at B = " + ", ".join(str(v.batch_size) for v in blind)
        flat = _at_b([(v.batch_size, v.baseline_chance) for v in blind])
        tail += (f" — not below chance{where} (a flat image scores {flat}): the attacks as run learn nothing "
                 "even without a defense, so they cannot rank the defenses there")
    return f"{head[0].upper()}{head[1:]}, {answer}{tail}."


def verdict_lines(found: Sequence[Verdict]) -> list[str]:
    """One sentence per budget (consecutive budgets with the same answers merged)."""
    by_budget: dict[float, list[Verdict]] = {}
    for v in found:
        by_budget.setdefault(v.budget, []).append(v)
    budgets = sorted(by_budget)
    lines, i = [], 0
    while i < len(budgets):
        j = i
        answer = [(v.batch_size, v.defense) for v in sorted(by_budget[budgets[i]], key=lambda v: v.batch_size)]
        while j + 1 < len(budgets) and [(v.batch_size, v.defense) for v in
                                         sorted(by_budget[budgets[j + 1]], key=lambda v: v.batch_size)] == answer:
            j += 1
        lines.append(verdict_sentence(by_budget[budgets[i]], upto=budgets[j] if j > i else None))
        i = j + 1
    return lines


def _ordered_defenses(defenses: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Defense settings grouped by family, families and settings in first-seen order (``none`` first)."""
    groups: dict[str, list[str]] = {}
    for d in sorted(dict.fromkeys(defenses), key=lambda d: d != "none"):
        groups.setdefault(defense_family(d)[0], []).append(d)
    return list(groups.items())


def _score_cell(a: AttackScore | None, best: bool) -> Any:
    if a is None:
        return (hover("·", "not run: the spec made no trial of this attack here"), "na")
    if a.not_applicable:
        return (hover("n/a", a.not_applicable), "na")
    if not a.trials:
        why = "; ".join(a.reasons) or "failed"
        return (hover("failed", f"{a.failed} trial(s): {why}"), "na")
    text = num(a.rmse) + (f" ± {num(a.rmse_std)}" if a.rmse_std is not None else "")
    if a.failed:
        text = hover(f"{text} †", f"{a.failed} of {a.failed + a.trials} trials not usable (averaged over the "
                                  f"rest): {'; '.join(a.reasons)}")
    chance = beats_chance(a.rmse, a.chance_rmse) is False
    if chance:
        text = hover(text, f"not below chance ({num(a.chance_rmse)}, a flat image at the data mean): the attack "
                           "learnt nothing about the batch")
    return (text, " ".join(c for c in ("best" if best else "", "chance" if chance else "") if c))


def table4(best: Sequence[Strongest], size: int, bounds: Mapping[tuple, float] | None = None) -> str:
    """Attacks (rows) × defense settings (columns, grouped by family) at one batch size; S_D highlighted.

    ``bounds``: (threat model, dataset, model, defense, B) → Cramér–Rao value, shown as a last row.
    """
    here = {s.defense: s for s in best if s.batch_size == size}
    groups = _ordered_defenses(list(here))
    columns = [d for _, ds in groups for d in ds]
    attacks = sorted({a.attack for s in here.values() for a in s.scores})
    head = ('<tr><th class="l" rowspan="2">attack</th>'
            + "".join(f'<th colspan="{len(ds)}">{esc(fam)}</th>' for fam, ds in groups) + "</tr><tr>"
            + "".join(f"<th>{esc(defense_family(d)[1] or MISSING)}</th>" for d in columns) + "</tr>")
    rows = []
    for name in attacks:
        row: list[Any] = [esc(name)]
        for d in columns:
            s = here[d]
            row.append(_score_cell(next((a for a in s.scores if a.attack == name), None), s.attack == name))
        rows.append(row)
    footer = [["<b>strongest</b>"] + [esc(here[d].attack or "none ran") for d in columns]]
    chance = [here[d].chance_rmse for d in columns]
    if any(finite(v) for v in chance):
        footer.append([hover("chance", "RMSE of a flat image at the data mean: an attack not below it learnt "
                                       "nothing about the batch")] + [num(v) for v in chance])
    cr = [(bounds or {}).get((here[d].threat_model, here[d].dataset, here[d].model, d, size)) for d in columns]
    if any(finite(v) for v in cr):
        footer.append([hover(esc(CRAMER_RAO), "bounds the RMSE of unbiased estimators only; box-clamped attacks "
                                              "can go below it")] + [num(v) for v in cr])
    return table([], [*rows, *footer], head_html=head, css="t4")


def _eps_label(defense: str, eps: Sequence[tuple[int, float | None]]) -> str:
    vals = [(b, e) for b, e in eps if finite(e)]
    if not vals:
        return esc(defense)
    distinct = sorted({round(e, 2) for _, e in vals})
    text = (f"ε = {distinct[0]:.2f}" if len(distinct) == 1 else
            "ε = " + ", ".join(f"{e:.2f} (B = {b})" for b, e in vals))
    return f"{esc(defense)} <span class=eps>{esc(text)}</span>"


def table5(util: Mapping[tuple, Mapping[str, Any]], dataset: str, model: str, defenses: Sequence[str],
           sizes: Sequence[int]) -> str:
    """Utility per defense setting and batch size: final train loss, test accuracy, utility loss (Table 5)."""
    keys = [k for k in util if k[:2] == (dataset, model)]
    if not keys:
        return muted("No utility trials for this dataset and model (add a <code>utility:</code> section to the "
                     "spec to measure each defense's cost), so no Table 5, Figure 3 or budgeted verdict.")
    if all(k[3] == 0 for k in keys):
        sizes = [0]  # an old store: one utility per defense, for every batch size
    all_defs = list(dict.fromkeys([*defenses, *(k[2] for k in keys)]))
    columns = [d for _, ds in _ordered_defenses(all_defs) for d in ds]
    head = ('<tr><th class="l" rowspan="2">defense</th>'
            + "".join(f'<th colspan="3">{"every B" if b == 0 else f"B = {b}"}</th>' for b in sizes)
            + "</tr><tr>" + "<th>train loss</th><th>test acc.</th><th>utility loss</th>" * len(sizes) + "</tr>")
    rows, gains = [], False
    for d in columns:
        row: list[Any] = []
        eps = []
        for b in sizes:
            u = utility_for(util, dataset, model, d, b) or {}
            eps.append((b, u.get("epsilon")))
            increase, loss, gain = utility_loss(util, dataset, model, d, b)
            seen = u.get("samples_seen")
            loss_text = num(loss)
            if gain:
                gains = True
                loss_text = hover(f"{num(loss)} *", f"measured {num(increase)}: {GAIN_NOTE}")
            train = num(u.get("train_loss"))
            if finite(seen):
                train = hover(train, f"{seen:.0f} samples seen in training")
            row += [train, num(u.get("test_accuracy")), (loss_text, "gain" if gain else "")]
        rows.append([_eps_label(d, eps), *row])
    note = muted(f"* {GAIN_NOTE[0].upper()}{GAIN_NOTE[1:]}.") if gains else ""
    return table([], rows, head_html=head) + note


def _grid(rows: Sequence[Mapping[str, Any]], s: Strongest, out: Path) -> tuple[Path, str] | None:
    """The best attack's reconstruction of the setting (first seed and batch with images), originals on top."""
    mine = [r for r in rows if (r.get("kind") or "attack") == "attack" and usable(r) and r.get("attack") == s.attack
            and threat_model(r) == s.threat_model and (r.get("dataset"), r.get("model"), r.get("defense"),
                                                       batch_size(r)) == (s.dataset, s.model, s.defense, s.batch_size)
            and npz_path(r) and Path(npz_path(r)).is_file()]
    if not mine:
        return None
    first = min(mine, key=lambda r: (r.get("seed") or 0, r.get("batch") or 0))
    try:
        with np.load(npz_path(first), allow_pickle=False) as arrays:
            x, rec = arrays["x"], arrays["reconstruction"]
            order = arrays["order"].tolist() if "order" in arrays else list(range(min(len(x), len(rec))))
        matched = rec[np.asarray(order, dtype=np.int64)]
        psnr = list((first.get("per_sample") or {}).get("psnr") or [])
        n = min(8, len(x))
        caption = (f"{s.defense} · B = {s.batch_size} · {s.attack} (RMSE {num(first.get('rmse'))}, seed "
                   f"{first.get('seed')}, batch {first.get('batch')})")
        path = save_grid(out / "grids" / f"{slug(s.threat_model, s.dataset, s.model, s.defense, s.batch_size)}.png",
                         x[:n], matched[:n], scores=[float(v) if finite(v) else math.nan for v in psnr[:n]]
                         if len(psnr) == len(x) else None)
    except (OSError, ValueError, KeyError, IndexError, ConfigError):
        return None  # an unreadable npz: the setting is shown without its grid
    return path, caption


def attack_section(threat: str, rows: Sequence[Mapping[str, Any]], best: Sequence[Strongest],
                   points: Sequence[PrivacyUtilityPoint], util: Mapping[tuple, Mapping[str, Any]],
                   out: Path, drawn: Drawn, bounds: Mapping[tuple, float] | None = None) -> str:
    """The HTML of one gradient threat model's section (its settings in ``best`` / ``points``)."""
    parts = []
    mine = [s for s in best if s.threat_model == threat]
    found = verdicts([p for p in points if p.threat_model == threat], BUDGETS)
    for dataset, model in dict.fromkeys((s.dataset, s.model) for s in mine):
        here = [s for s in mine if (s.dataset, s.model) == (dataset, model)]
        pts = [p for p in points if p.threat_model == threat and (p.dataset, p.model) == (dataset, model)]
        sizes = sorted({s.batch_size for s in here})
        name = f"{dataset} · {model}"
        parts.append(f"<h3>{esc(name)}</h3>")
        measured = any(finite(p.utility_loss) for p in pts if p.defense != "none")
        lines = verdict_lines([v for v in found if (v.dataset, v.model) == (dataset, model)
                               and (measured or math.isinf(v.budget))])
        if not measured:
            lines.append("Utility was not measured for any defense here, so the ranking ignores its cost.")
        parts.append('<ul class="verdict">' + "".join(f"<li>{line}</li>" for line in lines) + "</ul>")
        parts.append(muted("Utility loss = increase of the final training loss over the undefended run at the "
                           f"same batch size (nats); budgets {', '.join(f'{u:g}' for u in BUDGETS if finite(u))} "
                           "and any cost. RMSE is the strongest attack's mean over the attacked images (higher = "
                           "leaks less)."))
        parts.append("<h4>Every attack against every defense setting (Table 4)</h4>")
        parts.append(muted("Mean RMSE over trials (± standard deviation when more than one); the strongest "
                           "attack of each column is highlighted; hover n/a and failed cells for the reason; † = "
                           "some trials were not usable."))
        for b in sizes:
            parts.append(f"<h5>B = {b}</h5>" + table4(here, b, bounds))
        tag = slug(threat, dataset, model)
        heat = sd_heatmap(here, out / "plots" / f"sd-{tag}.png", title=f"S_D — {name}")
        if heat is not None:
            drawn.plots.append(heat)
            parts.append("<h4>Strongest attack per setting (S<sub>D</sub>)</h4>"
                         + figure(heat, out, f"S_D heatmap, {name}"))
        parts.append("<h4>Utility per defense setting and batch size (Table 5)</h4>")
        parts.append(table5(util, dataset, model, [s.defense for s in here], sizes))
        fig3 = pareto_plot(pts, out / "plots" / f"privacy-utility-{tag}.png", title=f"{name}")
        if fig3 is not None:
            drawn.plots.append(fig3)
            bound_note = (f" Crosses: the {CRAMER_RAO} — box-clamped attacks can go below it, so it is not a "
                          "lower bound on what an attack achieves." if any(finite(p.bound) for p in pts) else "")
            parts.append("<h4>Privacy against utility (Figure 3)</h4>" + figure(fig3, out, f"Figure 3, {name}")
                         + muted("One point per defense setting and batch size; the line of each batch size is its "
                                 "Pareto front (no other setting leaks less at a lower utility loss)." + bound_note))
        grids = [g for g in (_grid(rows, s, out) for s in here if s.attack) if g is not None]
        drawn.grids += [p for p, _ in grids]
        parts.append("<h4>Best reconstruction per setting</h4>")
        parts.append('<div class="grids">' + "".join(figure(p, out, c) for p, c in grids) + "</div>" if grids else
                     muted("No reconstructions saved."))
        refused = [r for r in rows if r.get("images_refused") and (r.get("dataset"), r.get("model")) == (dataset, model)]
        if refused:
            parts.append(muted(f"Images of {len(refused)} trial(s) not shown: {esc(refused[0]['images_refused'])}"
                               f" (trial {esc(refused[0].get('key'))})."))
    return "".join(parts)


__all__ = ["attack_section", "verdict_sentence", "verdict_lines", "table4", "table5", "budget_text", "Drawn",
           "SUMMARY_BUDGET"]
