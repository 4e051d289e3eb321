"""What a trial attacks, built from its spec: the dataset, the model (built, trained or a FedAvg checkpoint,
cached per process), the seeded batch, the malicious server's modification and the defense the attacker sees."""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from ...errors import LeakbenchError
from .controls import public_sample
from .trial import TrialSpec

# ----------------------------------------------------------------------------- cached inputs


@functools.lru_cache(maxsize=8)
def _dataset(name: str, options_json: str):
    from ...data import load

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
    from ...models import build

    opts = dict(spec.model_options)
    model = build(spec.model, input_shape=data.shape, classes=data.num_classes, act=opts.get("act"),
                  init=opts.get("init", "default"), seed=int(opts.get("seed", 0)), device=device,
                  normalize=opts.get("normalize"), **dict(opts.get("options") or {}))
    if opts.get("source_digest"):
        from ...models.custom import class_digest

        if class_digest(spec.model) != opts["source_digest"]:
            raise LeakbenchError(f"the source of {spec.model!r} changed since the trial was planned; re-plan it")
    if opts.get("file"):
        from ...models.files import file_digest, load_weights

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
        from ..training.utility import train_model

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


def federated_checkpoint(spec: TrialSpec, data, model: torch.nn.Module, cache_dir, *,
                         round_: int | None = None) -> tuple[dict, dict]:
    """(state dict, metrics) of the federated run of ``spec`` (:mod:`.federated`) at its round (or ``round_``);
    ``model`` is θ_0.  The run's other attacked rounds (``training["rounds"]``, where given) are kept on the way."""
    from ..training.federated import Run, checkpoint, run_key

    t = spec.training
    identity = {"dataset": spec.dataset, "data_options": spec.data_options, "model": spec.model,
                "model_options": spec.model_options, "defense": spec.defense, "federated": t["federated"],
                "seed": int(t["seed"]), "loss": spec.threat.get("loss", "ce")}
    untrained = None
    if spec.model_options.get("file"):  # the divergence line is a fresh build's loss, never the checkpoint's own
        from ...models import build

        opts = dict(spec.model_options)
        untrained = build(spec.model, input_shape=data.shape, classes=data.num_classes, act=opts.get("act"),
                          init=opts.get("init", "default"), seed=int(opts.get("seed", 0)),
                          device=next(model.parameters()).device, normalize=opts.get("normalize"),
                          **dict(opts.get("options") or {}))
    run = Run(model, data, spec.defense, t["federated"], int(t["seed"]), loss=spec.threat.get("loss", "ce"),
              untrained=untrained if untrained is not None else model)
    return checkpoint(run, int(t["round"] if round_ is None else round_), run_key(identity), cache_dir,
                      keep=[int(r) for r in t.get("rounds") or ()])


def batch_for(spec: TrialSpec, data) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``spec.batch`` of the ``spec.images`` samples drawn with ``spec.seed`` (the same images for every B),
    exactly the samples ``spec.indices``, or in a federated sweep B images of a client's (or the public) data."""
    if spec.indices:
        return data.batch(indices=list(spec.indices))
    if spec.training.get("federated"):
        from ..training.federated import client_batch

        idx = client_batch(data, spec.training["federated"], int(spec.training["seed"]), spec.batch,
                           spec.batch_size, public=spec.client == "public")
        return data.batch(indices=idx.tolist())
    pool = max(spec.images, spec.batch_size * (spec.batch + 1))
    x, y = data.batch(pool, seed=spec.seed)
    lo = spec.batch * spec.batch_size
    return x[lo:lo + spec.batch_size], y[lo:lo + spec.batch_size]


def apply_server(spec: TrialSpec, model: torch.nn.Module, data) -> torch.nn.Module:
    """The model the malicious server ships (``spec.server``), built around the client's ``model``.

    The server's random draws take the trial seed; the public sample it calibrates with holds
    none of the images attacked with that seed.
    """
    import importlib

    from ..sweep_spec.entries import SERVER_MOVES

    name, options = spec.server["move"], dict(spec.server.get("options") or {})
    options.setdefault("seed", spec.seed)
    if name == "trap_weights" and "rate" not in options and "scale" not in options:
        # the server sets the batch size (and knows the clients it aggregates): each row fires for 1/(B·L)
        options["rate"] = 1.0 / (spec.batch_size * aggregated_clients(spec.defense))
    if name == "loki" and "clients" not in options:  # one customised model per client the server aggregates
        options["clients"] = aggregated_clients(spec.defense)
    calibrated = name in ("imprint", "fishing", "loki") or (name == "trap_weights" and "scale" not in options) \
        or options.get("center") == "calibration"
    if calibrated:
        pool, _ = data.batch(max(spec.images, spec.batch_size * (spec.batch + 1)), seed=spec.seed)
        options["calibration"] = public_sample(data, pool, int(spec.server.get("public", 256)), seed=spec.seed,
                                               labelled=name == "fishing")
    module, _, function = SERVER_MOVES[name].rpartition(".")
    return getattr(importlib.import_module(module), function)(model, input_shape=data.shape, **options)


def aggregated_clients(defense: str) -> int:
    """L of a ``secagg:L`` part of the defense spec (1 without secure aggregation)."""
    from ...defenses import SecureAggregation, parse, parts_of

    return next((p.L for p in parts_of(parse(defense)) if isinstance(p, SecureAggregation)), 1)


def observed_defense(spec: TrialSpec) -> str:
    """The defense on the attacked client's round: the spec's, except for a federated sweep's public client, whose
    undefended round measures the attack's power at the checkpoint (the run itself trained under the defense)."""
    return "none" if spec.client == "public" else spec.defense


__all__ = ["batch_for", "model_for", "dataset_for", "apply_server", "aggregated_clients"]
