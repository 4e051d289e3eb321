"""The report's text parts: the score table of a text setting and original against recovered sentences.

A text trial (:func:`leakbench.evaluation.trials.attack.text_result`) stores token accuracy after Hungarian matching,
ROUGE-1/2/L, the exact-sequence rate and the same scores of unigram draws (the chance level).  The verdict
logic ranks by the token error 1 − token accuracy (:func:`leakbench.evaluation.verdicts.rows.scored`); here every
number is shown as token accuracy again (higher = more leakage), with its 95 % bootstrap interval over batches
(mirrored: the interval of 1 − error), n, and the chance level beside it.

Instead of image grids, a few of the strongest attack's recovered sentences are set under their originals,
each token of the original that the recovered sentence holds at the same position highlighted.  Every
sentence is HTML-escaped (the text is the user's data).
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..evaluation.sweep_spec.modality import is_mismatch
from ..evaluation.verdicts.stats import Interval
from ..evaluation.verdicts.strongest import AttackScore, Strongest
from ..evaluation.verdicts.rows import batch_size, finite, npz_path, threat_model
from .markup import MISSING, esc, hover, muted, num, table
from .score_table import ordered_defenses

__all__ = ["is_text_setting", "accuracy", "text_scores_table", "text_sentences", "mark_tokens", "TEXT_CSS"]

#: styles of the sentence pairs (matching tokens highlighted)
TEXT_CSS = """
table.sentences td{text-align:left;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.8rem;
                   white-space:pre-wrap} table.sentences mark{background:#c8eec8;padding:0}
table.sentences mark.miss{background:#f6d5d5}
"""
#: sentences shown per setting
SHOWN = 4


def is_text_setting(here: Sequence[Strongest]) -> bool:
    """True when the settings are scored on text (token error)."""
    return any(s.metric == "token_error" for s in here)


def accuracy(interval: Interval) -> Interval:
    """The token-accuracy interval of a token-error interval (1 − error: the same resamples, mirrored)."""
    return Interval(mean=1.0 - interval.mean, low=1.0 - interval.high, high=1.0 - interval.low, n=interval.n,
                    method=interval.method)


def _ci(interval: Interval) -> str:
    if not interval.n or not finite(interval.mean):
        return MISSING
    half = (f" ± {num((interval.high - interval.low) / 2)}" if finite(interval.low) and finite(interval.high)
            else "")
    return f"{num(interval.mean)}{half} (n = {interval.n})"


def _means(rows: Sequence[Mapping[str, Any]], setting: tuple, attack: str) -> dict[str, float | None]:
    """Mean ROUGE-1/2/L, exact rate and chance scores of the done text trials of one attack in one setting."""
    mine = [r.get("metrics") or {} for r in rows
            if r.get("status") == "done" and (r.get("metrics") or {}).get("modality") == "text"
            and r.get("attack") == attack and (threat_model(r), r.get("dataset"), r.get("model"), r.get("defense"),
                                               batch_size(r)) == setting]
    out: dict[str, float | None] = {}
    for key in ("rouge1", "rouge2", "rougeL", "exact", "chance_token_acc", "chance_rouge1", "sequences",
                "flagged_exact"):
        values = [float(m[key]) for m in mine if finite(m.get(key))]
        out[key] = sum(values) / len(values) if values else None
    out["sequences"] = sum(float(m.get("sequences") or 0) for m in mine) or None
    flagged = [float(m["flagged_exact"]) for m in mine if finite(m.get("flagged_exact"))]
    out["flagged_exact"] = sum(flagged) if flagged else None
    return out


def _cell(a: AttackScore) -> Any:
    if a.not_applicable:
        return (hover("n/a", a.not_applicable), "na")
    if not a.trials:
        return (hover("failed", f"{a.failed} trial(s): {'; '.join(a.reasons) or 'failed'}"), "na")
    text = _ci(accuracy(a.ci)) if a.ci.n else num(1.0 - a.rmse)
    if a.failed:
        text = hover(f"{text} †", f"{a.failed} of {a.failed + a.trials} trials not usable: {'; '.join(a.reasons)}")
    return text


def text_scores_table(rows: Sequence[Mapping[str, Any]], here: Sequence[Strongest], size: int) -> str:
    """Defense settings × attacks at batch size ``size``: token accuracy ± 95 % CI (n = batches), ROUGE-1/2/L,
    exact rate, and the chance level (unigram draws) of each; the strongest attack of each setting in bold."""
    mine = {s.defense: s for s in here if s.batch_size == size}
    columns = [d for _, ds in ordered_defenses(list(mine)) for d in ds]
    body = []
    for d in columns:
        s = mine[d]
        setting = (s.threat_model, s.dataset, s.model, d, size)
        for a in sorted(s.scores, key=lambda a: a.attack):
            if a.not_applicable and is_mismatch(a.not_applicable):
                continue  # an image attack: listed under "not applicable"
            m = _means(rows, setting, a.attack) if a.trials else {}
            best = a.attack == s.attack
            chance = a.trials and not a.below_chance
            acc = _cell(a)
            if chance and a.trials:
                acc = (hover(acc, "not significantly above chance (paired over batches): no evidence the attack "
                                  "learnt anything here"), "chance")
            elif best:
                acc = (acc, "best")
            flagged = m.get("flagged_exact")
            body.append([esc(d), esc(a.attack) + (" <b>(strongest)</b>" if best else ""), acc,
                         num(m.get("rouge1")), num(m.get("rouge2")), num(m.get("rougeL")),
                         num(m.get("exact")) + (hover(f" ({int(flagged)} of {num(m.get('sequences'), 0)} flagged)",
                                                      "sequences the attack flagged exact by its own test")
                                                if finite(flagged) else ""),
                         num(m.get("chance_token_acc")), num(m.get("chance_rouge1")),
                         num(m.get("sequences"), 0)])
        body.append([esc(d), "<b>S<sub>D</sub></b> (capped at chance)",
                     (_ci(accuracy(s.sd)), "stops" if s.stops else ""), MISSING, MISSING, MISSING, MISSING,
                     num(1.0 - s.chance_rmse) if finite(s.chance_rmse) else MISSING, MISSING, MISSING])
    return (table(["defense", "attack", "token accuracy ± 95 % CI", "ROUGE-1", "ROUGE-2", "ROUGE-L", "exact rate",
                   "chance token acc.", "chance ROUGE-1", "sequences"], body, left=2, css="t4")
            + muted("Token accuracy after Hungarian matching of recovered to original sequences (higher = more "
                    "leakage), mean ± 95 % bootstrap interval over batches (n = batches); ROUGE and the exact rate "
                    "are means over the usable trials; <i>chance</i>: the same scores of sequences drawn from the "
                    "corpus's unigram distribution. Grey = not significantly above chance. S<sub>D</sub> and the "
                    "verdict rank by token error = 1 − token accuracy."))


@functools.lru_cache(maxsize=4)
def _tokenizer(dataset: str, options_json: str):
    from ..data import load

    return load(dataset, **json.loads(options_json)).tokenizer


def _pieces(tok, ids: Sequence[int]) -> list[str]:
    return [tok.decode([int(i)]) for i in ids]


def mark_tokens(original: Sequence[str], recovered: Sequence[str], same: Sequence[bool]) -> tuple[str, str]:
    """Two HTML lines: the original's tokens, each escaped and highlighted where ``same`` (the recovered
    sequence holds it at that position), and the recovered tokens, highlighted where they match and marked
    where they do not."""
    top = "".join(f"<mark>{esc(t)}</mark>" if i < len(same) and same[i] else esc(t) for i, t in enumerate(original))
    bottom = "".join(f"<mark>{esc(t)}</mark>" if i < len(same) and same[i] else f'<mark class="miss">{esc(t)}</mark>'
                     for i, t in enumerate(recovered))
    return top, bottom


def text_sentences(rows: Sequence[Mapping[str, Any]], s: Strongest, shown: int = SHOWN) -> str | None:
    """A few originals and the strongest attack's recovered sentences of setting ``s`` (first seed and batch
    with saved ids), tokens at the same position highlighted; None when none were saved."""
    mine = [r for r in rows if (r.get("kind") or "attack") == "attack" and r.get("status") == "done"
            and r.get("attack") == s.attack and threat_model(r) == s.threat_model
            and (r.get("dataset"), r.get("model"), r.get("defense"), batch_size(r))
            == (s.dataset, s.model, s.defense, s.batch_size) and npz_path(r) and Path(npz_path(r)).is_file()]
    if not mine:
        return None
    mine.sort(key=lambda r: (r.get("seed") or 0, r.get("batch") or 0))
    spec = mine[0].get("spec") or {}
    try:
        tok = _tokenizer(str(spec.get("dataset")), json.dumps(spec.get("data_options") or {}, sort_keys=True))
    except Exception:  # noqa: BLE001 - the data cannot be loaded here: the setting is shown without sentences
        return None
    drop = {tok.pad_id, tok.eos_id}
    body, used = [], []
    for row in mine:  # the first batches in (seed, batch) order, until ``shown`` sentences
        if len(body) >= 2 * shown:
            break
        try:
            with np.load(npz_path(row), allow_pickle=False) as arrays:
                x, rec, order = arrays["x"], arrays["reconstruction"], arrays["order"].tolist()
        except (OSError, ValueError, KeyError):
            continue  # an unreadable file: the next batch
        used.append(f"seed {row.get('seed')} batch {row.get('batch')}")
        for i in range(min(shown - len(body) // 2, len(x))):
            o = [int(t) for t in x[i] if int(t) not in drop]
            j = order[i] if i < len(order) else -1
            r = [int(t) for t in rec[j] if int(t) not in drop] if 0 <= j < len(rec) else []
            same = [k < len(r) and r[k] == t for k, t in enumerate(o)]
            top, bottom = mark_tokens(_pieces(tok, o), _pieces(tok, r), same)
            acc = sum(same) / len(o) if o else 0.0
            body.append([str(len(body) // 2 + 1), "original", top, ""])
            body.append(["", "recovered", bottom or muted("(nothing)"), num(acc)])
    if not body:
        return None
    caption = f"{s.defense} · B = {s.batch_size} · {s.attack} ({', '.join(used)})"
    return f"<h5>{esc(caption)}</h5>" + table(["#", "", "sentence", "token acc."], body, left=3, css="sentences")


def text_block(rows: Sequence[Mapping[str, Any]], here: Sequence[Strongest], sizes: Sequence[int]) -> str:
    """The score tables (one per batch size) and the sentence pairs of one text (dataset, model)."""
    parts = ["<h4>Text reconstruction scores</h4>"]
    for b in sizes:
        parts.append(f"<h5>B = {b}</h5>" + text_scores_table(rows, here, b))
    shown = [t for s in here if s.attack and (t := text_sentences(rows, s)) is not None]
    parts.append("<h4>Original and recovered sentences</h4>")
    parts.append(muted("Per setting, the strongest attack's recovery of the first batch: each original over its "
                       "matched recovered sequence; green = the same token at the same position, red = a "
                       "recovered token that differs.") + "".join(shown) if shown
                 else muted("No recovered sentences saved."))
    return "".join(parts)
