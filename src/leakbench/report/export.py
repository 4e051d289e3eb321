"""Export a sweep's results as flat tables: CSV always, Parquet when pandas and pyarrow are installed.

CSV cells are guarded against spreadsheet formula injection (OWASP "CSV injection"): a text cell
that starts with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return and is not a number is
written with a leading ``'``, so a label such as ``=HYPERLINK(...)`` shows as text in a
spreadsheet; numbers (``-0.5`` too) stay numeric.
"""
from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from ..evaluation.trials.plan import defense_family
from ..evaluation.verdicts.strongest import Strongest
from ..metrics.scores import score_columns

#: first characters that make a spreadsheet read a cell as a formula.
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")

#: columns of the results table, in order (utility metrics for utility trials, the bound for bound trials).
#: the utility columns (of utility trials).
UTILITY_COLUMNS = ("train_loss", "train_accuracy", "test_accuracy", "epsilon")

#: the text scores (of text attack trials) and their chance levels (unigram draws)
TEXT_COLUMNS = ("token_acc", "rouge1", "rouge2", "rougeL", "exact", "chance_token_acc", "chance_rouge1",
                "chance_rouge2", "chance_rougeL", "chance_exact")

#: columns of the results table, in order (the scores from :data:`leakbench.metrics.SCORES`, utility metrics for
#: utility trials, the bound for bound trials, the text scores of text trials).
RESULT_COLUMNS = ("key", "kind", "dataset", "model", "attack", "defense", "defense_family", "defense_parameter",
                  "batch_size", "seed", "batch", "status", *score_columns(), *UTILITY_COLUMNS, "lower_bound_rmse",
                  *TEXT_COLUMNS, "seconds", "attempts", "worker", "error", "npz", "png")


#: at most this many plug-in metrics become columns (names from a stored file never size the table unbounded)
MAX_PLUGIN_COLUMNS = 32


def plugin_metric_names(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The plug-in metrics the trials stored (their ``metric_info``), first seen first, at most
    :data:`MAX_PLUGIN_COLUMNS` of names up to 60 characters."""
    names: dict[str, None] = {}
    for r in rows:
        info = (r.get("metrics") or {}).get("metric_info")
        for name in info if isinstance(info, Mapping) else ():
            if isinstance(name, str) and 0 < len(name) <= 60 and len(names) < MAX_PLUGIN_COLUMNS:
                names.setdefault(name)
    return list(names)


def result_records(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One flat dict per trial (columns :data:`RESULT_COLUMNS`, then ``plugin:<name>`` and ``plugin:chance_<name>``
    of each plug-in metric the trials stored) from :meth:`Store.rows` output."""
    rows = list(rows)
    plugins = plugin_metric_names(rows)
    out = []
    for r in rows:
        family, parameter = defense_family(r.get("defense") or "none")
        metrics = r.get("metrics") or {}
        record = {c: r.get(c) for c in RESULT_COLUMNS}
        record.update(defense_family=family, defense_parameter=parameter,
                      error=(r.get("error") or "").splitlines()[0] if r.get("error") else None)
        for name in UTILITY_COLUMNS:
            record[name] = metrics.get(name) if r.get("kind") == "utility" else None
        record["lower_bound_rmse"] = metrics.get("exact_rmse") if r.get("kind") == "bound" else None
        text = r.get("kind") == "attack" and metrics.get("modality") == "text"
        for name in TEXT_COLUMNS:
            record[name] = metrics.get(name) if text else None
        for name in plugins:  # a plug-in's column name starts with "plugin:", never a formula in a spreadsheet
            for key in (name, f"chance_{name}"):
                value = metrics.get(key) if r.get("kind") == "attack" else None
                record[f"plugin:{key}"] = value if isinstance(value, (int, float)) else None
        out.append(record)
    return out


def strongest_records(best: Sequence[Strongest]) -> list[dict[str, Any]]:
    """One flat dict per S_D setting."""
    return [{"dataset": s.dataset, "model": s.model, "defense": s.defense, "defense_family": s.family,
             "defense_parameter": s.parameter, "batch_size": s.batch_size, "strongest_attack": s.attack,
             "rmse": s.rmse, "psnr": s.psnr, "ssim": s.ssim,
             "sd_capped": s.sd.mean if s.sd.n else None, "sd_ci_low": s.sd.low if s.sd.known else None,
             "sd_ci_high": s.sd.high if s.sd.known else None, "n_batches": s.sd.n,
             "per_image_strongest": s.per_image.mean if s.per_image.n else None, "chance_rmse": s.chance_rmse,
             "stops_every_attack": s.stops, "incomplete_attack_set": bool(s.incomplete),
             "attacks_run": sum(1 for a in s.scores if a.trials),
             "attacks_not_applicable": sum(1 for a in s.scores if a.not_applicable)} for s in best]


def safe_cell(value: Any) -> Any:
    """``value``, with a leading ``'`` when it is text a spreadsheet would run as a formula (numbers unchanged)."""
    if not isinstance(value, str) or not value.startswith(FORMULA_PREFIXES):
        return value
    try:
        if math.isfinite(float(value)):
            return value  # "-0.5", "+1e-3": a number, not a formula
    except ValueError:
        pass
    return "'" + value


def write_csv(records: Sequence[Mapping[str, Any]], path: str | Path,
              columns: Sequence[str] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(columns or (records[0].keys() if records else RESULT_COLUMNS))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: safe_cell(v) for k, v in r.items()} for r in records)
    return path


def parquet_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("pandas", "pyarrow"))


def write_parquet(records: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Write a Parquet file; ``None`` (nothing written) when pandas or pyarrow is missing."""
    if not parquet_available():
        return None
    import pandas as pd

    path = Path(path)
    pd.DataFrame.from_records(list(records)).to_parquet(path, index=False)
    return path


__all__ = ["RESULT_COLUMNS", "plugin_metric_names", "FORMULA_PREFIXES", "safe_cell", "result_records", "strongest_records", "write_csv", "write_parquet",
           "parquet_available"]
