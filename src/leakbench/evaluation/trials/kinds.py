"""The ``utility`` trial (train under the defense, report test accuracy and loss; a FedAvg run's round
metrics when the model is federated) and the ``bound`` trial (the Cramér–Rao bound of Liu et al. 2024)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ...errors import UnsupportedThreatModel
from .inputs import batch_for, built, dataset_for, federated_checkpoint, model_for
from .trial import BOUND_ARGUMENTS, Clock, TrialResult, TrialSpec


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
    from ..sweep_spec.modality import pair_refusal
    from ..training.utility import utility

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
    """The federated run's utility at the trial's round: test accuracy and loss, training loss, the update's norm.

    Diverged (:func:`.federated.diverged`): a non-finite loss, or a training loss above the untrained model's — at
    this round *and* at the run's last attacked round (``training["rounds"]``).  A run still at the untrained
    model's loss in an early round (FedAvg's first rounds may sit a little above it) that descends below it by its
    last round is training, not diverged: said under ``above_untrained``, and its utility is measured."""
    from ..training.federated import diverged

    data = dataset_for(spec)
    theta0 = built(spec, data, torch.device(spec.device))
    _, info = federated_checkpoint(spec, data, theta0, cache_dir)
    metrics = {k: _number(info.get(k)) for k in ("train_loss", "train_accuracy", "test_accuracy", "test_loss",
                                                 "update_norm", "untrained_loss")}
    here = int(spec.training["round"])
    metrics["round"] = here
    metrics["samples_seen"] = float(int(info.get("samples_per_round") or 0) * here)
    why = diverged(info)
    last = max([here, *(int(r) for r in spec.training.get("rounds") or ())])
    if why is not None and not why.startswith("non-finite") and last > here:
        _, end = federated_checkpoint(spec, data, theta0, cache_dir, round_=last)
        later = diverged(end)
        if later is None:
            metrics["above_untrained"] = (f"{why} at round {here}; the run is below it by round {last}, its last "
                                          "attacked round: still training, not diverged")
            why = None
        else:
            why = f"{why} at round {here}, and at round {last}, the run's last attacked round: {later}"
    clock.lap("train")
    if why is not None:
        metrics["diverged"] = why
        if why.startswith("non-finite"):
            metrics.update(train_loss=None, train_accuracy=None, test_accuracy=None, test_loss=None)
    return TrialResult(key=spec.key, status="done", metrics=metrics)


def bound_trial(spec: TrialSpec, clock: Clock, cache_dir) -> TrialResult:
    """Cramér–Rao bound on the RMSE of unbiased estimators for the trial's batch (Liu et al. 2024, Sec. 3)."""
    from ...analysis.bounds import cramer_rao
    from ...defenses import parse, parts_of
    from ..sweep_spec.modality import dataset_modality

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
