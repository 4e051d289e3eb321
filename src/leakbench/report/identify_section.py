"""Identifiability and shift-tolerant scores per attack, grouped by the attacks' threat tags.

One table per (threat model, dataset, model): a row per attack and defense setting with the attack's threat tags
(what it needs: :data:`leakbench.attacks.THREAT_TAGS`), and the mean over its usable trials of IIP (pixel space),
IIP in the observed model's penultimate features, registered PSNR, LPIPS (when the user supplied its weights) and every
plug-in metric the trials stored (:func:`plugin_columns`), each beside its chance level (a flat image at the
data mean scored by the same metric).  Rows are ordered by tags, so attacks that need the same thing sit together.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..attacks import THREAT_TAGS, attack_tags
from ..evaluation.verdicts.rows import finite, threat_model, usable
from .markup import MISSING, esc, hover, muted, num, table

#: (score in a trial's metrics, its chance, column title, digits)
COLUMNS = (("iip_pixel", "chance_iip_pixel", "IIP (pixel)", 2),
           ("iip_features", "chance_iip_features", "IIP (model features)", 2),
           ("psnr_registered", "chance_psnr_registered", "registered PSNR (dB)", 2),
           ("lpips", "chance_lpips", "LPIPS", 3))


def tag_badges(tags: Sequence[str]) -> str:
    """The tags as small hoverable badges (— when the attack declares none)."""
    if not tags:
        return hover(MISSING, "this attack declares no threat tags")
    return " ".join(f'<span class="tag">{hover(esc(t), THREAT_TAGS.get(t, t))}</span>' for t in tags)


def _group(tags: Sequence[str]) -> tuple[int, ...]:
    """The sort key of a tag set: its tags' places in the vocabulary (what is shared first, then what else)."""
    vocab = list(THREAT_TAGS)
    return tuple(sorted(vocab.index(t) if t in vocab else len(vocab) for t in tags))


def attack_name(row: Mapping[str, Any]) -> str:
    """The registry name of a row's attack (``row["attack"]`` is the spec's label, e.g. "ig")."""
    return str((row.get("spec") or {}).get("attack") or row.get("attack") or "")


def attack_cell(label: str, name: str | None = None) -> str:
    """An attack's label in a table, its threat tags shown on hover; an adaptive attack (one that knows the defense)
    is marked so in the cell, since S_D against it is the defense's score against an adaptive adversary."""
    tags = attack_tags(name or label)
    if not tags:
        return esc(label)
    cell = hover(esc(label), "needs: " + ", ".join(tags))
    if "adaptive" in tags:
        cell += f' <span class="tag">{hover("adaptive", THREAT_TAGS.get("adaptive", "adaptive"))}</span>'
    return cell


#: the number formats a stored plug-in metric may ask for (the store is a file: nothing in it sizes the output)
_FMT = re.compile(r"\.[0-9]{1,2}[efg%]")


def plugin_columns(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(score, its chance, column title, number format) of every plug-in metric the rows' trials stored, in first-seen
    order (from each trial's ``metric_info``: the report never imports the plug-in)."""
    found: dict[str, tuple[str, str, str, str]] = {}
    for r in rows:
        info = (r.get("metrics") or {}).get("metric_info")
        for name, meta in (info.items() if isinstance(info, Mapping) else ()):
            if not isinstance(name, str) or name in found or not isinstance(meta, Mapping):
                continue
            fmt = meta.get("fmt") if isinstance(meta.get("fmt"), str) and _FMT.fullmatch(meta["fmt"]) else ".4g"
            arrow = "↑" if meta.get("higher_is_better") is True else "↓"
            label = str(meta.get("label") or name)[:60]
            found[name] = (name, f"chance_{name}", f"{label} {arrow} (plug-in {str(meta.get('origin', ''))[:60]})",
                           fmt)
    return list(found.values())


def _shown(value: Any, digits: int | str) -> str:
    """A cell's number: ``digits`` decimals (leakbench's scores) or a checked format spec (a plug-in's)."""
    if isinstance(digits, int) or not finite(value):
        return num(value, digits if isinstance(digits, int) else 3)
    return format(float(value), digits)


def _means(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple]) -> dict[tuple[str, str],
                                                                                dict[str, tuple[float, int]]]:
    sums: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in rows:
        metrics = r.get("metrics") or {}
        into = sums.setdefault((r.get("attack") or "", r.get("defense") or "none"), {})
        for key, chance, _, _ in columns:
            for k in (key, chance):
                if finite(metrics.get(k)):
                    into.setdefault(k, []).append(float(metrics[k]))
    return {k: {m: (sum(v) / len(v), len(v)) for m, v in by.items()} for k, by in sums.items()}


def identify_table(rows: Sequence[Mapping[str, Any]], threat: str, dataset: str, model: str) -> str:
    """The HTML table of one setting, or "" when no usable trial stored these scores."""
    mine = [r for r in rows if (r.get("kind") or "attack") == "attack" and usable(r) and threat_model(r) == threat
            and (r.get("dataset"), r.get("model")) == (dataset, model)]
    columns = [*COLUMNS, *plugin_columns(mine)]
    means = _means(mine, columns)
    shown = [c for c in columns if any(c[0] in by for by in means.values())]
    if not shown:
        return ""
    names = {r.get("attack") or "": attack_name(r) for r in mine}
    order = sorted(means, key=lambda k: (_group(attack_tags(names[k[0]])), k[0], k[1] != "none", k[1]))
    body = []
    for attack, defense in order:
        by = means[(attack, defense)]
        row: list[Any] = [esc(attack), tag_badges(attack_tags(names[attack])), esc(defense)]
        for key, chance, _, digits in shown:
            if key not in by:
                row.append((MISSING, "na"))
                continue
            value, n = by[key]
            c = by.get(chance, (None, 0))[0]
            row.append(hover(f"{_shown(value, digits)} <small>(chance {_shown(c, digits)})</small>",
                             f"mean over {n} trial(s); chance = the same metric on a flat image at the data mean"))
        body.append(row)
    header = ["attack", "needs", "defense", *(title for _, _, title, _ in shown)]
    note = muted("IIP: the fraction of originals whose reconstruction's nearest neighbour (pixel space) in a pool of "
                 "the batch plus up to 256 other images of the dataset is that original (breaching's image "
                 "identifiability precision); in model features, the same with the distance between the observed "
                 "model's penultimate features. Registered PSNR: PSNR after the best circular shift of at most 2 pixels. "
                 "Each beside its chance level; rows grouped by what the attack needs (hover a tag)."
                 + (" Plug-in metrics (↑: higher = more leakage, ↓: lower) are the means their plug-ins' functions "
                    "gave on the matched pairs, as stored with each trial." if any(c not in COLUMNS for c in shown)
                    else ""))
    title = "Identifiability and plug-in metrics" if any(c not in COLUMNS for c in shown) else "Identifiability"
    return f"<h4>{title} by threat needs</h4>" + table(header, body, left=3) + note
