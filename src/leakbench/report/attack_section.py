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
from ..evaluation.verdicts.rules import BUDGETS, PrivacyUtilityPoint, verdicts
from ..evaluation.verdicts.strongest import AttackScore, Strongest
from ..evaluation.verdicts.rows import batch_size, finite, npz_path, threat_model, usable
from ..evaluation.verdicts.utility import utility_for, utility_loss
from .grid import save_grid
from .identify_section import attack_cell, identify_table
from .markup import MISSING, esc, figure, hover, muted, num, slug, table
from .navigation import METRIC_NAMES, PICKABLE, collapsible, metric_labels, per_metric
from .score_table import defense_header, metric_means, metric_table, ordered_defenses
from .plots import CRAMER_RAO, pareto_plot, sd_heatmap
from .text_section import is_text_setting, text_block
from .verdict_text import SUMMARY_BUDGET, ci, ci_n, summary_sentence, verdict_table
from ..evaluation.sweep_spec.modality import is_mismatch

GAIN_NOTE = ("a negative utility loss: the defended run ended with a lower training loss than the undefended run of "
             "the same seed; where its interval spans 0 the difference is within run-to-run noise")


@dataclass
class Drawn:
    """Files a section wrote (the report lists them)."""

    plots: list[Path] = field(default_factory=list)
    grids: list[Path] = field(default_factory=list)


def _score_cell(a: AttackScore | None, best: bool) -> Any:
    if a is None:
        return (hover("·", "not run: the spec made no trial of this attack here"), "na")
    if a.not_applicable:
        return (hover("n/a", a.not_applicable), "na")
    if not a.trials:
        why = "; ".join(a.reasons) or "failed"
        return (hover("failed", f"{a.failed} trial(s): {why}"), "na")
    text = ci_n(a.ci) if a.ci.n else num(a.rmse)
    if a.failed:
        text = hover(f"{text} †", f"{a.failed} of {a.failed + a.trials} trials not usable (averaged over the "
                                  f"rest): {'; '.join(a.reasons)}")
    chance = not a.below_chance
    if chance:
        text = hover(text, f"not significantly below chance ({num(a.chance_rmse)}, a flat image at the data mean; "
                           f"chance − RMSE = {ci_n(a.margin)}): no evidence the attack learnt anything here")
    return (text, " ".join(c for c in ("best" if best else "", "chance" if chance else "") if c))


def table4(best: Sequence[Strongest], size: int, bounds: Mapping[tuple, float] | None = None) -> str:
    """Attacks (rows) × defense settings (columns, grouped by family) at one batch size; S_D highlighted.

    ``bounds``: (threat model, dataset, model, defense, B) → Cramér–Rao value, shown as a last row.
    """
    here = {s.defense: s for s in best if s.batch_size == size}
    groups = ordered_defenses(list(here))
    columns = [d for _, ds in groups for d in ds]
    attacks = sorted({a.attack for s in here.values() for a in s.scores})
    registry = {a.attack: a.name for s in here.values() for a in s.scores}
    head = defense_header(groups)
    rows = []
    for name in attacks:
        row: list[Any] = [attack_cell(name, registry.get(name))]
        for d in columns:
            s = here[d]
            row.append(_score_cell(next((a for a in s.scores if a.attack == name), None), s.attack == name))
        rows.append(row)
    footer = [["<b>strongest</b>"] + [esc(here[d].attack or "none ran") for d in columns]]
    footer.append([hover("<b>S<sub>D</sub></b> (capped)", "the strongest attack's RMSE per batch, capped at the "
                         "batch's chance RMSE (an attacker can always output the flat image), mean ± 95 % bootstrap "
                         "interval over batches")]
                  + [(ci_n(here[d].sd), "stops" if here[d].stops else "") for d in columns])
    footer.append([hover("per-image strongest", "for each image the lowest RMSE any attack reached (capped at "
                         "chance), mean ± 95 % interval over batches: the bound of an adversary who picks the best "
                         "attack per image")] + [ci_n(here[d].per_image) for d in columns])
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
    """Utility per defense setting and batch size (Table 5): final train loss, test accuracy and utility loss,
    each mean ± 95 % t-interval over the training seeds (n), or ``diverged`` with the reason."""
    keys = [k for k in util if k[:2] == (dataset, model)]
    if not keys:
        return muted("No utility trials for this dataset and model (add a <code>utility:</code> section to the "
                     "spec to measure each defense's cost), so no Table 5, Figure 3 or budgeted verdict.")
    if all(k[3] == 0 for k in keys):
        sizes = [0]  # an old store: one utility per defense, for every batch size
    all_defs = list(dict.fromkeys([*defenses, *(k[2] for k in keys)]))
    columns = [d for _, ds in ordered_defenses(all_defs) for d in ds]
    head = ('<tr><th class="l" rowspan="2">defense</th>'
            + "".join(f'<th colspan="3">{"every B" if b == 0 else f"B = {b}"}</th>' for b in sizes)
            + "</tr><tr>" + "<th>train loss</th><th>test acc.</th><th>utility loss</th>" * len(sizes) + "</tr>")
    rows, gains, seeds = [], False, set()
    for d in columns:
        row: list[Any] = []
        eps = []
        for b in sizes:
            u = utility_for(util, dataset, model, d, b) or {}
            eps.append((b, u.get("epsilon")))
            if u.get("diverged"):
                row += [(hover("diverged", u["diverged"]), "chance"), MISSING, (MISSING, "na")]
                continue
            cost = utility_loss(util, dataset, model, d, b)
            seeds.add(int(u.get("trials") or 0))
            loss_text = ci(cost.interval) if d != "none" else ("0" if u else MISSING)
            if cost.gain:
                gains = True
                loss_text = hover(f"{loss_text} *", GAIN_NOTE)
            train = ci(u.get("train_loss_ci")) if u.get("train_loss_ci") is not None and u.get(
                "train_loss_ci").n else num(u.get("train_loss"))
            seen = u.get("samples_seen")
            if finite(seen):
                train = hover(train, f"{seen:.0f} samples seen in training")
            acc = u.get("test_accuracy_ci")
            row += [train, ci(acc) if acc is not None and acc.n else num(u.get("test_accuracy")),
                    (loss_text, "gain" if cost.gain else "")]
        rows.append([_eps_label(d, eps), *row])
    n = ", ".join(str(k) for k in sorted(seeds - {0})) or "0"
    note = muted(f"Mean ± 95 % Student-t interval over {n} training seed(s) per cell; utility loss = final "
                 "training-loss increase over the undefended run of the same seed (paired). "
                 + (f"* {GAIN_NOTE[0].upper()}{GAIN_NOTE[1:]}. " if gains else "")
                 + "<i>diverged</i>: the training loss was not finite or ended above the untrained model's — no "
                 "utility number, never within a budget, never on Figure 3.")
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


def grid_rows(grids: Sequence[tuple[int, tuple[Path, str]]], out: Path) -> str:
    """Image grids laid out by batch size: one row per B, headed by it, each caption directly under its grid."""
    parts = [muted("One row per batch size; in each grid the originals are on top and the best attack's "
                   "reconstructions under them, with each image's PSNR.")]
    for b in sorted(dict.fromkeys(b for b, _ in grids)):
        figures = "".join(figure(p, out, c) for size, (p, c) in grids if size == b)
        parts.append(f'<div class="grid-row" data-batch-size="{b}"><h5>B = {b}</h5><div class="grids">{figures}'
                     "</div></div>")
    return "".join(parts)


def attack_section(threat: str, rows: Sequence[Mapping[str, Any]], best: Sequence[Strongest],
                   points: Sequence[PrivacyUtilityPoint], util: Mapping[tuple, Mapping[str, Any]],
                   out: Path, drawn: Drawn, bounds: Mapping[tuple, float] | None = None) -> str:
    """The HTML of one gradient threat model's section (its settings in ``best`` / ``points``)."""
    parts = []
    mine = [s for s in best if s.threat_model == threat]
    found = verdicts([p for p in points if p.threat_model == threat], BUDGETS)
    for dataset, model in dict.fromkeys((s.dataset, s.model) for s in mine):
        here = [s for s in mine if (s.dataset, s.model) == (dataset, model)]
        if all(a.not_applicable and is_mismatch(a.not_applicable) for s in here for a in s.scores):
            continue  # an image model or attack on text (or back): listed under "not applicable"
        text = is_text_setting(here)
        label = "token error (1 − token accuracy)" if text else "RMSE"
        pts = [p for p in points if p.threat_model == threat and (p.dataset, p.model) == (dataset, model)]
        sizes = sorted({s.batch_size for s in here})
        name = f"{dataset} · {model}"
        parts.append(f"<h3>{esc(name)}</h3>")
        measured = any(finite(p.utility_loss) for p in pts if p.defense != "none")
        mine_v = [v for v in found if (v.dataset, v.model) == (dataset, model) and (measured or math.isinf(v.budget))]
        budget = SUMMARY_BUDGET if measured else math.inf
        lines = [summary_sentence([v for v in mine_v if v.budget == budget])]
        if not measured:
            lines.append("Utility was not measured for any defense here, so the ranking ignores its cost.")
        parts.append('<ul class="verdict">' + "".join(f"<li>{line}</li>" for line in lines) + "</ul>")
        parts.append("<details><summary>The verdict per batch size and budget</summary>"
                     + verdict_table(mine_v, metric=label) + "</details>")
        if any(s.incomplete for s in here):
            why = next(s.incomplete for s in here if s.incomplete)
            parts.append(muted(esc(why[0].upper() + why[1:]) + "."))
        parts.append(muted(f"A defense <i>stops every attack run here</i> when no attack's {esc(label)} is "
                           "significantly below chance (paired over batches); otherwise the pick has the highest "
                           "S<sub>D</sub> and every defense not significantly below it (paired bootstrap over the "
                           "same batches) is <i>tied</i>. Within a budget = the upper end of the utility loss's 95 % "
                           "interval ≤ the budget (nats); budgets "
                           f"{', '.join(f'{u:g}' for u in BUDGETS if finite(u))} and any cost. {esc(label)}: higher "
                           "= leaks less."))
        if text:
            parts.append(_text_setting(rows, here, pts, util, sizes, out, drawn, threat, dataset, model, label))
            continue
        parts.append("<h4>Every attack against every defense setting (Table 4)</h4>")
        parts.append(f"<p>{metric_labels('show:')}</p>")
        parts.append(per_metric({
            "rmse": muted("Mean RMSE ± 95 % bootstrap interval over batches (n = batches); the strongest attack of "
                          "each column is highlighted; grey = not significantly below chance; hover n/a and failed "
                          "cells for the reason; † = some trials were not usable."),
            **{m: muted(f"Mean {esc(METRIC_NAMES[m])} over the usable trials (n = trials); the best value of each "
                        "column in bold. S<sub>D</sub> still ranks attacks by RMSE (the <i>strongest</i> row).")
               for m in PICKABLE if m != "rmse"}}))
        means = metric_means([r for r in rows if threat_model(r) == threat])
        for b in sizes:
            parts.append(f"<h5>B = {b}</h5>" + per_metric(
                {m: table4(here, b, bounds) if m == "rmse" else metric_table(here, b, means, m) for m in PICKABLE}))
        parts.append(identify_table(rows, threat, dataset, model))
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
                         + muted("One panel per batch size; one point per defense setting with 95 % intervals on "
                                 "both axes; the line is the Pareto front (no other setting leaks less at a lower "
                                 "utility loss), and only its points are labelled (the rest: marker = family). "
                                 "Diverged settings are listed under the panel, not placed on the axis."
                                 + bound_note))
        grids = [(s.batch_size, g) for s in here if s.attack and (g := _grid(rows, s, out)) is not None]
        drawn.grids += [p for _, (p, _c) in grids]
        parts.append(collapsible("", "Best reconstruction per setting", grid_rows(grids, out), open=False, level=4)
                     if grids else "<h4>Best reconstruction per setting</h4>" + muted("No reconstructions saved."))
        refused = [r for r in rows if r.get("images_refused") and (r.get("dataset"), r.get("model")) == (dataset, model)]
        if refused:
            parts.append(muted(f"Images of {len(refused)} trial(s) not shown: {esc(refused[0]['images_refused'])}"
                               f" (trial {esc(refused[0].get('key'))})."))
    return "".join(parts)


def _text_setting(rows, here, pts, util, sizes, out: Path, drawn: Drawn, threat: str, dataset: str, model: str,
                  label: str) -> str:
    """A text (dataset, model): the score tables and sentence pairs (:mod:`.text_section`), S_D, Table 5 and
    Figure 3 on the token error."""
    name = f"{dataset} · {model}"
    parts = [text_block(rows, here, sizes)]
    tag = slug(threat, dataset, model)
    heat = sd_heatmap(here, out / "plots" / f"sd-{tag}.png", title=f"S_D — {name}", metric="token error")
    if heat is not None:
        drawn.plots.append(heat)
        parts.append("<h4>Strongest attack per setting (S<sub>D</sub>)</h4>"
                     + figure(heat, out, f"S_D heatmap (token error = 1 − token accuracy), {name}"))
    parts.append("<h4>Utility per defense setting and batch size (Table 5)</h4>")
    parts.append(table5(util, dataset, model, [s.defense for s in here], sizes)
                 + muted("Test accuracy here: held-out next-token accuracy (decoder) or classification accuracy "
                         "(encoder); training loss: mean cross-entropy per token."))
    fig3 = pareto_plot(pts, out / "plots" / f"privacy-utility-{tag}.png", title=name, metric="token error")
    if fig3 is not None:
        drawn.plots.append(fig3)
        parts.append("<h4>Privacy against utility (Figure 3)</h4>" + figure(fig3, out, f"Figure 3, {name}")
                     + muted(f"S_D as {esc(label)} against the utility loss, one panel per batch size."))
    return "".join(parts)


__all__ = ["attack_section", "table4", "table5", "grid_rows", "Drawn"]
