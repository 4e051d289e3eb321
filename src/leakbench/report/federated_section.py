"""The report's section on audited federated runs (rows written by ``leakbench.integrations.flower``).

Per run: what the audit could see (simulation: scored against each client's real batch beside the
chance control, a flat image at the partitions' mean pixel; deployment: no client data, so the
reconstructions are unscored and the attack's own confidence and final matching loss are shown), the
defense the clients applied, a table of leakage per round next to the global model's accuracy, a
table per round and client, a plot of both against the round, and the most leaking reconstruction.
Rows are kind ``federated`` (one attack on one client's update) and ``federated-round`` (the global
model's metrics), tagged in their spec with ``run``, ``round`` and ``client``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..evaluation.verdicts.rows import finite
from .attack_section import Drawn
from .grid import save_grid
from .markup import MISSING, esc, figure, muted, num, slug, table
from .plots import _save, plain

MODE_TEXT = {
    "simulation": "simulation — the auditor held the client partitions, so every reconstruction is scored "
                  "against the client's real batch (RMSE after Hungarian matching); chance is a flat image at the "
                  "mean pixel of the data given to the auditor",
    "deployment": "deployment — the server has no client data: reconstructions are stored unscored, with the "
                  "attack's own confidence and final matching loss; leakage scores come only from clients that "
                  "audit themselves (audit_mod)",
}


def db(value: Any) -> str:
    """A PSNR in dB: "∞" for an exact match, "–" when missing."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == math.inf:
        return "∞"
    return num(value, 1)


def _spec(r: Mapping[str, Any]) -> Mapping[str, Any]:
    return r.get("spec") or {}


def _done(r: Mapping[str, Any]) -> bool:
    return r.get("status") == "done"


def _client_key(client: Any) -> tuple:
    text = str(client)
    return (0, int(text), text) if text.lstrip("-").isdigit() else (1, 0, text)


def _round_metrics(rounds: Sequence[Mapping[str, Any]], source: str) -> dict[int, Mapping[str, Any]]:
    return {int(_spec(r).get("round", 0)): r.get("metrics") or {} for r in rounds
            if _spec(r).get("source") == source and _done(r)}


def _best(rows: Sequence[Mapping[str, Any]], name: str, *, high: bool) -> float | None:
    values = [float(r["metrics"][name]) for r in rows if _done(r) and isinstance((r.get("metrics") or {}).get(name),
                                                                               (int, float))
              and not isinstance(r["metrics"][name], bool) and not math.isnan(r["metrics"][name])]
    if not values:
        return None
    return max(values) if high else min(values)


def _reported(rows: Sequence[Mapping[str, Any]], name: str, *, high: bool = True) -> float | None:
    values = [v for r in rows for v in [((r.get("metrics") or {}).get("reported") or {}).get(name)]
              if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)]
    if not values:
        return None
    return max(values) if high else min(values)


def _per_round(updates, rounds, scored: bool) -> str:
    server, clients = _round_metrics(rounds, "server"), _round_metrics(rounds, "clients")
    numbers = sorted({int(_spec(r).get("round", 0)) for r in updates} | set(server) | set(clients))
    body = []
    for n in numbers:
        mine = [r for r in updates if int(_spec(r).get("round", 0)) == n]
        audited = len({_spec(r).get("client") for r in mine})
        acc = server.get(n, {}).get("accuracy", clients.get(n, {}).get("accuracy"))
        loss = server.get(n, {}).get("loss", clients.get(n, {}).get("loss"))
        row = [str(n), num(acc), num(loss), str(audited) if mine else MISSING]
        if scored:
            per_client = {}
            for r in mine:
                if _done(r) and finite((r.get("metrics") or {}).get("rmse")):
                    c = _spec(r).get("client")
                    per_client[c] = min(per_client.get(c, math.inf), float(r["metrics"]["rmse"]))
            chance = [float(r["metrics"]["chance_rmse"]) for r in mine
                      if _done(r) and finite((r.get("metrics") or {}).get("chance_rmse"))]
            row += [db(_best(mine, "psnr", high=True)), num(_best(mine, "rmse", high=False), 4),
                    num(sum(per_client.values()) / len(per_client), 4) if per_client else MISSING,
                    num(sum(chance) / len(chance), 4) if chance else MISSING]
        else:
            row += [num(_best(mine, "confidence_mean", high=True)), num(_best(mine, "final_loss", high=False), 4)]
        row += [db(_reported(mine, "leakbench-psnr")), num(_reported(mine, "leakbench-epsilon"), 2)]
        body.append(row)
    head = ["round", "accuracy", "loss", "clients audited"]
    head += (["best PSNR (dB)", "best RMSE", "mean over clients of the best RMSE", "chance RMSE"] if scored
             else ["highest attack confidence", "lowest final matching loss"])
    head += ["clients' self-audit: best PSNR (dB)", "ε (DP-SGD)"]
    return table(head, body, left=1)


def _per_client(updates, scored: bool) -> str:
    body = []
    for r in sorted(updates, key=lambda r: (int(_spec(r).get("round", 0)), _client_key(_spec(r).get("client")),
                                            str(r.get("attack")))):
        m, s = r.get("metrics") or {}, _spec(r)
        training = s.get("training") or {}
        steps = (f"{training.get('epochs')} ep × B{training.get('minibatch')}" if training.get("epochs")
                 else f"{training.get('steps', 1)} step(s)")
        row = [esc(s.get("round")), esc(s.get("client")), esc(r.get("defense") or "none"),
               esc(s.get("attack_key") or r.get("attack")), esc(r.get("batch_size")), esc(steps),
               esc(r.get("status"))]
        if scored:
            row += [num(m.get("rmse"), 4), db(m.get("psnr")), num(m.get("ssim")), num(m.get("label_acc"), 2),
                    num(m.get("chance_rmse"), 4)]
        else:
            row += [num(m.get("confidence_mean")), num(m.get("final_loss"), 4)]
        row += [num((r.get("timings") or {}).get("attack"), 1), esc((r.get("error") or "")[:160])]
        body.append(row)
    head = ["round", "client", "defense", "attack", "B", "local training", "status"]
    head += ["RMSE", "PSNR (dB)", "SSIM", "label acc", "chance RMSE"] if scored else ["confidence", "final loss"]
    head += ["seconds", "note"]
    return table(head, body, left=7)


def _plot(run: str, updates, rounds, scored: bool, out: Path, drawn: Drawn) -> str:
    server = _round_metrics(rounds, "server") or _round_metrics(rounds, "clients")
    clients = sorted({_spec(r).get("client") for r in updates}, key=_client_key)
    name = "psnr" if scored else "confidence_mean"
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    drew = False
    for c in clients:
        points = sorted((int(_spec(r).get("round", 0)), v) for r in updates if _spec(r).get("client") == c
                        for v in [_best([r], name, high=True)] if v is not None and math.isfinite(v))
        best: dict[int, float] = {}
        for n, v in points:
            best[n] = max(best.get(n, -math.inf), v)
        if best:
            ax.plot(list(best), list(best.values()), marker="o", label=plain(f"client {c}"))
            drew = True
    if not drew:
        return ""
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("best PSNR (dB)" if scored else "attack confidence")
    if server and any(finite(m.get("accuracy")) for m in server.values()):
        twin = ax.twinx()
        acc = sorted((n, float(m["accuracy"])) for n, m in server.items() if finite(m.get("accuracy")))
        twin.plot([n for n, _ in acc], [a for _, a in acc], color="black", linestyle="--", label="accuracy")
        twin.set_ylabel("global accuracy (dashed)")
        twin.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(plain(f"run {run}: leakage per client and round"), fontsize=10)
    fig.tight_layout()
    path = _save(fig, out / f"federated-{slug(run)}.png")
    drawn.plots.append(path)
    return figure(path, out, f"Run {run}: best reconstruction {'PSNR' if scored else 'confidence'} per client and "
                             "round (markers) and the global model's accuracy (dashed).")


def _grid(run: str, updates, out: Path, drawn: Drawn) -> str:
    scored = [r for r in updates if _done(r) and finite((r.get("metrics") or {}).get("psnr")) and r.get("npz")]
    if not scored:
        return ""
    top = max(scored, key=lambda r: float(r["metrics"]["psnr"]))
    try:
        with np.load(top["npz"]) as data:
            x, rec = data["x"], data["reconstruction"]
            order = data["order"] if "order" in data.files else None
    except (OSError, KeyError, ValueError):
        return muted(f"The images of the most leaking update of run {esc(run)} are missing ({esc(top['npz'])}).")
    scores = {"order": order.tolist(), "per_sample": top.get("per_sample") or {}} if order is not None else None
    s = _spec(top)
    path = save_grid(out / f"federated-grid-{slug(run)}.png", x, rec, scores=scores)
    drawn.grids.append(path)
    return figure(path, out, f"Run {run}: the most leaking update — round {s.get('round')}, client {s.get('client')}, "
                             f"{s.get('attack_key') or top.get('attack')} (originals above, reconstructions below).")


def federated_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """The summary of a store holding federated runs only (no sweep)."""
    runs = list(dict.fromkeys(str(_spec(r).get("run", "")) for r in rows if str(r.get("kind", "")).startswith(
        "federated")))
    return (f'<p>This store holds no sweep: it holds {len(runs)} audited federated run(s) ({esc(", ".join(runs))}), '
            'reported in <a href="#federated">Federated runs</a> below.</p>')


def federated_section(rows: Sequence[Mapping[str, Any]], out: Path, drawn: Drawn) -> str:
    """HTML of the federated runs in ``rows`` ("" when there are none)."""
    updates = [r for r in rows if r.get("kind") == "federated"]
    rounds = [r for r in rows if r.get("kind") == "federated-round"]
    if not updates and not rounds:
        return ""
    runs = list(dict.fromkeys(str(_spec(r).get("run", "")) for r in updates + rounds))
    parts = ['<section class="federated" id="federated"><h2>Federated runs (Flower audit)</h2>',
             "<p>Each client's update of an audited round was attacked as the server receives it (an honest-but-"
             "curious server: the eavesdropper's threat model); defenses are the ones the clients applied, "
             "recorded and never applied again.</p>"]
    for run in runs:
        mine = [r for r in updates if str(_spec(r).get("run", "")) == run]
        mine_rounds = [r for r in rounds if str(_spec(r).get("run", "")) == run]
        modes = sorted({str(_spec(r).get("mode")) for r in mine}) or ["simulation"]
        scored = "simulation" in modes
        defenses = sorted({str(r.get("defense") or "none") for r in mine}) or ["none"]
        attacks = sorted({str(_spec(r).get("attack_key") or r.get("attack")) for r in mine})
        parts.append(f'<h3 id="federated-{esc(slug(run))}">Run {esc(run)}</h3>')
        parts.append(f"<p>Mode: {'; '.join(esc(MODE_TEXT.get(m, m)) for m in modes)}. Client defense: "
                     f"<b>{esc(', '.join(defenses))}</b>. Attacks: {esc(', '.join(attacks) or 'none')}.</p>")
        parts.append("<h4>Per round</h4>" + _per_round(mine, mine_rounds, scored))
        parts.append(_plot(run, mine, mine_rounds, scored, out, drawn))
        if mine:
            parts.append("<h4>Per round and client</h4>" + _per_client(mine, scored))
        if scored:
            parts.append(_grid(run, mine, out, drawn))
    parts.append("</section>")
    return "".join(parts)


__all__ = ["federated_section", "federated_summary", "MODE_TEXT"]
