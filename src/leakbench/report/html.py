"""The static HTML report of a sweep: ``write_report("results.db", "report/")`` → ``report/index.html``.

Sections: the strongest attack S_D per defense setting (Liu et al. 2024, eq. (3)),
the RMSE of every attack per setting with the strongest one in bold (Table 4),
utility per defense (Table 5), the privacy–utility plot (Figure 3), image grids
(original vs each attack's reconstruction, per defense and batch size), attacks
that did not apply and failed trials.  Plots and grids are PNG files beside
``index.html`` referenced by relative paths, so the report opens from disk in a
browser with no server.  ``results.csv`` and ``strongest.csv`` (and Parquet
when pandas + pyarrow are installed) hold the tables.
"""
from __future__ import annotations

import datetime as _dt
import html
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from .. import __version__
from ..errors import ConfigError
from ..evaluation.store import Store
from ..evaluation.strongest import (Strongest, attack_scores, bounds_table, privacy_utility, strongest,
                                    utility_table)
from .export import result_records, strongest_records, write_csv, write_parquet
from .plots import comparison_grid, privacy_utility_plot, strongest_plot

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1200px;
     padding:0 1rem;color:#222}
h1{font-size:1.6rem} h2{font-size:1.25rem;margin-top:2.2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6rem 0;font-size:.85rem}
th,td{border:1px solid #ddd;padding:.25rem .5rem;text-align:right} th{background:#f5f5f5}
td.l,th.l{text-align:left} td.best{font-weight:700;background:#e8f4e8} td.na{color:#999}
img{max-width:100%;border:1px solid #eee} .grids figure{display:inline-block;margin:.4rem;vertical-align:top}
figcaption{font-size:.8rem;color:#555} .muted{color:#777;font-size:.85rem} code{background:#f5f5f5}
"""

#: runs after load: counts images that decoded (``naturalWidth > 0``) and writes the result into the page
#: (``body[data-images-ok]`` / ``data-images-total``) — ``scripts/check_report.py`` reads it headless.
IMAGE_CHECK = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images-ok', ok);
  document.body.setAttribute('data-images-total', imgs.length);
  var el = document.getElementById('image-check');
  if (el) { el.textContent = ok + ' of ' + imgs.length + ' images loaded'; }
});
"""


@dataclass
class ReportFiles:
    """What :func:`write_report` wrote."""

    index: Path
    csv: Path
    strongest_csv: Path
    parquet: Optional[Path] = None
    plots: list[Path] = field(default_factory=list)
    grids: list[Path] = field(default_factory=list)


def _e(value: Any) -> str:
    return html.escape(str(value))


def _num(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{0.0 if abs(value) < 0.5 * 10 ** -digits else value:.{digits}f}"  # no "-0.000"
    return _e(value)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], *, left: int = 1) -> str:
    """Rows are already-escaped HTML cells (a cell may be a ``(html, css_class)`` pair)."""
    head = "".join(f'<th class="l">{_e(h)}</th>' if i < left else f"<th>{_e(h)}</th>" for i, h in enumerate(header))
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            text, cls = cell if isinstance(cell, tuple) else (cell, "")
            cls = " ".join(c for c in (cls, "l" if i < left else "") if c)
            cells.append(f'<td class="{cls}">{text}</td>' if cls else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _slug(*parts: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", "_".join(str(p) for p in parts)).strip("-")[:120]


def _strongest_section(best: Sequence[Strongest], points) -> str:
    loss = {(p.dataset, p.model, p.defense, p.batch_size): p for p in points}
    rows = []
    for s in best:
        p = loss.get((s.dataset, s.model, s.defense, s.batch_size))
        rows.append([_e(s.dataset), _e(s.model), _e(s.defense), _e(s.batch_size),
                     _e(s.attack or "none ran"), _num(s.rmse), _num(s.psnr, 2), _num(s.ssim),
                     _num(p.train_loss_increase if p else None), _num(p.accuracy_drop if p else None),
                     _num(p.bound if p else None)])
    return _table(["dataset", "model", "defense", "B", "strongest attack", "RMSE", "PSNR (dB)", "SSIM",
                   "train-loss increase", "accuracy drop", "RMSE lower bound"], rows, left=5)


def _matrix_section(rows: Sequence[Mapping[str, Any]]) -> str:
    """Table 4: RMSE of every attack (rows, per batch size) under every defense setting (columns)."""
    scores = attack_scores(rows)
    out = []
    for dataset, model in dict.fromkeys((k[0], k[1]) for k in scores):
        defenses = list(dict.fromkeys(k[2] for k in scores if k[:2] == (dataset, model)))
        sizes = sorted({k[3] for k in scores if k[:2] == (dataset, model)})
        body = []
        for b in sizes:
            attacks = list(dict.fromkeys(a.attack for k, v in scores.items() if k[:2] == (dataset, model)
                                         and k[3] == b for a in v))
            for name in sorted(attacks):
                row = [_e(b), _e(name)]
                for d in defenses:
                    lst = scores.get((dataset, model, d, b), [])
                    a = next((x for x in lst if x.attack == name), None)
                    usable = [x for x in lst if x.trials and not math.isnan(x.rmse)]
                    if a is None:
                        row.append(("", "na"))
                    elif a.not_applicable:
                        row.append((f'<span title="{_e(a.not_applicable)}">n/a</span>', "na"))
                    elif not a.trials:
                        row.append((f'<span title="{a.failed} failed">failed</span>', "na"))
                    else:
                        best = usable and usable[0].attack == name
                        row.append((_num(a.rmse), "best" if best else ""))
                body.append(row)
        out.append(f"<h3>{_e(dataset)} · {_e(model)}</h3>" + _table(["B", "attack", *defenses], body, left=2))
    return "".join(out) or "<p class=muted>No attack trials finished yet.</p>"


def _utility_section(util: Mapping[tuple, Mapping[str, Any]]) -> str:
    if not util:
        return ("<p class=muted>No utility trials in this store (add a <code>utility:</code> section to the spec "
                "to measure each defense's cost).</p>")
    rows = []
    for (dataset, model, defense), m in util.items():
        base = util.get((dataset, model, "none"), {})
        inc = None if m.get("train_loss") is None or base.get("train_loss") is None else \
            m["train_loss"] - base["train_loss"]
        drop = None if m.get("test_accuracy") is None or base.get("test_accuracy") is None else \
            base["test_accuracy"] - m["test_accuracy"]
        rows.append([_e(dataset), _e(model), _e(defense), _num(m.get("train_loss")), _num(m.get("train_accuracy")),
                     _num(m.get("test_accuracy")), _num(m.get("epsilon"), 2), _num(inc), _num(drop)])
    return _table(["dataset", "model", "defense", "final train loss", "train acc.", "test acc.", "ε",
                   "train-loss increase", "accuracy drop"], rows, left=3)


def _grids(rows: Sequence[Mapping[str, Any]], out: Path) -> list[tuple[Path, str]]:
    """One comparison grid per (dataset, model, defense, B): the first seed and batch that has images."""
    by_setting: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("kind") == "attack":
            by_setting.setdefault((r["dataset"], r["model"], r["defense"], r["batch_size"]), []).append(r)
    made = []
    for (dataset, model, defense, b), trials in by_setting.items():
        with_images = [t for t in trials if t.get("npz") and Path(t["npz"]).is_file()]
        if not with_images:
            continue
        first = min(with_images, key=lambda t: (t["seed"], t["batch"]))
        same = [t for t in trials if (t["seed"], t["batch"]) == (first["seed"], first["batch"])]
        originals = np.load(first["npz"])["x"]
        recs: dict[str, Optional[np.ndarray]] = {}
        for t in sorted(same, key=lambda t: t["attack"] or ""):
            if t["status"] == "done" and t.get("npz") and Path(t["npz"]).is_file():
                arrays = np.load(t["npz"])
                recs[f"{t['attack']}\nRMSE {_num(t.get('rmse'))}"] = arrays["reconstruction"][arrays["order"]]
            else:
                recs[f"{t['attack']}\n({t['status']})"] = None
        title = f"{dataset} · {model} · {defense} · B={b} · seed {first['seed']}, batch {first['batch']}"
        path = comparison_grid(originals, recs, out / "grids" / f"{_slug(dataset, model, defense, b)}.png",
                               title=title)
        made.append((path, title))
    return made


def _problems_section(rows: Sequence[Mapping[str, Any]]) -> str:
    na: dict[tuple, int] = {}
    for r in rows:
        if r["status"] == "n/a":
            key = (r.get("attack") or r["kind"], r.get("error") or "")
            na[key] = na.get(key, 0) + 1
    failed = [r for r in rows if r["status"] == "failed"]
    parts = ["<h3>Not applicable</h3>"]
    parts.append(_table(["attack", "reason", "trials"], [[_e(a), _e(reason), _e(n)] for (a, reason), n in na.items()],
                        left=2) if na else "<p class=muted>Every attack applied to every setting.</p>")
    parts.append("<h3>Failed</h3>")
    if failed:
        rows_html = [[_e(r.get("attack") or r["kind"]), _e(r["defense"]), _e(r.get("batch_size") or ""),
                      _e(r["seed"]), _e((r.get("error") or "").splitlines()[0][:300])] for r in failed[:100]]
        parts.append(_table(["attack", "defense", "B", "seed", "error"], rows_html, left=5))
        if len(failed) > 100:
            parts.append(f"<p class=muted>… and {len(failed) - 100} more (see results.csv).</p>")
        parts.append("<p class=muted>Re-run them with <code>leakbench evaluate SPEC --db DB --retry-failed</code>."
                     "</p>")
    else:
        parts.append("<p class=muted>No trial failed.</p>")
    return "".join(parts)


def write_report(db: "str | Path | Store", out: "str | Path") -> ReportFiles:
    """Write ``out/index.html`` (+ plots, grids, CSV/Parquet) for the sweep stored in ``db``."""
    if not isinstance(db, Store):
        if not Path(db).is_file():
            raise ConfigError(f"expected a results database written by `leakbench evaluate`, got {str(db)!r} "
                              "(no such file)")
        store = Store(db)
    else:
        store = db
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = store.rows()
    name = store.meta("sweep") or store.path.stem
    spec_text = store.meta("spec") or ""
    counts = store.counts()
    best = strongest(rows)
    util = utility_table(rows)
    points = privacy_utility(best, util, bounds_table(rows))

    files = ReportFiles(index=out / "index.html", csv=write_csv(result_records(rows), out / "results.csv"),
                        strongest_csv=write_csv(strongest_records(best), out / "strongest.csv"))
    files.parquet = write_parquet(result_records(rows), out / "results.parquet")
    pu = privacy_utility_plot(points, out / "plots" / "privacy-utility.png")
    sd = strongest_plot(best, out / "plots" / "strongest.png")
    files.plots = [p for p in (pu, sd) if p is not None]
    grids = _grids(rows, out)
    files.grids = [p for p, _ in grids]

    def rel(p: Path) -> str:
        return _e(p.relative_to(out).as_posix())

    status = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no trials"
    downloads = [f'<a href="{rel(files.csv)}">results.csv</a>', f'<a href="{rel(files.strongest_csv)}">strongest.csv</a>']
    if files.parquet is not None:
        downloads.append(f'<a href="{rel(files.parquet)}">results.parquet</a>')
    pu_html = (f'<img src="{rel(pu)}" alt="privacy-utility plot">' if pu is not None else
               "<p class=muted>No utility measured, so no privacy–utility plot: add a <code>utility:</code> section "
               "to the spec.</p>")
    sd_html = f'<img src="{rel(sd)}" alt="S_D per defense">' if sd is not None else ""
    grid_html = "".join(f'<figure><img src="{rel(p)}" alt="{_e(t)}"><figcaption>{_e(t)}</figcaption></figure>'
                        for p, t in grids) or "<p class=muted>No reconstructions saved.</p>"
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>leakbench report — {_e(name)}</title>
<style>{CSS}</style></head>
<body>
<h1>leakbench report — {_e(name)}</h1>
<p class=muted>{_e(store.path.name)} · {_e(status)} · generated {_dt.datetime.now():%Y-%m-%d %H:%M} by leakbench
{_e(__version__)} · <span id="image-check">images not checked (JavaScript off)</span> · {' · '.join(downloads)}</p>

<h2>Strongest attack per defense setting (S<sub>D</sub>)</h2>
<p>Following Liu et al. (2024, eq. (3)), a defense is judged by the strongest attack against it: for every
defense setting and batch size the attack with the lowest RMSE (then the highest PSNR, SSIM) over the attacked
images. A higher best-attack RMSE means a stronger defense; compare defenses at equal utility loss.</p>
{_strongest_section(best, points)}
{sd_html}

<h2>Privacy–utility</h2>
<p>Best-attack RMSE against utility loss, one point per defense setting and batch size (Figure 3 of Liu et al.).</p>
{pu_html}

<h2>Utility per defense</h2>
{_utility_section(util)}

<h2>RMSE of every attack (strongest in bold)</h2>
{_matrix_section(rows)}

<h2>Reconstructions</h2>
<p class=muted>Top row: the originals; below: each attack's reconstruction, matched to the originals
(Hungarian on MSE).</p>
<div class="grids">{grid_html}</div>

<h2>Attacks that did not apply, failed trials</h2>
{_problems_section(rows)}

<h2>Sweep spec</h2>
<pre>{_e(spec_text)}</pre>
<script>{IMAGE_CHECK}</script>
</body></html>
"""
    files.index.write_text(page)
    if not isinstance(db, Store):
        store.close()
    return files


__all__ = ["write_report", "ReportFiles"]
