"""Audited updates and round metrics of a federated run in a leakbench results store (flwr-free).

The rows use the store of the sweeps (:class:`leakbench.evaluation.store.Store`) through its API:

- kind ``federated``: one attack on one client's update in one round; the spec carries the tags
  ``run``, ``round``, ``client`` and ``mode`` (``simulation``: scored against the client's real batch;
  ``deployment``: unscored, with the attack's own confidence), the client's training and defense; the
  result holds what the client reported about itself (``reported``); the update is saved beside the
  store (``update`` npz file);
- kind ``federated-round``: the global model's metrics (accuracy, loss) of one round, by ``source``
  (``server``: centralised evaluation; ``clients``: the aggregate of the clients' evaluation).

:mod:`leakbench.report.federated_section` reads them back.  The tags are fields of the spec, so they
enter the trial key: one row per (run, round, client, attack), replaced when the same run is audited again.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import numpy as np
import torch

from ...evaluation.store import Store
from ...evaluation.trials.trial import TrialResult, TrialSpec, worker_id
from .audit import Audited, AttackChoice
from .keys import LocalTraining

MODES = ("simulation", "deployment")


@dataclass(frozen=True)
class FederatedSpec(TrialSpec):
    """A :class:`TrialSpec` tagged with the federated run, round, client and audit mode."""

    run: str = ""
    round: int = 0
    client: str = ""
    mode: str = ""
    source: str = ""


def _plain(value: Any) -> Any:
    """A JSON-safe copy of a metrics value (non-finite floats kept as floats; the store writes them)."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class AuditLog:
    """Writes one federated run into a store: ``AuditLog("audit.db", run="fedavg")``."""

    def __init__(self, db: str | Path | Store, *, run: str, model: str = "model", dataset: str = "federated",
                 description: Mapping[str, Any] | None = None) -> None:
        self.store = db if isinstance(db, Store) else Store(db)
        self.run, self.model, self.dataset = str(run), str(model), str(dataset)
        info = {"run": self.run, "model": self.model, "dataset": self.dataset, "started": time.time(),
                **dict(description or {})}
        self.store.set_meta(f"federated-run:{self.run}", json.dumps(info, default=str))

    def close(self) -> None:
        self.store.close()

    def _spec(self, **fields: Any) -> FederatedSpec:
        return FederatedSpec(dataset=self.dataset, model=self.model, dataset_key=self.dataset, model_key=self.model,
                             run=self.run, **fields)

    def record_update(self, *, round: int, client: str, mode: str, choice: AttackChoice, outcome: Audited,
                      training: LocalTraining, defense: str = "none", seed: int = 0,
                      reported: Mapping[str, Any] | None = None, node: int | None = None,
                      update_file: Path | None = None) -> str:
        """Store one attack on one update; returns the trial key."""
        if mode not in MODES:
            raise ValueError(f"expected mode in {MODES}, got {mode!r}")
        spec = self._spec(kind="federated", attack=choice.name, attack_key=choice.key, preset=choice.preset,
                          options=dict(choice.options), defense=defense or "none",
                          threat={"labels_known": True} if choice.labels_known else {},
                          batch_size=training.batch_size, seed=seed, round=int(round), client=str(client), mode=mode,
                          training=training.describe())
        self.store.add([spec])
        metrics = {k: _plain(v) for k, v in outcome.metrics.items()}
        # what the client said about itself (audit_mod's scores, ε) and its node id: results, not identity
        metrics.update(scored=outcome.scored, node=node,
                       reported={k: _plain(v) for k, v in (reported or {}).items()})
        result = TrialResult(key=spec.key, status=outcome.status, metrics=metrics, per_sample=outcome.per_sample,
                             timings={"attack": outcome.seconds, "total": outcome.seconds}, error=outcome.error,
                             traceback=outcome.traceback, worker=worker_id())
        files: dict[str, Path] = {}
        if outcome.arrays:
            path = self.store.images_dir / f"{spec.key}.npz"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(path, **outcome.arrays)
            files["npz"] = path
        if update_file is not None:
            files["update"] = update_file
        self.store.commit(result, files)
        return spec.key

    def save_update(self, *, round: int, client: str, delta: Mapping[str, torch.Tensor]) -> Path:
        """The client's update θ_after − θ_before as an npz file beside the store (one array per parameter)."""
        path = self.store.images_dir / "updates" / f"{self.run}-r{int(round)}-c{client}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **{name: t.detach().cpu().numpy() for name, t in delta.items()})
        return path

    def record_round(self, *, round: int, metrics: Mapping[str, Any], source: str) -> str:
        """Store the global model's metrics of ``round`` (``source``: ``server`` or ``clients``)."""
        spec = self._spec(kind="federated-round", round=int(round), source=source)
        self.store.add([spec])
        values = {k: _plain(v) for k, v in metrics.items()}
        self.store.commit(TrialResult(key=spec.key, status="done", metrics=values, worker=worker_id()))
        return spec.key

    def rows(self, kind: str = "federated") -> list[dict[str, Any]]:
        """This run's rows of ``kind`` (as :meth:`Store.rows` gives them)."""
        return [r for r in self.store.rows(kind=kind) if (r.get("spec") or {}).get("run") == self.run]


def load_update(path: str | Path) -> dict[str, torch.Tensor]:
    """An update saved by :meth:`AuditLog.save_update` as tensors by parameter name."""
    with np.load(path) as data:
        return {k: torch.from_numpy(data[k].copy()) for k in data.files}


__all__ = ["AuditLog", "FederatedSpec", "MODES", "load_update"]
