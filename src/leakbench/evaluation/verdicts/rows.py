"""Reading the store's rows for the verdicts: a row's threat model, batch size, score, usability and
its per-image scores and chance level.  Pure functions of rows as :meth:`~..store.Store.rows` returns them."""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

#: the threat model of a row that names none, per kind.
_DEFAULT_THREAT = {"weights": "published-weights", "membership": "membership"}


def finite(value: Any) -> bool:
    """True for a real, finite number (not None, NaN, inf, a bool or a string)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def threat_model(row: Mapping[str, Any]) -> str:
    """The threat model a row assumes (``eavesdropper`` when it names none)."""
    spec = row.get("spec") or {}
    return (row.get("threat_model") or spec.get("threat_model")
            or _DEFAULT_THREAT.get(row.get("kind") or "attack", "eavesdropper"))


def batch_size(row: Mapping[str, Any]) -> int:
    """The row's batch size; 0 when absent (an old utility row applies to every batch size)."""
    value = row.get("batch_size")
    if value is None:
        value = (row.get("spec") or {}).get("batch_size")
    return int(value) if finite(value) else 0


#: the verdict's metric of a text trial: 1 − token accuracy (lower = more leakage, as RMSE) and its chance level
TEXT_METRIC = "token_error"


def is_text_row(row: Mapping[str, Any]) -> bool:
    """A text trial's row (its metrics say ``modality: text``)."""
    return (row.get("metrics") or {}).get("modality") == "text"


def scored(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """The row as the verdict logic reads it: an image row as it is; a text row with ``rmse`` the token error
    1 − token accuracy, ``chance_rmse`` the unigram draws' token error and per-sequence errors in
    ``per_sample["rmse"]``, so S_D, its intervals, ties, the chance test and the per-sample strongest attack are
    the image side's own, on token accuracy (higher accuracy = lower error = more leakage)."""
    if not is_text_row(row):
        return row
    m = row.get("metrics") or {}
    per = row.get("per_sample") or {}
    error = m.get(TEXT_METRIC)
    return {**row, "rmse": float(error) if finite(error) else None, "psnr": None, "ssim": None,
            "metrics": {**m, "chance_rmse": m.get("chance_token_error")},
            "per_sample": {"rmse": list(per.get(TEXT_METRIC) or []),
                           "chance_rmse": list(per.get("chance_token_error") or [])}}


def invalid_result(row: Mapping[str, Any]) -> str | None:
    """Why a ``done`` attack row's result is no measurement (None when it is one): its RMSE is missing, NaN/inf,
    or negative (RMSE = √MSE is never below 0, so a negative one is a corrupt row, not a perfect attack)."""
    rmse = row.get("rmse")
    if not finite(rmse):
        return "non-finite result (NaN/inf)"
    if rmse < 0:
        return f"invalid result (negative RMSE {rmse:.3g}; an RMSE is never below 0)"
    return None


def usable(row: Mapping[str, Any]) -> bool:
    """A finished attack trial with a valid RMSE (finite and ≥ 0: :func:`invalid_result`)."""
    return row.get("status") == "done" and invalid_result(row) is None


def npz_path(row: Mapping[str, Any]) -> str | None:
    """The row's saved arrays (``npz`` column, or ``images["npz"]``), None when it has none."""
    images = row.get("images")
    path = row.get("npz") or (images.get("npz") if isinstance(images, Mapping) else None)
    return str(path) if path else None


def unit(row: Mapping[str, Any]) -> tuple[int, int]:
    """The replication unit of an attack row: (seed, batch) — the same images for every defense and attack."""
    spec = row.get("spec") or {}
    seed = row.get("seed", spec.get("seed", 0))
    batch = row.get("batch", spec.get("batch", 0))
    return (int(seed) if finite(seed) else 0, int(batch) if finite(batch) else 0)


def _reason(row: Mapping[str, Any]) -> str:
    status = row.get("status") or "unknown"
    if status == "done":
        return invalid_result(row) or "non-finite result (NaN/inf)"
    error = (row.get("error") or "").strip().splitlines()
    return f"{status}: {error[0]}" if error else str(status)


def _mean(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if finite(v)]
    return sum(vals) / len(vals) if vals else None


def _chance(row: Mapping[str, Any]) -> float | None:
    value = (row.get("metrics") or {}).get("chance_rmse")
    return float(value) if finite(value) else None


def _per_image(row: Mapping[str, Any]) -> dict[tuple, tuple[float, float | None]]:
    """(seed, batch, i) → (RMSE of original i, its own chance RMSE) of a usable row (the batch's chance when the
    row predates per-image chance)."""
    per = row.get("per_sample") or {}
    rmse = per.get("rmse") or []
    chance = per.get("chance_rmse") or []
    batch_chance = _chance(row)
    s, b = unit(row)
    out = {}
    for i, v in enumerate(rmse):
        if finite(v):
            c = chance[i] if i < len(chance) and finite(chance[i]) else batch_chance
            out[(s, b, i)] = (float(v), c)
    return out


__all__ = ["finite", "threat_model", "batch_size", "usable", "npz_path", "scored", "is_text_row", "TEXT_METRIC"]
