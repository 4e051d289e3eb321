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

This module holds the spec, the result and the kinds ``attack``, ``utility`` and ``bound``;
:func:`leakbench.evaluation.run.run_trial` runs a trial of any kind (``weights`` and
``membership`` are in :mod:`.published`, which imports this module, never the reverse).
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
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..budget import check_time, time_limit
from ..errors import BudgetExceeded, LeakbenchError, NothingRecovered, UnsupportedThreatModel

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


# ----------------------------------------------------------------------------- cached inputs


@functools.lru_cache(maxsize=8)
def _dataset(name: str, options_json: str):
    from ..data import load

    return load(name, **json.loads(options_json))


def dataset_for(spec: TrialSpec):
    """The trial's dataset (loaded once per process)."""
    return _dataset(spec.dataset, json.dumps(spec.data_options, sort_keys=True))


_TRAINED: dict[str, dict[str, torch.Tensor]] = {}


def _model_key(spec: TrialSpec) -> str:
    text = json.dumps([spec.dataset, spec.data_options, spec.model, spec.model_options, spec.training],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def built(spec: TrialSpec, data, device: torch.device) -> torch.nn.Module:
    """The trial's model as built (with its weights file, if any), before any training."""
    from ..models import build

    opts = dict(spec.model_options)
    model = build(spec.model, input_shape=data.shape, classes=data.num_classes, act=opts.get("act"),
                  init=opts.get("init", "default"), seed=int(opts.get("seed", 0)), device=device,
                  normalize=opts.get("normalize"), **dict(opts.get("options") or {}))
    if opts.get("source_digest"):
        from ..models.custom import class_digest

        if class_digest(spec.model) != opts["source_digest"]:
            raise LeakbenchError(f"the source of {spec.model!r} changed since the trial was planned; re-plan it")
    if opts.get("file"):
        from ..models.files import file_digest, load_weights

        if opts.get("file_digest") and file_digest(opts["file"]) != opts["file_digest"]:
            raise LeakbenchError(f"the model file {opts['file']!r} changed since the trial was planned; re-plan it")
        load_weights(model, opts["file"], field="model file")
    return model


def model_for(spec: TrialSpec, data, device: torch.device, cache_dir: Path | None = None) -> torch.nn.Module:
    """Build the trial's model and bring it to its training state (trained weights cached per process and on disk;
    a federated round's checkpoint from its run, :mod:`.federated`)."""
    model = built(spec, data, device)
    if spec.training.get("federated"):
        state, _ = federated_checkpoint(spec, data, model, cache_dir)
        model.load_state_dict(state)
        return model
    epochs = int(spec.training.get("epochs", 0))
    if epochs == 0:
        return model
    key = _model_key(spec)
    state = _TRAINED.get(key)
    path = Path(cache_dir) / "models" / f"{key}.pt" if cache_dir is not None else None
    if state is None and path is not None and path.is_file():
        state = torch.load(path, map_location="cpu", weights_only=True)
    if state is None:
        from .utility import train_model

        trained = train_model(model, data, defense="none", epochs=epochs, batch_size=int(spec.training["batch_size"]),
                              lr=float(spec.training["lr"]), seed=int(spec.training.get("seed", 0)),
                              device=str(device))
        state = {k: v.detach().cpu().clone() for k, v in trained.model.state_dict().items()}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)  # atomic: concurrent workers never read a half-written file
    _TRAINED[key] = state
    model.load_state_dict(state)
    return model


def federated_checkpoint(spec: TrialSpec, data, model: torch.nn.Module, cache_dir) -> tuple[dict, dict]:
    """(state dict, metrics) of the federated run of ``spec`` (:mod:`.federated`) at its round; ``model`` is θ_0."""
    from .federated import Run, checkpoint, run_key

    t = spec.training
    identity = {"dataset": spec.dataset, "data_options": spec.data_options, "model": spec.model,
                "model_options": spec.model_options, "defense": spec.defense, "federated": t["federated"],
                "seed": int(t["seed"]), "loss": spec.threat.get("loss", "ce")}
    untrained = None
    if spec.model_options.get("file"):  # the divergence line is a fresh build's loss, never the checkpoint's own
        from ..models import build

        opts = dict(spec.model_options)
        untrained = build(spec.model, input_shape=data.shape, classes=data.num_classes, act=opts.get("act"),
                          init=opts.get("init", "default"), seed=int(opts.get("seed", 0)),
                          device=next(model.parameters()).device, normalize=opts.get("normalize"),
                          **dict(opts.get("options") or {}))
    run = Run(model, data, spec.defense, t["federated"], int(t["seed"]), loss=spec.threat.get("loss", "ce"),
              untrained=untrained if untrained is not None else model)
    return checkpoint(run, int(t["round"]), run_key(identity), cache_dir)


def batch_for(spec: TrialSpec, data) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``spec.batch`` of the ``spec.images`` samples drawn with ``spec.seed`` (the same images for every B),
    exactly the samples ``spec.indices``, or in a federated sweep B images of a client's (or the public) data."""
    if spec.indices:
        return data.batch(indices=list(spec.indices))
    if spec.training.get("federated"):
        from .federated import client_batch

        idx = client_batch(data, spec.training["federated"], int(spec.training["seed"]), spec.batch,
                           spec.batch_size, public=spec.client == "public")
        return data.batch(indices=idx.tolist())
    pool = max(spec.images, spec.batch_size * (spec.batch + 1))
    x, y = data.batch(pool, seed=spec.seed)
    lo = spec.batch * spec.batch_size
    return x[lo:lo + spec.batch_size], y[lo:lo + spec.batch_size]


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


def chance_scores(x: torch.Tensor, data) -> dict[str, float]:
    """The chance level beside every reconstruction: a flat image at the dataset's mean pixel value.

    An attack whose RMSE is not below ``chance_rmse`` has learnt nothing about the batch
    that the dataset's average colour does not already say.
    """
    from ..metrics.compare import flat_chance

    chance = flat_chance(x, float(data.images.mean()))
    return {"chance_rmse": chance["chance_rmse"], "chance_psnr": chance["chance_psnr"]}


def chance_per_sample(x: torch.Tensor, data) -> list[float]:
    """Each image's own chance RMSE (the flat image at the dataset's mean pixel value), original order."""
    from ..metrics.compare import flat_chance

    return flat_chance(x, float(data.images.mean()))["per_sample"]


def constant_output(images: torch.Tensor) -> bool:
    """True when a reconstruction is one flat value everywhere: an attack's fallback, not a reconstruction."""
    return images.numel() > 1 and bool((images.amax() - images.amin()).abs() <= 1e-12 * max(1.0, float(
        images.abs().amax())))


def draw_excluding(images: torch.Tensor, exclude: torch.Tensor, count: int, *, seed: int) -> torch.Tensor:
    """Indices of a seeded draw of at most ``count`` rows of ``images`` none of which equals a row of ``exclude``.

    Rows are compared by a random projection, then exactly (a projection collision never drops a row).
    """
    flat = images.reshape(images.shape[0], -1).double()
    ex = exclude.reshape(exclude.shape[0], -1).to(flat.device, flat.dtype)
    probe = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(12345), dtype=torch.float64)
    probe = probe.to(flat.device)
    taken = set((ex @ probe).tolist())
    codes = (flat @ probe).tolist()
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(int(seed))).tolist()
    keep = [i for i in order if codes[i] not in taken or not (ex == flat[i]).all(1).any()][:count]
    return torch.as_tensor(keep, dtype=torch.long)


def public_sample(data, exclude: torch.Tensor, count: int, *, seed: int) -> torch.Tensor:
    """``count`` images of ``data`` the server may hold: a seeded draw that contains none of ``exclude``.

    The client's images never calibrate the server's block.  Fewer than ``count`` are returned when the
    data is short.
    """
    idx = draw_excluding(data.images, exclude, count, seed=int(seed) + 10007)
    return data.images[idx.to(data.images.device)]


#: the most images an IIP pool holds: the batch's originals plus a seeded draw of other images of the dataset
IIP_POOL = 256


def identification_pool(x: torch.Tensor, data, *, seed: int) -> torch.Tensor:
    """The candidates of the trial's IIP (:func:`leakbench.metrics.identify.iip`): the originals ``x`` first, then a
    seeded draw of up to ``IIP_POOL − B`` other images of ``data`` (none equal to an original).  Only the
    ``IIP_POOL`` drawn candidates are read and compared, never the whole dataset."""
    b = x.shape[0]
    pick = torch.randperm(len(data.images), generator=torch.Generator().manual_seed(int(seed) + 20011))[:IIP_POOL]
    others = data.images[pick.to(data.images.device)].to(x.device, x.dtype)
    same = torch.cdist(others.reshape(len(others), -1).double(), x.reshape(b, -1).double(),
                       compute_mode="donot_use_mm_for_euclid_dist") == 0
    return torch.cat([x, others[~same.any(1)][: max(0, IIP_POOL - b)]])


def model_features(model: torch.nn.Module, x: torch.Tensor):
    """The feature map of the trial's feature-space IIP: the observed model's penultimate features
    (:func:`leakbench.metrics.identify.penultimate_features`), or None for a model without a linear layer or whose
    forward pass on the batch fails (then only the pixel-space IIP is stored)."""
    from ..metrics.identify import penultimate_features

    try:
        fn = penultimate_features(model)
        fn(x[:1])
    except Exception:  # noqa: BLE001 - an optional score: a model it cannot read leaves it out
        return None
    return fn


def apply_server(spec: TrialSpec, model: torch.nn.Module, data) -> torch.nn.Module:
    """The model the malicious server ships (``spec.server``), built around the client's ``model``.

    The server's random draws take the trial seed; the public sample it calibrates with holds
    none of the images attacked with that seed.
    """
    import importlib

    from .spec import SERVER_MOVES

    name, options = spec.server["move"], dict(spec.server.get("options") or {})
    options.setdefault("seed", spec.seed)
    if name == "trap_weights" and "rate" not in options and "scale" not in options:
        # the server sets the batch size (and knows the clients it aggregates): each row fires for 1/(B·L)
        options["rate"] = 1.0 / (spec.batch_size * aggregated_clients(spec.defense))
    calibrated = name in ("imprint", "fishing") or (name == "trap_weights" and "scale" not in options) \
        or options.get("center") == "calibration"
    if calibrated:
        pool, _ = data.batch(max(spec.images, spec.batch_size * (spec.batch + 1)), seed=spec.seed)
        options["calibration"] = public_sample(data, pool, int(spec.server.get("public", 256)), seed=spec.seed)
    module, _, function = SERVER_MOVES[name].rpartition(".")
    return getattr(importlib.import_module(module), function)(model, input_shape=data.shape, **options)


def aggregated_clients(defense: str) -> int:
    """L of a ``secagg:L`` part of the defense spec (1 without secure aggregation)."""
    from ..defenses import SecureAggregation, parse, parts_of

    return next((p.L for p in parts_of(parse(defense)) if isinstance(p, SecureAggregation)), 1)


def observed_defense(spec: TrialSpec) -> str:
    """The defense on the attacked client's round: the spec's, except for a federated sweep's public client, whose
    undefended round measures the attack's power at the checkpoint (the run itself trained under the defense)."""
    return "none" if spec.client == "public" else spec.defense


def run_attack(spec: TrialSpec, obs, clock: Clock) -> Any:
    """The spec's attack run on ``obs`` under the trial's budget, or the ``n/a`` result saying why it cannot run."""
    from ..attacks import create

    attack = create(spec.attack, preset=spec.preset, **spec.options)
    reasons = attack.requirements(obs)
    if reasons:
        return TrialResult(key=spec.key, status="n/a", error="; ".join(reasons))
    if clock.prepared is not None:  # solved in a batched call with the trial's chunk-mates
        if isinstance(clock.prepared, BaseException):
            raise clock.prepared
        clock.lap("attack")
        return clock.prepared
    clock.start_budget()
    rec = attack(obs, seed=spec.seed, progress=clock.progress)
    clock.lap("attack")
    return rec


def attack_trial(spec: TrialSpec, clock: Clock, cache_dir) -> TrialResult:
    from ..threat import observe
    from .modality import pair_refusal

    reason = pair_refusal(spec.dataset, spec.model, spec.attack)
    if reason is not None:  # an image attack on text (or back): skipped with the reason, nothing loaded
        return TrialResult(key=spec.key, status="n/a", error=reason)
    device = torch.device(spec.device)
    data = dataset_for(spec)
    clock.lap("load")
    model = honest = model_for(spec, data, device, cache_dir)
    if spec.server:
        model = apply_server(spec, model, data)
    clock.lap("model")
    x, y = batch_for(spec, data)
    x, y = x.to(device), y.to(device)
    # the dataset is the population other clients draw from (secure aggregation needs one)
    obs = observe(model, x, y, defense=observed_defense(spec), seed=spec.seed, population=data, **spec.threat)
    clock.lap("observe")
    result = _attacked(spec, obs, x, y, data, clock)
    if result.status == "done":  # an update too small to carry anything is said to be that (:mod:`.strongest`)
        result.metrics["update_norm"] = float(torch.sqrt(sum((s.double() ** 2).sum() for s in obs.shared)))
        if spec.server:
            result.metrics["client_check"] = client_check(honest, model, x, y, spec.threat.get("loss", "ce"))
    return result


def client_check(honest: torch.nn.Module, shipped: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 loss: str) -> float:
    """1.0 when the client's check (:func:`leakbench.analysis.inspect`: the shipped model against the honest one
    it replaces, with the attacked batch) would have refused the model before training, else 0.0."""
    from ..analysis import inspect

    if not x.is_floating_point():  # token ids: the data check runs on images only
        return float(inspect(honest, shipped).suspicious)
    return float(inspect(honest, shipped, x=x, y=y, loss=loss).suspicious)


def _attacked(spec: TrialSpec, obs, x: torch.Tensor, y: torch.Tensor, data, clock: Clock) -> TrialResult:
    """Run the spec's attack on ``obs`` and score it against the batch ``(x, y)``."""
    from ..metrics import compare
    from ..metrics.perceptual import user_weights

    try:
        rec = run_attack(spec, obs, clock)
    except NothingRecovered as err:
        if not is_text(data):
            raise
        # a defense left the attack nothing to recover (DAGER: noise fills the span): its output is the empty
        # sequence, scored as such (token accuracy 0), with the reason — a measurement, not a failed trial
        clock.lap("attack")
        return text_result(spec, None, x.cpu(), y.cpu(), data, clock, nothing=str(err))
    if isinstance(rec, TrialResult):
        return rec
    if is_text(data):
        return text_result(spec, rec, x.cpu(), y.cpu(), data, clock)
    images = rec.images.detach().to("cpu", torch.float32)
    if constant_output(images):
        # a constant image carries nothing about the batch: scoring it would rank a defense by a grey image
        return TrialResult(key=spec.key, status="failed",
                           error=f"the attack returned one flat value ({float(images.flatten()[0]):.3g}) for every "
                                 "pixel: it determined nothing from this observation, so there is nothing to score",
                           timings={"attack_reported": float(rec.trace.get("seconds", 0.0))})
    labels = None if rec.labels is None else rec.labels.detach().cpu()
    if labels is not None and labels.ndim == 2:
        labels = labels.argmax(dim=1)
    x, y = x.cpu(), y.cpu()
    # the whole reconstruction, so attacks that flag exact samples are scored with their flags (confident-first)
    confidence = None if rec.confidence is None else rec.confidence.detach().cpu()
    # the chance level: a flat image at the data mean; labels nobody knows (an unlabelled folder) score no accuracy;
    # IIP against the batch plus a seeded draw of the dataset (iip_pixel beside chance_iip_pixel)
    scores = compare(dataclasses.replace(rec, images=images, labels=labels, confidence=confidence), x,
                     y if getattr(data, "labels_known", True) else None, chance_level=float(data.images.mean()),
                     pool=identification_pool(x, data, seed=spec.seed) if x.dim() == 4 else None,
                     feature_fn=model_features(obs.model, x) if x.dim() == 4 else None,
                     lpips=bool(user_weights()))  # LPIPS (and chance_lpips) when the user supplied its weights
    clock.lap("score")
    per_sample = scores.pop("per_sample")
    order = scores.pop("order")
    metrics = {k: v for k, v in scores.items() if v is None or isinstance(v, (int, float))}
    metrics["matching"] = str(scores.get("matching", "total-mse"))  # which pairing of Liu et al. eq. 1 scored it
    arrays = {}
    if spec.save_images:
        arrays = {"x": x.numpy(), "y": y.numpy(), "reconstruction": images.numpy(),
                  "order": np.asarray(order, dtype=np.int64),
                  "labels": (labels.numpy().astype(np.int64) if labels is not None
                             else np.full(images.shape[0], -1, dtype=np.int64))}
    return TrialResult(key=spec.key, status="done", metrics=metrics, per_sample=per_sample, arrays=arrays,
                       timings={"attack_reported": float(rec.trace.get("seconds", 0.0))},
                       attack_options=dict(rec.options or {}))


def is_text(data) -> bool:
    """True for a dataset of token sequences (:class:`~leakbench.data.TextDataset`)."""
    from ..data import TextDataset

    return isinstance(data, TextDataset)


#: the text scores a text trial stores (:func:`~leakbench.metrics.text_scores`), each beside its chance level
TEXT_METRICS = ("token_acc", "rouge1", "rouge2", "rougeL", "exact")


def text_result(spec: TrialSpec, rec, x: torch.Tensor, y: torch.Tensor, data, clock: Clock, *,
                nothing: str | None = None) -> TrialResult:
    """Score a text reconstruction: token accuracy after Hungarian matching, ROUGE-1/2/L and the exact rate
    (:func:`~leakbench.metrics.text_scores`), beside the same scores of unigram draws
    (:func:`~leakbench.metrics.unigram_chance`, ``chance_*``).

    The verdict logic (:mod:`.strongest`) ranks by ``token_error`` = 1 − token accuracy (lower = more leakage,
    as RMSE) against ``chance_token_error``; per sequence (original order) the same, for the per-sample
    strongest attack.  Arrays: the original and recovered ids, their pairing and the decoded sentences are
    left to the report (``x``, ``reconstruction``, ``order``).  ``nothing``: the attack recovered nothing (its
    reason; ``rec`` None): the empty output is scored, and the reason kept as ``metrics["nothing_recovered"]``.
    """
    from ..metrics.text_metrics import content, match_sequences, text_scores, token_accuracy_matrix, unigram_chance

    ids = torch.full_like(x, data.pad_id) if rec is None else rec.images.detach().cpu()
    if ids.is_floating_point():
        ids = ids.round().long()
    tok = data.tokenizer
    kw = dict(decode=tok.decode, pad_id=data.pad_id, eos_id=tok.eos_id)
    scores = text_scores(ids, x, **kw)
    chance = unigram_chance(x, _unigram(spec, data), seed=spec.seed, **kw)
    orig, found = content(x, (data.pad_id, tok.eos_id)), content(ids, (data.pad_id, tok.eos_id))
    partner = match_sequences(found, orig)
    acc = token_accuracy_matrix(found, orig)
    per_acc = [float(acc[i, j]) if j is not None else 0.0 for i, j in enumerate(partner)]
    clock.lap("score")
    metrics: dict[str, Any] = {k: float(v) for k, v in scores.items()}
    metrics.update({f"chance_{k}": float(v) for k, v in chance.items()})
    metrics.update(token_error=1.0 - metrics["token_acc"], chance_token_error=1.0 - metrics["chance_token_acc"],
                   modality="text", sequences=len(orig), matching="hungarian-token-accuracy")
    if nothing is not None:
        metrics["nothing_recovered"] = nothing
    flags = None if rec is None else rec.trace.get("exact")
    if isinstance(flags, list) and flags and all(isinstance(f, bool) for f in flags):
        metrics["flagged_exact"] = int(sum(flags))
    per_sample = {"token_acc": per_acc, "token_error": [1.0 - a for a in per_acc],
                  "chance_token_error": [1.0 - metrics["chance_token_acc"]] * len(per_acc),
                  "partner": [-1 if j is None else int(j) for j in partner]}
    arrays = {}
    if spec.save_images:
        arrays = {"x": x.numpy().astype(np.int64), "y": y.numpy().astype(np.int64),
                  "reconstruction": ids.numpy().astype(np.int64),
                  "order": np.asarray(per_sample["partner"], dtype=np.int64)}
    return TrialResult(key=spec.key, status="done", metrics=metrics, per_sample=per_sample, arrays=arrays,
                       timings={"attack_reported": 0.0 if rec is None else float(rec.trace.get("seconds", 0.0))},
                       attack_options={} if rec is None else dict(rec.options or {}))


@functools.lru_cache(maxsize=4)
def _unigram_of(name: str, options_json: str) -> torch.Tensor:
    return _dataset(name, options_json).unigram()


def _unigram(spec: TrialSpec, data) -> torch.Tensor:
    """The chance draws' unigram distribution: the dataset's (computed once per process)."""
    return _unigram_of(spec.dataset, json.dumps(spec.data_options, sort_keys=True))


def utility_arguments(spec: TrialSpec, cache_dir) -> dict[str, Any]:
    """The keyword arguments of :func:`~.utility.utility` for utility trial ``spec`` (``model_spec``, ``dataset``
    and the options)."""
    u = dict(spec.utility)
    opts = dict(spec.model_options)
    model_options = {k: v for k, v in (("act", opts.get("act")), ("init", opts.get("init", "default"))) if v}
    model_options.update(dict(opts.get("options") or {}))
    if opts.get("normalize"):
        model_options["normalize"] = opts["normalize"]
    return dict(model_spec=spec.model, dataset=spec.dataset, defense=spec.defense, epochs=int(u["epochs"]),
                batch_size=int(spec.batch_size or u["batch_size"]), lr=float(u["lr"]), seed=int(u.get("seed", 0)),
                data_options=dict(spec.data_options) or None, model_options=model_options,
                test_fraction=float(u["test_fraction"]), loss=spec.threat.get("loss", "ce"),
                cache_dir=False if cache_dir is None else str(Path(cache_dir) / "utility"), device=spec.device,
                model_file=opts.get("file") or None)


def utility_trial(spec: TrialSpec, clock: Clock, cache_dir) -> TrialResult:
    from .modality import pair_refusal
    from .utility import utility

    reason = pair_refusal(spec.dataset, spec.model)
    if reason is not None:
        return TrialResult(key=spec.key, status="n/a", error=reason)
    if isinstance(clock.prepared, BaseException):  # trained in a batched call (:mod:`.chunks`), and it failed
        raise clock.prepared
    if spec.training.get("federated"):
        return federated_utility(spec, clock, cache_dir)
    result = clock.prepared if clock.prepared is not None else utility(**utility_arguments(spec, cache_dir))
    clock.lap("train")
    metrics = {k: _number(getattr(result, k, None))
               for k in ("train_loss", "train_accuracy", "test_accuracy", "epsilon", "samples_seen", "steps",
                         "initial_loss")}
    start, loss = metrics.get("initial_loss"), metrics.get("train_loss")
    if loss is None or not math.isfinite(loss):
        # a diverged run is a finding about the defense (no utility number), not a failed trial
        metrics.update(diverged="non-finite training loss", train_loss=None, train_accuracy=None,
                       test_accuracy=None)
    elif start is not None and math.isfinite(start) and loss > start:
        metrics["diverged"] = f"final training loss {loss:.3g} above the untrained model's {start:.3g}"
    return TrialResult(key=spec.key, status="done", metrics=metrics,
                       timings={"train_reported": float(getattr(result, "seconds", 0.0) or 0.0)})


def federated_utility(spec: TrialSpec, clock: Clock, cache_dir) -> TrialResult:
    """The federated run's utility at the trial's round: test accuracy and loss, training loss, the update's norm;
    diverged against the untrained model's loss (:func:`.federated.diverged`)."""
    from .federated import diverged

    data = dataset_for(spec)
    _, info = federated_checkpoint(spec, data, built(spec, data, torch.device(spec.device)), cache_dir)
    clock.lap("train")
    metrics = {k: _number(info.get(k)) for k in ("train_loss", "train_accuracy", "test_accuracy", "test_loss",
                                                 "update_norm", "untrained_loss")}
    metrics["round"] = int(spec.training["round"])
    metrics["samples_seen"] = float(int(info.get("samples_per_round") or 0) * int(spec.training["round"]))
    why = diverged(info)
    if why is not None:
        metrics["diverged"] = why
        if why.startswith("non-finite"):
            metrics.update(train_loss=None, train_accuracy=None, test_accuracy=None, test_loss=None)
    return TrialResult(key=spec.key, status="done", metrics=metrics)


def bound_trial(spec: TrialSpec, clock: Clock, cache_dir) -> TrialResult:
    """Cramér–Rao bound on the RMSE of unbiased estimators for the trial's batch (Liu et al. 2024, Sec. 3)."""
    from ..analysis.bounds import cramer_rao

    from ..defenses import parse, parts_of
    from .modality import dataset_modality

    if dataset_modality(spec.dataset) == "text":
        raise UnsupportedThreatModel("the Cramér–Rao bound is on the RMSE of continuous inputs; token ids are "
                                     "discrete (no bound for text)")
    arguments: dict[str, float] = {}
    for part in parts_of(parse(spec.defense)):
        if part.family == "none":
            continue
        if part.family not in BOUND_ARGUMENTS:
            raise UnsupportedThreatModel(f"the Cramér–Rao bound models {', '.join(BOUND_ARGUMENTS)}, not "
                                         f"{part.family!r}")
        values = part.parameters
        if values.get("scope", "global") != "global":
            raise UnsupportedThreatModel(f"the Cramér–Rao bound models global {part.family} only, not {part.spec!r}")
        name, value = BOUND_ARGUMENTS[part.family]
        arguments[name] = float(values[value])
    if not arguments.get("sigma"):
        raise UnsupportedThreatModel("the Cramér–Rao bound needs gradient noise (noise:σ) in the defense")
    device = torch.device(spec.device)
    data = dataset_for(spec)
    model = model_for(spec, data, device, cache_dir)
    x, y = batch_for(spec, data)
    clock.lap("setup")
    bound = cramer_rao(model, x.to(device), y.to(device), loss=spec.threat.get("loss", "ce"), **arguments,
                       **dict(spec.bounds.get("options") or {}))
    clock.lap("bound")
    metrics = {k: _number(getattr(bound, k, None)) for k in ("exact_rmse", "trace_rmse", "exact", "trace", "rank",
                                                              "grad_norm", "clip_scale")}
    return TrialResult(key=spec.key, status="done", metrics=metrics)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


__all__ = ["TrialSpec", "TrialResult", "TrialTimeout", "batch_for", "model_for", "dataset_for",
           "worker_id", "apply_server", "client_check", "public_sample", "draw_excluding", "chance_scores", "chance_per_sample",
           "constant_output", "non_finite", "threat_model", "KINDS", "STATUSES", "is_text", "text_result",
           "TEXT_METRICS",
           "THREAT_MODELS"]
