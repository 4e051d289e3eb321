"""The static HTML report of a sweep: ``write_report("results.db", "report/")`` → ``report/index.html``.

The page answers "which defense should I use, at what cost?" per threat model:

- a summary: the threat models the sweep covered, one verdict line each, and which rows assume a
  malicious server;
- per gradient threat model (eavesdropper, informed eavesdropper, malicious server): the verdict per utility
  budget, Table 4, the S_D heatmap, Table 5, Figure 3 with its Pareto front, the best reconstruction per
  setting (:mod:`.attack_section`; Liu et al. 2024);
- published weights: counts of recovered training points beside their chance controls; membership: AUC,
  TPR at low FPR and the ROC (:mod:`.weights_section`);
- attacks that did not apply (with the reason) and failed trials; the spec; CSV/Parquet downloads.

Plots and grids are PNG files beside ``index.html`` referenced by relative paths, so the report opens from
disk in a browser with no server.  Every label is HTML-escaped, and ``$`` in labels is escaped for
matplotlib.  An inline script records how many images decoded and how much each threat-model section holds
(``scripts/check_report.py`` reads both in headless Chromium).
"""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from .. import __version__
from ..errors import ConfigError
from ..evaluation.membership.verdict import membership_defenses
from ..evaluation.store import Store
from ..evaluation.trials.trial import THREAT_MODELS
from ..evaluation.verdicts.utility import bounds_table, utility_table
from ..evaluation.verdicts.rows import finite, invalid_result, threat_model, usable
from ..evaluation.verdicts.strongest import is_public, strongest
from ..evaluation.verdicts.weights import membership_table, weights_table
from ..evaluation.verdicts.rules import privacy_utility
from .attack_section import Drawn, attack_section
from .text_section import TEXT_CSS
from .verdict_text import summaries
from .federated_section import federated_section, federated_summary
from .rounds_section import rounds_section
from .export import RESULT_COLUMNS, result_records, strongest_records, write_csv, write_parquet
from .markup import esc, muted, table
from .navigation import NAV_CSS, collapsible, contents_bar, metric_radios
from .spec_text import readable_yaml
from .plots import CRAMER_RAO
from .membership_section import reference_section, reference_summary
from .weights_section import (membership_section, membership_summary_line, weights_section,
                              weights_summary_line)

#: a title and what the attacker has, per threat model.
THREATS = {
    "eavesdropper": ("Eavesdropper", "sees one client's update (gradient or weight change) and the model the "
                     "server sent; nothing else."),
    "informed-eavesdropper": ("Informed eavesdropper", "sees the update and also knows the batch's labels and "
                              "the batch-norm statistics."),
    "malicious-server": ("Malicious server", "controls the model it ships: it may put an imprint block in front "
                         "of it, give its first layer trap weights, fish for a class, put a random head on it or "
                         "send every secure-aggregation client its own model (LOKI), and then reads the client's "
                         "update."),
    "published-weights": ("Published weights", "has only the trained model's weights and tries to reconstruct "
                          "its training points."),
    "membership": ("Membership", "has the trained model and a candidate point and asks whether it was in the "
                   "training set."),
}

CSS = TEXT_CSS + """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1250px;
     padding:0 1rem;color:#222}
h1{font-size:1.6rem} h2{font-size:1.3rem;margin-top:2.4rem;border-bottom:1px solid #ddd}
h3{font-size:1.1rem;margin-top:1.6rem} h4{font-size:1rem;margin:1.2rem 0 .3rem} h5{margin:.6rem 0 .1rem}
table{border-collapse:collapse;margin:.4rem 0;font-size:.85rem}
th,td{border:1px solid #ddd;padding:.25rem .5rem;text-align:right} th{background:#f5f5f5;text-align:center}
td.l,th.l{text-align:left} td.best{font-weight:700;background:#dff0df} td.na{color:#999}
td.gain{background:#fff6e0} td.evidence{background:#dff0df} td.chance{color:#888} .eps{color:#555;font-size:.8rem}
span[title]{text-decoration:underline dotted;cursor:help}
img{max-width:100%;border:1px solid #eee} .grids{display:flex;flex-wrap:wrap;align-items:flex-start;gap:.6rem}
.grids figure{display:table;margin:.2rem 0} .grids figcaption{display:table-caption;caption-side:bottom}
.grids img{height:230px;width:auto;max-width:none} .grid-row{margin:.4rem 0 1rem;border-top:1px dashed #ddd}
pre.spec{white-space:pre-wrap;background:#f7f7f7;padding:.6rem;font-size:.8rem}
figure{margin:.4rem 0} figcaption{font-size:.8rem;color:#555} .muted{color:#777;font-size:.85rem}
.tag{font-size:.75rem;background:#eef;border-radius:3px;padding:0 .25rem}
code{background:#f5f5f5} ul.verdict li{margin:.25rem 0} section.threat{margin-bottom:2rem}
.broken{color:#b00020;font-weight:700}
"""

#: runs after load: counts images that decoded (``naturalWidth > 0``) and, per threat-model section, its table
#: rows and decoded images; writes them into ``body[data-images-ok|data-images-total|data-threat-filled]``.
PAGE_CHECK = """
window.addEventListener('load', function () {
  function loaded(i) { return i.complete && i.naturalWidth > 0; }
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(loaded).length;
  document.body.setAttribute('data-images-ok', ok);
  document.body.setAttribute('data-images-total', imgs.length);
  var filled = Array.prototype.slice.call(document.querySelectorAll('section[data-threat]')).map(function (s) {
    var n = s.querySelectorAll('tbody tr').length +
            Array.prototype.slice.call(s.querySelectorAll('img')).filter(loaded).length;
    return s.getAttribute('data-threat') + '=' + n;
  });
  document.body.setAttribute('data-threat-filled', filled.join(' '));
  var el = document.getElementById('image-check');
  if (el) { el.textContent = ok + ' of ' + imgs.length + ' images loaded'; }
});
"""
#: kept for callers of the previous name.
IMAGE_CHECK = PAGE_CHECK


@dataclass
class ReportFiles:
    """What :func:`write_report` wrote (``threats``: the threat models with a section, in page order)."""

    index: Path
    csv: Path
    strongest_csv: Path
    parquet: Path | None = None
    plots: list[Path] = field(default_factory=list)
    grids: list[Path] = field(default_factory=list)
    threats: list[str] = field(default_factory=list)


def _done_but_unusable(r: Mapping[str, Any]) -> bool:
    """A ``done`` row whose result is non-finite (NaN is a failure, not a result)."""
    m = r.get("metrics") or {}
    kind = r.get("kind") or "attack"
    if r.get("status") != "done":
        return False
    if kind == "attack":
        return not usable(r)
    need = {"utility": "train_loss", "weights": "n_train", "membership": "auc", "bound": "exact_rmse"}.get(kind)
    return need is not None and not finite(m.get(need))


def _dropped(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line saying how many finished rows no score uses, and why (non-finite, negative RMSE), or ""."""
    why: dict[str, int] = {}
    for r in rows:
        if _done_but_unusable(r):
            text = ((r.get("kind") or "attack") == "attack" and invalid_result(r)) or "non-finite result (NaN/inf)"
            key = text.split(" (")[0] if "negative" not in text else "negative RMSE"
            why[key] = why.get(key, 0) + 1
    if not why:
        return ""
    n = sum(why.values())
    done = sum(1 for r in rows if r.get("status") == "done")
    parts = ", ".join(f"{v} {k}" for k, v in sorted(why.items()))
    return (f'<p class="warn"><b>{n} of {done} finished row(s) left out of every score</b>: {esc(parts)}; they '
            'count as failed and are listed under <a href="#problems">Not applicable, failed</a>.</p>')


def _problems_section(rows: Sequence[Mapping[str, Any]]) -> str:
    na: dict[tuple, int] = {}
    for r in rows:
        if r.get("status") == "n/a":
            key = (threat_model(r), r.get("attack") or r.get("kind") or "", r.get("error") or "not applicable")
            na[key] = na.get(key, 0) + 1
    failed = [r for r in rows if r.get("status") not in ("done", "n/a", "pending", "running")
              or _done_but_unusable(r)]
    parts = ["<h3>Not applicable</h3>"]
    parts.append(table(["threat model", "attack", "reason", "trials"],
                       [[esc(t), esc(a), esc(reason), str(n)] for (t, a, reason), n in na.items()], left=3)
                 if na else muted("Every attack applied to every setting."))
    parts.append("<h3>Failed</h3>")
    if failed:
        def why(r):
            if r.get("status") == "done":
                return f"{(r.get('kind') or 'attack') == 'attack' and invalid_result(r) or 'non-finite result (NaN/inf)'}: " \
                    "counted as failed"
            lines = (r.get("error") or "").strip().splitlines()
            return f"{r.get('status')}: {lines[0][:300] if lines else ''}"
        body = [[esc(threat_model(r)), esc(r.get("attack") or r.get("kind") or ""), esc(r.get("defense") or ""),
                 esc(r.get("batch_size") if r.get("batch_size") is not None else ""), esc(r.get("seed", "")),
                 esc(why(r))] for r in failed[:100]]
        parts.append(table(["threat model", "attack", "defense", "B", "seed", "error"], body, left=6))
        if len(failed) > 100:
            parts.append(muted(f"… and {len(failed) - 100} more (see results.csv)."))
        parts.append(muted("Re-run them with <code>leakbench evaluate SPEC --db DB --retry-failed</code>."))
    else:
        parts.append(muted("No trial failed."))
    return "".join(parts)


def _move_text(server: Any) -> str:
    """``{"move": "imprint", "options": {"bins": 64}, "public": 256}`` → ``imprint (bins 64, public 256)``."""
    if not isinstance(server, Mapping):
        return json.dumps(server, sort_keys=True, default=str)
    flat = {**(server.get("options") or {}), **{k: v for k, v in server.items() if k not in ("move", "options")}}
    name = server.get("move")
    if name is None and len(server) == 1:  # the spec's form {imprint: {bins: K}}
        name, flat = next(iter(server.items()))
        flat = flat if isinstance(flat, Mapping) else {"value": flat}
    args = ", ".join(f"{k} {json.dumps(v, default=str) if isinstance(v, (Mapping, list)) else v}"
                     for k, v in sorted(flat.items()))
    return f"{name or 'server'} ({args})" if args else str(name or "server")


def _server_moves(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the server ships in the malicious-server rows (the ``server`` entries of their specs)."""
    moves = []
    for r in rows:
        spec = r.get("spec") or {}
        for holder in (spec, spec.get("options") or {}, spec.get("model_options") or {}, spec.get("threat") or {}):
            if isinstance(holder, Mapping) and holder.get("server"):
                moves.append(_move_text(holder["server"]))
    return list(dict.fromkeys(moves))


def _summary(threats: Sequence[str], rows: Sequence[Mapping[str, Any]], points, weights, members,
             has_bounds: bool, references=()) -> str:
    covered = ", ".join(THREATS.get(t, (t,))[0] for t in threats) or "none"
    missing = [THREATS[t][0] for t in THREAT_MODELS if t not in threats]
    lines = []
    sentences = summaries(points)
    for t in threats:
        title = THREATS.get(t, (t, ""))[0]
        texts = []
        if t == "published-weights":
            texts.append(weights_summary_line(weights))
        elif t == "membership":
            texts += reference_summary(references)
            if members:
                texts.append(membership_summary_line(members))
        else:
            for (threat, dataset, model), (sentence, measured) in sentences.items():
                if threat == t:
                    texts.append(f"{esc(dataset)} · {esc(model)}: {sentence}"
                                 + ("" if measured else " (utility not measured)"))
        body = texts[0] if len(texts) == 1 else "<ul>" + "".join(f"<li>{x}</li>" for x in texts) + "</ul>"
        lines.append(f'<li><b><a href="#threat-{esc(t)}">{esc(title)}</a></b> — {body}</li>')
    parts = [f"<p>This sweep covers these threat models: <b>{esc(covered)}</b>"
             + (f"; not covered: {esc(', '.join(missing))}" if missing else "") + ".</p>",
             '<ul class="verdict">' + "".join(lines) + "</ul>"]
    server = [r for r in rows if threat_model(r) == "malicious-server" and (r.get("kind") or "attack") == "attack"]
    if server:
        attacks = ", ".join(sorted({str(r.get("attack") or r.get("kind")) for r in server}))
        moves = _server_moves(server)
        parts.append(f"<p>{len(server)} trial(s) assume a <b>malicious server</b> (attacks: {esc(attacks)})"
                     + (f"; the server ships: {esc('; '.join(moves))}" if moves else "")
                     + ". Every other row assumes an honest server.</p>")
        checked = [r for r in server if isinstance((r.get("metrics") or {}).get("client_check"), (int, float))]
        if checked:
            per: dict[str, list[int]] = {}
            for r in checked:
                tally = per.setdefault(str(r.get("attack") or r.get("kind")), [0, 0])
                tally[0] += bool(r["metrics"]["client_check"])
                tally[1] += 1
            said = "; ".join(f"{esc(a)}: refused in {k} of {n}" for a, (k, n) in sorted(per.items()))
            parts.append("<p>Would the client have noticed? Its check (<code>leakbench.inspect</code>: the shipped "
                         f"model against the honest one, with the client's batch) before training — {said} "
                         "trial(s).</p>")
        targeted = sorted({str(r.get("attack")) for r in server if (r.get("metrics") or {}).get("targets")})
        if targeted:
            parts.append(f"<p>{esc(', '.join(targeted))} claim only the samples they fish, so their trials are "
                         "scored on those (the claimed slots), beside the flat image on as many of the batch's "
                         "originals as it is nearest to; the whole batch's score stays in "
                         "<code>batch_rmse</code>.</p>")
    else:
        parts.append("<p>No row assumes a malicious server: every attack here reads what an honest server "
                     "would send and receive.</p>")
    if has_bounds:
        parts.append(muted(f"The {CRAMER_RAO} bounds the error of unbiased estimators only; attacks that clamp "
                           "their output to the pixel box are biased and can go below it, so it is not a lower "
                           "bound on what an attack achieves."))
    return "".join(parts)


def _replication(store: Store) -> str:
    """What ``replicate: auto`` did: trials added, rounds, why it stopped and the cells it left undecided."""
    try:
        state = json.loads(store.meta("replicate") or "null")
    except (json.JSONDecodeError, TypeError):
        return muted("The store's replication record is unreadable.")
    if not isinstance(state, Mapping):
        return ""
    left = state.get("open") if isinstance(state.get("open"), Mapping) else {}
    text = (f"Adaptive replication added {esc(state.get('added', 0))} trial(s) in {esc(state.get('rounds', 0))} "
            f"round(s)" + (f"; it stopped because {esc(state['stopped'])}" if state.get("stopped") else
                           "; it had not finished when this report was written"))
    if left:
        text += ". Cells left undecided: " + "; ".join(f"{esc(c)} ({esc(w)})" for c, w in left.items())
    return f"<p>{text}.</p>"


def _open(db: str | Path | Store) -> tuple[Store, bool]:
    if isinstance(db, Store):
        return db, False
    if not Path(db).is_file():
        raise ConfigError(f"expected a results database written by `leakbench evaluate`, got {str(db)!r} "
                          "(no such file)")
    return Store(db), True


def write_report(db: str | Path | Store, out: str | Path) -> ReportFiles:
    """Write ``out/index.html`` (+ plots, grids, CSV/Parquet) for the sweep stored in ``db``."""
    store, close = _open(db)
    try:
        return _write(store, Path(out))
    finally:
        if close:
            store.close()


def _write(store: Store, out: Path) -> ReportFiles:
    out.mkdir(parents=True, exist_ok=True)
    rows = store.rows()
    name = store.meta("sweep") or store.path.stem
    spec_text = store.meta("spec") or ""
    counts = store.counts()
    best = strongest(rows)
    util = utility_table(rows)
    bounds = bounds_table(rows)
    points = privacy_utility(best, util, bounds)
    weights = weights_table(rows)
    members = membership_table(rows)
    references = membership_defenses(rows)

    records = [{"threat_model": threat_model(r), **rec} for r, rec in zip(rows, result_records(rows))]
    columns = ["key", "kind", "threat_model", *(c for c in RESULT_COLUMNS if c not in ("key", "kind", "threat_model")),
               *(c for c in (records[0] if records else {}) if c.startswith("plugin:"))]
    best_records = [{"threat_model": s.threat_model, **rec} for s, rec in zip(best, strongest_records(best))]
    files = ReportFiles(index=out / "index.html", csv=write_csv(records, out / "results.csv", columns),
                        strongest_csv=write_csv(best_records, out / "strongest.csv"))
    files.parquet = write_parquet(records, out / "results.parquet")

    present = {s.threat_model for s in best} | ({"published-weights"} if weights else set()) \
        | ({"membership"} if members or references else set())
    threats = [t for t in THREAT_MODELS if t in present] + sorted(present - set(THREAT_MODELS))
    drawn = Drawn()
    clients = [r for r in rows if not is_public(r)]  # a federated sweep's public client: its power, in rounds
    sections = []
    for t in threats:
        title, text = THREATS.get(t, (t, "a threat model this leakbench version does not describe."))
        body = []
        if any(s.threat_model == t for s in best):
            body.append(attack_section(t, clients, best, points, util, out, drawn, bounds))
        if t == "published-weights" and weights:
            body.append(weights_section(weights, out, drawn))
        if t == "membership" and references:
            body.append(reference_section(references, out, drawn))
        if t == "membership" and members:
            body.append(("<h3>The margin attack on two-layer nets</h3>" if references else "")
                        + membership_section(members, out, drawn))
        sections.append(f'<section class="threat" id="threat-{esc(t)}" data-threat="{esc(t)}">'
                        + collapsible("", title, f"<p><i>The attacker {esc(text)}</i></p>{''.join(body)}")
                        + "</section>")
    rounds = rounds_section(rows, out, drawn)
    federated = federated_section(rows, out, drawn)
    summary = (_summary(threats, rows, points, weights, members, bool(bounds), references)
               if sections or not federated
               else federated_summary(rows))
    files.plots, files.grids, files.threats = drawn.plots, drawn.grids, threats

    status = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no trials"
    downloads = [f'<a href="{esc(p.relative_to(out).as_posix())}">{esc(p.name)}</a>'
                 for p in (files.csv, files.strongest_csv, files.parquet) if p is not None]
    entries = [("summary", "Summary"), *((f"threat-{t}", THREATS.get(t, (t,))[0]) for t in threats),
               *([("rounds", "Leakage along training")] if rounds else []),
               *([("federated", "Federated runs")] if federated else []), ("problems", "Not applicable, failed"),
               ("spec", "Sweep spec")]
    intro = """<p>Following Liu et al. (2024, eq. (3)), a defense is judged by the strongest attack against it
(S<sub>D</sub>: the attack with the lowest mean RMSE on that setting) at the utility it costs. Each threat model
below is a separate question: an attack that needs a malicious server is never the strongest attack against an
eavesdropper.</p>"""
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>leakbench report — {esc(name)}</title>
<style>{CSS}{NAV_CSS}</style></head>
<body data-threats="{esc(' '.join(threats))}">{metric_radios()}
{contents_bar(entries, picker=any(s.threat_model in threats for s in best))}
<main>
<h1>leakbench report — {esc(name)}</h1>
<p class=muted>{esc(store.path.name)} · {esc(status)} · generated {_dt.datetime.now():%Y-%m-%d %H:%M} by leakbench
{esc(__version__)} · <span id="image-check">images not checked (JavaScript off)</span> · {' · '.join(downloads)}</p>
{collapsible("summary", "Summary", intro + _dropped(rows) + summary + _replication(store))}
{''.join(sections) or ("" if federated else muted("No finished trials yet."))}
{rounds}
{federated}
{collapsible("problems", "Attacks that did not apply, failed trials", _problems_section(rows) + _refused_files(rows),
             open=any(r.get("status") in ("failed", "timed out") for r in rows))}
{collapsible("spec", "Sweep spec", muted("The spec this store was run with (YAML).")
             + f'<pre class="spec">{esc(readable_yaml(spec_text))}</pre>', open=False)}
</main>
<script>{PAGE_CHECK}</script>
</body></html>
"""
    files.index.write_text(page, encoding="utf-8")
    return files


def _refused_files(rows: list[dict[str, Any]], limit: int = 20) -> str:
    """The trials whose files the store names outside its folder (not read, not shown), with the reason."""
    refused = [r for r in rows if r.get("images_refused")]
    if not refused:
        return ""
    items = "".join(f"<li>{esc(r.get('key'))}: {esc(r['images_refused'])}</li>" for r in refused[:limit])
    more = f"<li>… and {len(refused) - limit} more</li>" if len(refused) > limit else ""
    return (f"<h3>Files refused</h3><p class=muted>{len(refused)} trial(s) name files outside the store's folder; "
            f"they were not read.</p><ul>{items}{more}</ul>")


__all__ = ["write_report", "ReportFiles", "THREATS", "PAGE_CHECK"]
