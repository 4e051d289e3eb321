"""What a defense costs the model: train with the defense in every step, same budget as without.

Liu et al. (2024), Sec. 5.2 and Table 5 measure a defense's utility loss by the final
training loss of the task trained with the defense; we report that loss (on the whole
training set, after the last epoch), the training and test accuracy and, for DP-SGD,
ε for the defense's δ from Opacus's accountant at sample rate batch/N after all steps.

Every step is one federated round: the batch's shared tensors come from
:func:`leakbench.defenses.share` — the same code path :func:`leakbench.observe` uses —
and the server applies them (θ ← θ − lr·g for a gradient, θ ← θ + Δ for an update).
``secagg`` draws the other clients' batches from the training set.

:func:`utility` caches its results as JSON keyed by a hash of the whole configuration
(``$LEAKBENCH_CACHE/utility`` or ``~/.cache/leakbench/utility``), so sweeps never train twice.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...data import ImageDataset, TextDataset, load
from ...data.text import IGNORE
from ...defenses import DPSGD, Defense, LocalSteps, SecureAggregation, extend_model, parse, parts_of, share
from ...budget import check_time
from ...errors import ConfigError
from ...losses import get_loss
from ...models import MODELS, build
from .seeds import seeds_refusal, train_seeds

CACHE_VERSION = 3  # 3: initial_loss (the untrained model's training loss, the divergence line)


@dataclass
class TrainResult:
    """A training run with a defense: the trained model, losses per epoch, the final state, DP-SGD's ε."""

    model: nn.Module
    defense: str
    epochs: int
    steps: int
    batch_size: int
    lr: float
    losses: list[float]
    train_loss: float
    train_accuracy: float
    epsilon: float | None
    seconds: float
    samples_seen: int = 0


@dataclass
class UtilityResult:
    """The utility of a model trained with ``defense`` (``epsilon`` is None unless DP-SGD is used)."""

    defense: str
    train_loss: float
    train_accuracy: float
    test_accuracy: float
    epsilon: float | None
    seconds: float
    config: dict[str, Any]
    test_loss: float = math.nan
    losses: list[float] = field(default_factory=list)
    cached: bool = False
    samples_seen: int = 0
    steps: int = 0
    #: the untrained model's loss on the training set (a fresh build, also when training starts from a weights
    #: file): a run that ends above it diverged
    initial_loss: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UtilityResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def loss_and_accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, loss: str = "ce",
             chunk: int = 1024) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` in evaluation mode on ``images``/``labels``.

    For next-token prediction (B × T × V logits, B × T targets with −100 where a position has no next token)
    both are over the scored positions: the mean cross-entropy per token and the next-token accuracy."""
    loss_fn = get_loss(loss)
    was = model.training
    model.eval()
    total, correct, count = 0.0, 0, 0
    n = int(images.shape[0])
    with torch.no_grad():
        for i in range(0, n, chunk):
            out = model(images[i:i + chunk])
            yb = labels[i:i + chunk]
            if out.dim() == 3:  # tokens: every position that has a target counts once
                valid = yb != IGNORE
                k = int(valid.sum())
                if k:
                    total += float(loss_fn(out, yb)) * k
                    correct += int(((out.argmax(-1) == yb) & valid).sum())
                count += k
                continue
            total += float(loss_fn(out, yb)) * out.shape[0]
            pred = (out.reshape(-1) > 0).long() if out.shape[-1] == 1 else out.argmax(-1)
            correct += int((pred == yb).sum())
            count += int(out.shape[0])
    model.train(was)
    return total / max(count, 1), correct / max(count, 1)


def tensors(data: ImageDataset | TextDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """A dataset's inputs and targets: images and labels, or token ids B × T and their targets (next tokens with
    −100 where none, or one class per sequence)."""
    if isinstance(data, TextDataset):
        return data.batch(indices=list(range(len(data))))
    return data.images, data.labels


def _dpsgd_part(defense: Defense) -> DPSGD | None:
    return next((p for p in parts_of(defense) if isinstance(p, DPSGD)), None)


def samples_per_round(defense: Defense) -> int:
    """How many sample visits one round of ``defense`` costs per batch sample.

    ``local:k`` runs k passes over the client's batch and ``secagg:L`` trains on L clients'
    batches in one round; other defenses visit each sample once.  Training compares defenses
    at equal samples seen (epochs × N) by running ⌈rounds / this⌉ rounds, so no defense shows a
    utility gain by training more.
    """
    cost = 1
    for part in parts_of(defense):
        if isinstance(part, LocalSteps):
            cost *= part.k
        elif isinstance(part, SecureAggregation):
            cost *= part.L
    return cost


def check_training(epochs: int, batch_size: int, lr: float, n: int | None = None, *, field: str = "") -> None:
    """What every training run needs (:func:`train_model` checks it, and the preflight of a sweep checks it for
    every run the sweep will make, so ``--dry-run`` never says valid for a recipe that fails every trial):
    epochs ≥ 1, 1 ≤ batch_size ≤ ``n`` (the training set), a finite lr > 0."""
    at = f"field {field}." if field else "field "
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(f"expected epochs ≥ 1 (an int), got {epochs!r} ({at}epochs)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"expected batch_size ≥ 1 (an int), got {batch_size!r} ({at}batch_size)")
    if n is not None and batch_size > n:
        raise ConfigError(f"expected batch_size ≤ {n} (the training set), got {batch_size} ({at}batch_size)")
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"expected a finite lr > 0, got {lr!r} ({at}lr)")


def train_model(model: nn.Module, data: ImageDataset, *, defense: str | Defense | None = "none", epochs: int = 5,
                batch_size: int = 16, lr: float = 0.1, seed: int = 0, device: str | torch.device = "cpu",
                loss: str = "ce", population: ImageDataset | None = None) -> TrainResult:
    """Train ``model`` in place by mini-batch SGD where every step's shared tensors go through ``defense``.

    Each epoch visits the training set in a seeded random order in batches of ``batch_size``
    (the last one may be smaller).  ``population`` (default: ``data``) supplies the other
    clients' batches for ``secagg``.  DP-SGD's ε is computed at sample rate batch_size/N.
    Defenses that visit more samples per round (:func:`samples_per_round`) run proportionally
    fewer rounds, so every defense sees epochs × N samples.  A defense that adds layers (``precode``) inserts
    them into ``model`` in place before the first step (:func:`~leakbench.defenses.extend_model`, seeded by ``seed``).
    """
    check_training(epochs, batch_size, lr)
    if not isinstance(data, (ImageDataset, TextDataset)):
        raise ConfigError(f"expected the training data as an ImageDataset or a TextDataset, got "
                          f"{type(data).__name__} (argument data)")
    defense_obj = parse(defense)
    loss_fn = get_loss(loss)
    model = extend_model(defense_obj, model, seed=seed).to(device)  # PRECODE's bottleneck, inserted in place
    images, labels = (t.to(device) for t in tensors(data))
    n = int(images.shape[0])
    check_training(epochs, batch_size, lr, n)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError("the model has no trainable parameters")
    order_gen = torch.Generator(device="cpu").manual_seed(int(seed))
    defense_gen = torch.Generator(device="cpu").manual_seed(int(seed) + 7919)
    pool = population if population is not None else data
    start = time.perf_counter()
    losses: list[float] = []
    steps = seen = 0
    cost = samples_per_round(defense_obj)
    rounds = math.ceil(epochs * math.ceil(n / batch_size) / cost)
    for _ in range(epochs):
        if steps >= rounds:
            break
        model.train()
        order = torch.randperm(n, generator=order_gen).to(device)
        for i in range(0, n, batch_size):
            if steps >= rounds:
                break
            check_time(f"training ({steps:,} of {rounds:,} steps)")
            idx = order[i:i + batch_size]
            seen += cost * int(idx.numel())
            params = {name: p.detach() for name, p in named}
            result = share(defense_obj, model, params, images[idx], labels[idx], loss_fn, generator=defense_gen,
                           population=pool)
            with torch.no_grad():
                sign = -lr if result.kind == "gradient" else 1.0
                for (_, p), s in zip(named, result.tensors):
                    p.add_(s, alpha=sign)
            steps += 1
        losses.append(loss_and_accuracy(model, images, labels, loss=loss)[0])
    seconds = time.perf_counter() - start
    train_loss, train_accuracy = loss_and_accuracy(model, images, labels, loss=loss)
    dp = _dpsgd_part(defense_obj)
    eps = dp.epsilon(sample_rate=min(1.0, batch_size / n), steps=steps) if dp is not None else None
    return TrainResult(model=model, defense=defense_obj.spec, epochs=epochs, steps=steps, batch_size=batch_size,
                       lr=float(lr), losses=losses, train_loss=train_loss, train_accuracy=train_accuracy, epsilon=eps,
                       seconds=seconds, samples_seen=seen)


# --------------------------------------------------------------------------- utility with a cache


def split_indices(data: ImageDataset | TextDataset, test_fraction: float, *,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (train, test) indices of a seeded random split holding out ``test_fraction`` of every class (of all
    sequences, for text: a language model's classes are its vocabulary)."""
    if not (isinstance(test_fraction, (int, float)) and 0 < test_fraction < 1):
        raise ConfigError(f"expected test_fraction in (0, 1), got {test_fraction!r} (field test_fraction)")
    gen = torch.Generator().manual_seed(int(seed))
    if isinstance(data, TextDataset):
        order = torch.randperm(len(data), generator=gen)
        k = int(round(test_fraction * len(data)))
        if k == 0 or k == len(data):
            raise ConfigError(f"test_fraction {test_fraction} leaves an empty train or test set for {len(data)} "
                              "sequences")
        return torch.sort(order[k:]).values, torch.sort(order[:k]).values
    train_idx, test_idx = [], []
    for c in range(data.num_classes):
        members = torch.nonzero(data.labels.cpu() == c).reshape(-1)
        members = members[torch.randperm(members.numel(), generator=gen)]
        k = int(round(test_fraction * members.numel()))
        test_idx.append(members[:k])
        train_idx.append(members[k:])
    train = torch.sort(torch.cat(train_idx)).values
    test = torch.sort(torch.cat(test_idx)).values
    if train.numel() == 0 or test.numel() == 0:
        raise ConfigError(f"test_fraction {test_fraction} leaves an empty train or test set for {len(data)} samples")
    return train, test


def split(data: ImageDataset, test_fraction: float, *, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """A seeded random (train, test) split holding out ``test_fraction`` of every class (:func:`split_indices`)."""
    train, test = split_indices(data, test_fraction, seed=seed)
    return data.subset(train), data.subset(test)


def _fingerprint(data: ImageDataset) -> str:
    h = hashlib.sha256()
    inputs = data.ids if isinstance(data, TextDataset) else data.images
    h.update(str(tuple(inputs.shape)).encode())
    h.update(inputs.detach().cpu().contiguous().numpy().tobytes())
    h.update(data.labels.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def cache_root(cache_dir: str | os.PathLike | bool | None) -> Path | None:
    """The cache directory: ``cache_dir``, else ``$LEAKBENCH_CACHE/utility``, else ``~/.cache/leakbench/utility``."""
    if cache_dir is False:
        return None
    if cache_dir is None or cache_dir is True:
        base = os.environ.get("LEAKBENCH_CACHE")
        return Path(base) / "utility" if base else Path.home() / ".cache" / "leakbench" / "utility"
    return Path(cache_dir)


def config_key(config: dict[str, Any]) -> str:
    """The cache key of a configuration: a hash of its canonical JSON."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _resolve_data(dataset, data_options, test_fraction, seed) -> tuple[ImageDataset, ImageDataset, Any]:
    options = dict(data_options or {})
    if isinstance(dataset, str):
        full = load(dataset, **options)
        train, test = split(full, test_fraction, seed=seed)
        return train, test, {"name": dataset, "options": options}
    if options:
        raise ConfigError("data_options apply to a dataset name; got an ImageDataset (argument data_options)")
    if isinstance(dataset, (ImageDataset, TextDataset)):
        train, test = split(dataset, test_fraction, seed=seed)
        return train, test, {"name": dataset.name, "fingerprint": _fingerprint(dataset)}
    if isinstance(dataset, (tuple, list)) and len(dataset) == 2 and all(isinstance(d, (ImageDataset, TextDataset)) for d in dataset):
        train, test = dataset
        return train, test, {"train": _fingerprint(train), "test": _fingerprint(test)}
    raise ConfigError("expected dataset as a name (e.g. 'digits'), an ImageDataset or a (train, test) pair, "
                      f"got {type(dataset).__name__} (argument dataset)")


def utility(model_spec: str, dataset: str | ImageDataset | tuple[ImageDataset, ImageDataset],
            defense: str | Defense | None = "none", *, epochs: int = 5, batch_size: int = 16, lr: float = 0.1,
            seed: int = 0, data_options: dict | None = None, model_options: dict | None = None,
            test_fraction: float = 0.25, loss: str = "ce", cache_dir: str | os.PathLike | bool | None = None,
            device: str | torch.device = "cpu", model_file: str | os.PathLike | None = None) -> UtilityResult:
    """Train ``model_spec`` on ``dataset`` with ``defense`` in every step and measure what it costs.

    The model is built with ``seed`` (and ``model_options`` such as ``act``); the data is
    split into train/test by class with ``test_fraction`` held out (a (train, test) pair is
    used as given).  ``model_file``: a state dict the model starts from (:mod:`leakbench.models.files`).
    Results are cached by configuration (``cache_dir=False`` disables).
    """
    result = utility_seeds(model_spec, dataset, defense, seeds=[seed], epochs=epochs, batch_size=batch_size, lr=lr,
                           data_options=data_options, model_options=model_options, test_fraction=test_fraction,
                           loss=loss, cache_dir=cache_dir, device=device, model_file=model_file)[0]
    if isinstance(result, Exception):
        raise result
    return result


def utility_seeds(model_spec: str, dataset: str | ImageDataset | tuple[ImageDataset, ImageDataset],
                  defense: str | Defense | None = "none", *, seeds: list[int], epochs: int = 5, batch_size: int = 16,
                  lr: float = 0.1, data_options: dict | None = None, model_options: dict | None = None,
                  test_fraction: float = 0.25, loss: str = "ce", cache_dir: str | os.PathLike | bool | None = None,
                  device: str | torch.device = "cpu", model_file: str | os.PathLike | None = None,
                  stacked: bool | None = None) -> list[UtilityResult | Exception]:
    """:func:`utility` for each of ``seeds`` (one result, or the error that stopped it, per seed), the seeds not
    cached yet trained together (:func:`~.seeds.train_seeds`) unless the defense or the model cannot stack
    (:func:`~.seeds.seeds_refusal`) or ``stacked`` is False: then one after the other, each as :func:`utility`.

    ``stacked=None`` (default) stacks on CUDA only: on a CPU the vmapped step measured slower than k plain
    ones (demo CNN 0.73–0.86×, MLP 0.16–0.57×; DP-SGD 0.9–2.0×; docs/evaluation.md), on an H200 2.3× (plain)
    and 5.2× (DP-SGD) faster per seed at 8 seeds."""
    if stacked is None:
        stacked = torch.device(device).type == "cuda"
    if not isinstance(model_spec, str):
        raise ConfigError(f"expected a model spec string like 'mlp:32' (for modules use train_model), got "
                          f"{type(model_spec).__name__} (argument model_spec)")
    check_training(epochs, batch_size, lr)
    defense_obj = parse(defense)
    root = cache_root(cache_dir)
    results: list[UtilityResult | Exception | None] = [None] * len(seeds)
    todo: list[tuple[int, dict, Path | None, ImageDataset, ImageDataset, nn.Module, float]] = []
    for i, seed in enumerate(seeds):
        try:
            train, test, data_key = _resolve_data(dataset, data_options, test_fraction, seed)
            config = {
                "version": CACHE_VERSION, "model": model_spec, "model_options": dict(model_options or {}),
                "data": data_key,
                "test_fraction": float(test_fraction) if not isinstance(dataset, (tuple, list)) else None,
                "defense": defense_obj.spec, "epochs": epochs, "batch_size": batch_size, "lr": float(lr),
                "seed": int(seed), "loss": loss,
            }
            if model_file is not None:
                from ...models.files import file_digest

                config["model_file"] = file_digest(model_file)
                # the divergence line is the untrained model's loss, never the checkpoint's own (a healthy
                # fine-tune may end a little above it); runs cached before this have the checkpoint's loss
                config["initial_loss"] = "fresh build"
            from ...models.custom import class_digest, is_class_spec

            if is_class_spec(model_spec, MODELS.names()):  # your own class: an edited source is a new run
                config["source_digest"] = class_digest(model_spec)
            path = root / f"{config_key(config)}.json" if root is not None else None
            cached = _cached(path, config)
            if cached is not None:
                results[i] = cached
                continue
            model = build(model_spec, input_shape=train.shape, classes=train.num_classes, seed=seed, device=device,
                          **dict(model_options or {}))
            if batch_size > len(train):
                raise ConfigError(f"expected batch_size ≤ {len(train)} (the training set), got {batch_size} "
                                  "(field batch_size)")
            initial_loss, _ = loss_and_accuracy(model, *(t.to(device) for t in tensors(train)), loss=loss)
            if model_file is not None:  # after the untrained model's loss: that is the divergence line
                from ...models.files import load_weights

                load_weights(model, model_file, field="model_file")
            todo.append((i, config, path, train, test, model, initial_loss))
        except Exception as err:  # noqa: BLE001 (one seed's failure is its own)
            results[i] = err
    if not todo:
        return results  # type: ignore[return-value]
    runs: list[TrainResult | Exception] = []
    if stacked and len(todo) > 1 and seeds_refusal(defense_obj, todo[0][5]) is None:
        try:
            runs = [TrainResult(**r) for r in train_seeds([t[5] for t in todo], [t[3] for t in todo],
                                                          seeds=[seeds[t[0]] for t in todo], defense=defense_obj,
                                                          epochs=epochs, batch_size=batch_size, lr=lr, device=device,
                                                          loss=loss)]
        except Exception:  # noqa: BLE001 (an operation vmap cannot map: the seeds train one after the other;
            runs = []      # train_seeds writes the models only once it has finished)
    if not runs:
        for i, _, _, train, _, model, _ in todo:
            try:
                runs.append(train_model(model, train, defense=defense_obj, epochs=epochs, batch_size=batch_size,
                                        lr=lr, seed=seeds[i], device=device, loss=loss))
            except Exception as err:  # noqa: BLE001
                runs.append(err)
    for (i, config, path, _, test, model, initial_loss), run in zip(todo, runs):
        if isinstance(run, Exception):
            results[i] = run
            continue
        test_loss, test_accuracy = loss_and_accuracy(model, *(t.to(device) for t in tensors(test)), loss=loss)
        result = UtilityResult(defense=defense_obj.spec, train_loss=run.train_loss,
                               train_accuracy=run.train_accuracy, test_accuracy=test_accuracy, epsilon=run.epsilon,
                               seconds=run.seconds, config=json.loads(json.dumps(config, default=str)),
                               test_loss=test_loss, losses=run.losses, samples_seen=run.samples_seen, steps=run.steps,
                               initial_loss=initial_loss)
        _store(path, result)
        results[i] = result
    return results  # type: ignore[return-value]


def _cached(path: Path | None, config: dict) -> UtilityResult | None:
    if path is None or not path.exists():
        return None
    try:
        result = UtilityResult.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError):
        return None  # a broken cache entry is recomputed and overwritten
    if result.config != json.loads(json.dumps(config, default=str)):
        return None
    result.cached = True
    return result


def _store(path: Path | None, result: UtilityResult) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(result.to_dict(), f, indent=1)
    os.replace(tmp, path)


__all__ = ["TrainResult", "UtilityResult", "train_model", "utility", "utility_seeds", "loss_and_accuracy", "tensors",
           "split", "split_indices", "cache_root",
           "config_key", "samples_per_round"]
