"""One trial: a pure function of its :class:`TrialSpec` → :class:`TrialResult`.

An ``attack`` trial loads the dataset, builds (and trains, when asked) the
model, draws the batch, computes the observation under the defense, runs the
attack and scores the reconstruction after Hungarian matching.  A ``utility``
trial trains the model with the defense and reports its utility.  Every random
choice is seeded from the spec, the global RNG is left as it was, and the
number of torch threads is fixed by the spec, so the same spec gives the same
result in-process, in a process pool or on a Ray worker.

A trial never raises for a problem of its own: an attack whose requirements
the observation does not meet is ``"n/a"`` with the reason, anything else that
goes wrong is ``"failed"`` with the error and its traceback.

This module holds the spec, the result, the clock and the budgets; the kinds are in :mod:`.attack` and
:mod:`.kinds` (``attack``, ``utility``, ``bound``) and in :mod:`..membership.published` (``weights``,
``membership``); :func:`leakbench.evaluation.running.run.run_trial` runs a trial of any kind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...budget import check_time, time_limit
from ...errors import BudgetExceeded

KINDS = ("attack", "utility", "bound", "weights", "membership")
#: the threat models a trial can assume (the usual taxonomy; :func:`threat_model` says which one a trial has).
THREAT_MODELS = ("eavesdropper", "informed-eavesdropper", "malicious-server", "published-weights", "membership")
#: defense families the Cramér–Rao bound models: the argument of ``cramer_rao`` each sets, and the defense's parameter.
BOUND_ARGUMENTS = {"noise": ("sigma", "sigma"), "clip": ("clip", "C"), "prune": ("prune", "p")}
STATUSES = ("pending", "running", "done", "failed", "timed out", "n/a")
#: fields of a :class:`TrialSpec` that do not change its result (labels and execution settings).
NOT_IDENTITY = ("dataset_key", "model_key", "attack_key", "device", "threads", "stack", "trial_seconds",
                "save_images", "deadline")


#: fields added after the first store format; empty values leave a trial's key as it was.
ADDED_FIELDS = ("server", "target", "membership", "indices", "preset_revision", "client", "plugins")


def threat_model(spec: dict[str, Any]) -> str:
    """The threat model of a trial given as its spec dict (see :data:`THREAT_MODELS`).

    Published weights and membership are their own trial kinds; a model carrying a server
    move assumes a malicious server; an observation granting BN statistics or labels an
    informed eavesdropper; anything else an honest-but-curious eavesdropper of the gradient.
    Utility and bound trials belong to the eavesdropper's (and server's) defense settings.
    """
    if spec.get("threat_model") in THREAT_MODELS:  # stated outright (e.g. a row imported from elsewhere)
        return spec["threat_model"]
    kind = spec.get("kind", "attack")
    if kind == "weights":
        return "published-weights"
    if kind == "membership":
        return "membership"
    if spec.get("server"):
        return "malicious-server"
    threat = spec.get("threat") or {}
    if kind == "attack" and (threat.get("bn_stats") or threat.get("labels_known")):
        return "informed-eavesdropper"
    return "eavesdropper"


#: what a loop cut by the sweep's end names (:func:`run_trial`); the sweep puts such a trial back to pending
SWEEP_BUDGET = "budget.sweep_minutes"


@contextlib.contextmanager
def trial_budget(deadline: float | None, seconds: float | None, what: str = "budget.trial_seconds") -> Iterator[None]:
    """Every loop inside stops at the sweep's end (``deadline``, wall-clock) and after ``seconds`` (``what``)."""
    with time_limit(until=deadline, what=SWEEP_BUDGET), time_limit(seconds, what):
        yield


class TrialTimeout(BudgetExceeded):
    """A trial ran past the spec's ``budget.trial_seconds``."""


@dataclass(frozen=True)
class TrialSpec:
    """Everything that fixes one trial; :attr:`key` hashes the fields that determine its result."""

    kind: str
    dataset: str
    model: str
    defense: str = "none"
    data_options: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    batch_size: int = 0
    images: int = 0
    batch: int = 0
    seed: int = 0
    attack: str = ""
    preset: str | None = None
    #: the preset's revision (:func:`leakbench.attacks.preset_revision`): a changed preset is a new trial
    preset_revision: int = 0
    options: dict = field(default_factory=dict)
    threat: dict = field(default_factory=dict)
    utility: dict = field(default_factory=dict)
    bounds: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    target: dict = field(default_factory=dict)
    membership: dict = field(default_factory=dict)
    indices: list = field(default_factory=list)
    #: whose batch a federated attack trial attacks: "" (a client's) or "public" (the attacker's own images,
    #: observed without the defense: the attack's power at that checkpoint)
    client: str = ""
    #: the plug-ins whose components the trial uses, module → source digest (:mod:`leakbench.plugins`): an edited
    #: plug-in is a new trial, and every process imports them before it runs the trial
    plugins: dict = field(default_factory=dict)
    dataset_key: str = ""
    model_key: str = ""
    attack_key: str = ""
    device: str = "cpu"
    threads: int = 1
    stack: int | None = None  # the most trials solved as one batched call (None: the device's default)
    trial_seconds: float | None = None
    save_images: bool = True
    #: the sweep's end (``time.time()``, from ``budget.sweep_minutes``): every loop of the trial stops there
    deadline: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def identity(self) -> dict[str, Any]:
        """The fields that determine the result (labels and execution settings left out).

        Fields added after the first release are left out while empty, so stores written
        before them keep their keys (and resume).
        """
        return {k: v for k, v in self.to_dict().items()
                if k not in NOT_IDENTITY and not (k in ADDED_FIELDS and not v)}

    @property
    def threat_model(self) -> str:
        """Which of :data:`THREAT_MODELS` this trial assumes."""
        return threat_model(self.to_dict())

    @functools.cached_property
    def key(self) -> str:
        text = json.dumps(self.identity(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    @property
    def label(self) -> str:
        """A one-line human description."""
        if self.kind == "utility":
            at = f" B={self.batch_size}" if self.batch_size else ""
            return f"utility {self.dataset_key} {self.model_key} {self.defense}{at} seed {self.utility.get('seed', 0)}"
        if self.kind == "membership" and self.membership.get("form") == "reference":
            return (f"{self.attack_key} vs {self.defense} on {self.dataset_key} {self.model_key} "
                    f"({self.membership.get('reference_models')} reference models) seed {self.seed}")
        if (self.kind == "membership" and self.membership.get("form") == "run") or (
                self.kind == "weights" and self.target.get("run")):
            return f"{self.attack_key} vs {self.defense} on {self.dataset_key} {self.model_key} seed {self.seed}"
        if self.kind in ("weights", "membership"):
            return f"{self.attack_key} on published {self.model_key} seed {self.seed}"
        if self.kind == "bound":
            return f"bound {self.defense} on {self.dataset_key} {self.model_key} B={self.batch_size} seed {self.seed}"
        return (f"{self.attack_key} vs {self.defense} on {self.dataset_key} {self.model_key} "
                f"B={self.batch_size} seed {self.seed} batch {self.batch}")


@dataclass
class TrialResult:
    """What a trial produced: status, mean and per-sample metrics, timings, error, arrays for the images."""

    key: str
    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    per_sample: dict[str, list] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    worker: str = ""
    #: the attack's resolved options (preset + overrides), for the CLI's metrics.json; not stored
    attack_options: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return float(self.timings.get("total", 0.0))


def worker_id() -> str:
    """``host:pid`` of the process running a trial."""
    return f"{socket.gethostname()}:{os.getpid()}"


# ----------------------------------------------------------------------------- running


class Clock:
    """Named timings and the attack's deadline (checked at every progress report of the attack).

    The budget counts the attack alone: it starts at :meth:`start_budget`, after the data,
    the model and the observation are ready, so loading or training never eats into it.
    """

    def __init__(self, limit: float | None, report=None) -> None:
        self.start = time.perf_counter()
        self.limit = limit
        self.report = report
        self.timings: dict[str, float] = {}
        self._mark = self.start
        self._budget_start = self.start
        #: what a batched call (:mod:`.chunks`) already computed for this trial: its reconstruction or utility
        #: result, or the exception that stopped it
        self.prepared: Any = None

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - self._mark
        self._mark = now

    def start_budget(self) -> None:
        self._budget_start = time.perf_counter()

    def progress(self, done: int, total: int, loss: float) -> None:
        if self.report is not None:
            self.report(done, total, loss)
        check_time(f"the attack ran {done} of {total} steps")
        if self.limit is not None and time.perf_counter() - self._budget_start > self.limit:
            raise TrialTimeout(f"ran {done} of {total} steps: the attack exceeded budget.trial_seconds={self.limit:g}")

    def total(self) -> dict[str, float]:
        return {**self.timings, "total": time.perf_counter() - self.start}


#: metrics whose non-finite value makes a trial ``failed`` (a NaN reconstruction or loss is no result).
FINITE_METRICS = ("mse", "rmse", "psnr", "ssim", "train_loss", "test_accuracy", "exact_rmse", "trace_rmse", "auc",
                  "token_acc")


def non_finite(metrics: dict[str, Any]) -> list[str]:
    """Names of the metrics in :data:`FINITE_METRICS` that are NaN or ±inf (PSNR +inf of an exact match is fine)."""
    bad = []
    for name in FINITE_METRICS:
        v = metrics.get(name)
        if isinstance(v, (int, float)) and not math.isfinite(v) and not (name == "psnr" and v == math.inf):
            bad.append(f"{name}={v}")
    return bad


__all__ = ["TrialSpec", "TrialResult", "TrialTimeout", "worker_id", "non_finite", "threat_model", "KINDS", "STATUSES", "THREAT_MODELS"]
