"""Which fit-config and fit-metric keys say how a client trained (flwr-free).

Flower leaves the names of the training settings to the app: its quickstart sends ``lr`` in the
train ``ConfigRecord`` and replies ``num-examples`` (the key FedAvg weights by).  :class:`FitKeys`
names the keys the auditor reads; a client's reply metrics win over the server's config (the
client knows what it ran).  :func:`local_training` turns them into :class:`LocalTraining`, the
arguments of :meth:`leakbench.threat.Observation.from_update`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from ...errors import ConfigError


@dataclass(frozen=True)
class FitKeys:
    """Names of the keys in the train config / reply metrics (defaults follow Flower's quickstart)."""

    lr: str = "lr"
    steps: str = "local-steps"
    epochs: str = "local-epochs"
    minibatch: str = "batch-size"
    examples: str = "num-examples"
    partition: str = "partition-id"
    #: config key through which :func:`~leakbench.integrations.flower.defense_mod` asks the train function
    #: for in-step defenses (dpsgd, dropout), and ConfigRecord name of the reply's leakbench record.
    defense: str = "leakbench-defense"
    record: str = "leakbench"


@dataclass(frozen=True)
class LocalTraining:
    """How one client trained in one round: ``steps`` full-batch SGD steps, or ``epochs`` of ``minibatch``."""

    batch_size: int
    lr: float
    steps: int = 1
    epochs: int | None = None
    minibatch: int | None = None

    def options(self) -> dict[str, Any]:
        """Keyword arguments of :meth:`leakbench.threat.Observation.from_update`."""
        out: dict[str, Any] = {"batch_size": self.batch_size, "lr": self.lr}
        if self.epochs is not None:
            out.update(epochs=self.epochs, minibatch=self.minibatch)
        else:
            out["steps"] = self.steps
        return out

    def describe(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "lr": self.lr, "steps": self.steps, "epochs": self.epochs,
                "minibatch": self.minibatch}


#: the most examples a client may report for one audited update (the attacks rebuild that many images).
MAX_EXAMPLES = 4096
#: the most local SGD steps a client may report (the update-matching attacks and the check replay them).
MAX_STEPS = 10_000


def _int(value: Any, key: str, limit: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not float(value).is_integer() or value < 1:
        raise ConfigError(f"expected a positive integer for fit key {key!r}, got {value!r}")
    if limit is not None and value > limit:
        raise ConfigError(f"expected at most {limit:,} for fit key {key!r} (the client's own report), got "
                          f"{value!r}; the audit of this update is skipped (raise the auditor's limit if it is real)")
    return int(value)


def local_training(config: Mapping[str, Any], metrics: Mapping[str, Any], keys: FitKeys = FitKeys(), *,
                   max_examples: int = MAX_EXAMPLES, max_steps: int = MAX_STEPS) -> LocalTraining:
    """The client's training in one round from the train ``config`` the server sent and the reply ``metrics``.

    Needs the learning rate (key ``keys.lr``) and the number of examples (``keys.examples``); local
    steps default to 1.  With ``keys.epochs`` present the client ran epochs of minibatches of
    ``keys.minibatch`` (all examples when absent).  The counts are the client's word: more than
    ``max_examples`` examples or ``max_steps`` local steps are refused (:class:`ConfigError`) before any work.
    """
    merged = {**dict(config), **dict(metrics)}
    if keys.lr not in merged:
        raise ConfigError(f"expected the client's learning rate under key {keys.lr!r} in the train config or the "
                          f"reply metrics, got keys {sorted(merged)} (set FitKeys(lr=...) to the key your app uses)")
    lr = merged[keys.lr]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"expected a learning rate > 0 under key {keys.lr!r}, got {lr!r}")
    if keys.examples not in merged:
        raise ConfigError(f"expected the number of training examples under key {keys.examples!r} in the reply "
                          f"metrics, got keys {sorted(merged)} (set FitKeys(examples=...))")
    batch = _int(merged[keys.examples], keys.examples, max_examples)
    if keys.epochs in merged:
        epochs = _int(merged[keys.epochs], keys.epochs, max_steps)
        minibatch = _int(merged[keys.minibatch], keys.minibatch) if keys.minibatch in merged else batch
        minibatch = min(minibatch, batch)
        steps = epochs * math.ceil(batch / minibatch)
        if steps > max_steps:
            raise ConfigError(f"expected at most {max_steps:,} local steps, got {epochs} epochs × "
                              f"{math.ceil(batch / minibatch)} minibatches = {steps:,} (fit keys {keys.epochs!r}, "
                              f"{keys.minibatch!r}); the audit of this update is skipped")
        return LocalTraining(batch_size=batch, lr=float(lr), steps=steps, epochs=epochs, minibatch=minibatch)
    steps = _int(merged[keys.steps], keys.steps, max_steps) if keys.steps in merged else 1
    return LocalTraining(batch_size=batch, lr=float(lr), steps=steps)


__all__ = ["FitKeys", "LocalTraining", "local_training", "MAX_EXAMPLES", "MAX_STEPS"]
