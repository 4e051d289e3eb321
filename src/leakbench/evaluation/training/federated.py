"""Training as an axis of the evaluation: FedAvg runs whose checkpoints are attacked round by round.

A sweep with a ``federated:`` section (:class:`~.specfederated.FederatedEntry`) simulates one run of federated
averaging per (dataset, model, defense, seed) and attacks the global model of chosen rounds.  The run is
McMahan et al. (2017), Algorithm 1 (FederatedAveraging) with every client taking part (C = 1): in round t each
client k starts from the global θ_t, runs E local epochs of minibatch SGD (batch b, rate η) over its n_k samples
and returns Δ_k = θ_k − θ_t; the server sets θ_{t+1} = θ_t + Σ_k (n_k / n) Δ_k.  A model's buffers (BatchNorm's
running statistics) are averaged with the same weights, from each client's values after its local training
(:class:`_Buffers`).  The defense acts in every client's round through :func:`leakbench.defenses.share` — the
code path :func:`leakbench.observe` uses — so a defended run trains under its defense from round 1, as it would
in production.  A ``local:k,lr[,b]`` defense (local aggregation) replaces the run's own E, η and b in the clients'
rounds.

The data of a seed (:func:`layout`): a per-class test split (``test_fraction``), ``public`` training images the
attacker holds and no client ever sees (the power control of :mod:`.strongest`), and the rest partitioned among
the clients — ``iid`` (a seeded shuffle cut into K near-equal parts) or ``dirichlet`` (each class's samples
split by proportions drawn from Dir(α·1_K), Hsu et al. 2019, Sec. 3).  Every random choice of round t and
client k draws from a generator seeded by (seed, t, k), so a run resumed from its round-t checkpoint continues
exactly as the uninterrupted run.

Checkpoints are content-addressed: ``<cache>/federated/<key>/round-<t>.pt`` (the state dict, tensors only) and
``round-<t>.json`` (test loss and accuracy, training loss, the update's norm) where ``key`` hashes everything
that decides the run.  ``latest.pt`` holds the last round trained, so a killed run resumes there; a lock file
keeps two workers from training one run twice.  The attacked batch of (seed, batch j) holds B images of client
j mod K (the same images at every round), and the public client's batch B images of the public set.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import pickle  # noqa: S403 (only its error type: checkpoints are read with torch.load(weights_only=True))
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ...budget import check_time
from ...defenses import LocalSteps, extend_model, parse, parts_of, share
from ...errors import ConfigError
from ...losses import get_loss
from .utility import loss_and_accuracy, split_indices, tensors

#: files of a run's checkpoints and metrics (version 2: BN running statistics averaged like the weights)
FORMAT = 2
#: checkpoints kept in memory per process (the attack trials of one round share one)
_MEMORY: OrderedDict[tuple[str, int], tuple[dict[str, torch.Tensor], dict[str, Any]]] = OrderedDict()
_MEMORY_SIZE = 16
#: the most samples the training loss is measured on at a checkpoint (a seeded subset of the clients' data)
TRAIN_LOSS_SAMPLES = 4096


@dataclass(frozen=True)
class Layout:
    """Where a seed's samples go (indices into the dataset): test split, public set, one array per client."""

    train: np.ndarray
    test: np.ndarray
    public: np.ndarray
    clients: list[np.ndarray]


def _rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng([int(p) % 2**63 for p in parts])


def _generator(*parts: int) -> torch.Generator:
    seed = int.from_bytes(hashlib.sha256(json.dumps([int(p) for p in parts]).encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(seed % 2**63)


def layout(data, config: dict[str, Any], seed: int) -> Layout:
    """The seed's test split, public set and client partition (see the module docstring)."""
    train, test = (t.numpy() for t in split_indices(data, float(config["test_fraction"]), seed=int(seed)))
    rng = _rng(seed, 1)
    train = rng.permutation(train)
    public_n = int(config["public"])
    k = int(config["clients"])
    if len(train) - public_n < k:
        raise ConfigError(f"expected at least one training sample per client: {len(train)} training samples, "
                          f"{public_n} public, {k} clients (fields federated.public, federated.clients)")
    public, pool = np.sort(train[:public_n]), train[public_n:]
    if config["partition"] == "iid":
        clients = [np.sort(part) for part in np.array_split(pool, k)]
    else:
        clients = _dirichlet(pool, data.labels.cpu().numpy(), k, float(config["alpha"]), seed)
    return Layout(train=np.sort(train), test=test, public=public, clients=clients)


def _dirichlet(pool: np.ndarray, labels: np.ndarray, k: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Each class's samples of ``pool`` cut among k clients by proportions from Dir(α·1_k), redrawn (at most 100
    times) until every client holds a sample."""
    for attempt in range(100):
        rng = _rng(seed, 2, attempt)
        parts: list[list[int]] = [[] for _ in range(k)]
        for c in np.unique(labels[pool]):
            members = pool[labels[pool] == c]
            cuts = (np.cumsum(rng.dirichlet(np.full(k, alpha))) * len(members)).astype(int)[:-1]
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].extend(chunk.tolist())
        if all(parts):
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ConfigError(f"a Dirichlet partition with alpha {alpha} left a client without samples in 100 draws "
                      f"({len(pool)} samples, {k} clients): raise federated.alpha or lower federated.clients")


def client_batch(data, config: dict[str, Any], seed: int, batch: int, size: int, *,
                 public: bool = False) -> np.ndarray:
    """Indices of the attacked batch ``batch`` of ``seed``: ``size`` images of client batch mod K (or of the public
    set), the same at every round."""
    lay = layout(data, config, seed)
    owner = lay.public if public else lay.clients[batch % len(lay.clients)]
    if size > len(owner):
        who = "the public set" if public else f"client {batch % len(lay.clients)}"
        raise ConfigError(f"expected a batch size of at most {len(owner)} ({who}'s samples), got {size}: lower "
                          "batch_sizes or federated.clients" + (", or raise federated.public" if public else ""))
    return _rng(seed, 3, batch, int(public)).choice(owner, size=size, replace=False)


def run_key(identity: dict[str, Any]) -> str:
    """The content address of a run: a hash of everything that decides it."""
    text = json.dumps({"format": FORMAT, **identity}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` (fcntl where available): two processes never train one run at once."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: the atomic writes keep files whole, a run may train twice
        yield
        return
    with open(folder / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _save(folder: Path, name: str, state: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / f"{name}.pt")
    tmp_json = folder / f".{name}.{os.getpid()}.json.tmp"
    tmp_json.write_text(json.dumps(info, sort_keys=True))
    os.replace(tmp_json, folder / f"{name}.json")


def _load(folder: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    pt, meta = folder / f"{name}.pt", folder / f"{name}.json"
    if not (pt.is_file() and meta.is_file()):
        return None
    try:
        info = json.loads(meta.read_text())
        state = torch.load(pt, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError):  # damaged: retrained, never trusted
        return None
    if not isinstance(state, dict) or not isinstance(info, dict):
        return None
    return state, info


class Run:
    """One FedAvg run: a model at θ_0, the data, the defense and the run's configuration (see :func:`checkpoint`)."""

    def __init__(self, model: nn.Module, data, defense: str, config: dict[str, Any], seed: int, *,
                 loss: str = "ce", untrained: nn.Module | None = None) -> None:
        # a defense that adds layers (PRECODE's bottleneck) inserts them into ``model`` in place, seeded by the run
        self.model, self.data, self.defense = extend_model(defense, model, seed=seed), data, defense
        self.config, self.seed, self.loss = dict(config), int(seed), loss
        self.layout = layout(data, config, seed)
        self.untrained = untrained
        # the clients' round: E epochs of minibatches b at rate η — unless the defense is local aggregation
        # (local:k,lr[,b]), which then sets the clients' local training itself
        own = any(isinstance(p, LocalSteps) for p in parts_of(parse(defense)))
        self.local = {} if own else {"local_steps": int(config["local_epochs"]), "local_lr": float(config["lr"]),
                                     "local_batch": int(config["batch_size"]), "local_shuffle": True}

    def _evaluate(self, model: nn.Module, round_: int, update_norm: float | None) -> dict[str, Any]:
        images, labels = tensors(self.data)
        device = next(model.parameters()).device
        test = torch.as_tensor(self.layout.test)
        test_loss, test_acc = loss_and_accuracy(model, images[test].to(device), labels[test].to(device),
                                                loss=self.loss)
        pool = np.concatenate(self.layout.clients)
        if len(pool) > TRAIN_LOSS_SAMPLES:
            pool = _rng(self.seed, 4).choice(pool, size=TRAIN_LOSS_SAMPLES, replace=False)
        train = torch.as_tensor(np.sort(pool))
        train_loss, train_acc = loss_and_accuracy(model, images[train].to(device), labels[train].to(device),
                                                  loss=self.loss)
        return {"round": round_, "test_loss": test_loss, "test_accuracy": test_acc, "train_loss": train_loss,
                "train_accuracy": train_acc, "update_norm": update_norm}

    def step(self, model: nn.Module, round_: int) -> float:
        """Round ``round_`` (1-based) of FedAvg on ``model`` in place; returns ‖θ_{t} − θ_{t−1}‖."""
        cfg = self.config
        images, labels = tensors(self.data)
        device = next(model.parameters()).device
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = {n: p.detach().clone() for n, p in named}
        loss_fn = get_loss(self.loss)
        population = self.data.subset(torch.as_tensor(np.concatenate(self.layout.clients)))
        total = float(sum(len(c) for c in self.layout.clients))
        update = [torch.zeros_like(p) for _, p in named]
        buffers = _Buffers(model)
        clients = self.layout.clients
        for k, owned in enumerate(clients):
            buffers.restore()  # every client starts from the global model's running statistics
            check_time(f"federated round {round_}, client {k + 1} of {len(clients)}")
            chosen = owned
            if cfg.get("client_samples") and int(cfg["client_samples"]) < len(owned):
                chosen = np.sort(_rng(self.seed, 5, round_, k).choice(owned, size=int(cfg["client_samples"]),
                                                                       replace=False))
            idx = torch.as_tensor(chosen)
            x, y = images[idx].to(device), labels[idx].to(device)
            shared = share(self.defense, model, params, x, y, loss_fn, generator=_generator(self.seed, round_, k),
                           population=population, **self.local)
            weight = len(chosen) / total if not cfg.get("client_samples") else 1.0 / len(clients)
            for u, s in zip(update, shared.tensors):
                u.add_(s.to(u.dtype), alpha=weight)
            buffers.add(weight)
        buffers.settle()
        with torch.no_grad():
            for (_, p), u in zip(named, update):
                p.add_(u)
        return float(torch.sqrt(sum((u.double() ** 2).sum() for u in update)))


class _Buffers:
    """A model's buffers (BatchNorm's running statistics) through one FedAvg round: each client's local training
    starts from the global values and moves them in place; the server averages the clients' values with the weights
    of their updates (the whole state dict, as a FedAvg server does with a PyTorch model — Flower's strategy averages
    every array it is sent).  Counters (``num_batches_tracked``) take the largest client's count.  Before (format 1)
    the global model kept the statistics of whichever client trained last.  The averaged statistics are still those
    of the clients' models, not of the averaged one: after a large first round they need not fit it
    (docs/evaluation.md, "The paper's setting", the learned-prior preset: round 1 of a digits run at chance
    accuracy, 0.64 with statistics re-estimated)."""

    def __init__(self, model: nn.Module) -> None:
        self.live = dict(model.named_buffers())
        self.start = {n: b.detach().clone() for n, b in self.live.items()}
        self.sum = {n: torch.zeros_like(b) for n, b in self.start.items() if b.is_floating_point()}
        self.count = {n: b.clone() for n, b in self.start.items() if not b.is_floating_point()}

    def restore(self) -> None:
        with torch.no_grad():
            for n, b in self.live.items():
                b.copy_(self.start[n])

    def add(self, weight: float) -> None:
        with torch.no_grad():
            for n, total in self.sum.items():
                total.add_(self.live[n].to(total.dtype), alpha=weight)
            for n, most in self.count.items():
                torch.maximum(most, self.live[n], out=most)

    def settle(self) -> None:
        with torch.no_grad():
            for n, b in self.live.items():
                b.copy_(self.sum[n] if n in self.sum else self.count[n])


def checkpoint(run: Run, round_: int, key: str, cache_dir: str | Path | None, *,
               keep: Sequence[int] = ()) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, metrics) of the global model after ``round_`` rounds (0 = the start), training what is missing.

    From disk when stored (``cache_dir``), else resumed from the latest stored round at or below ``round_`` (or
    from θ_0), saving ``round_`` and ``latest`` as it goes, and every round of ``keep`` it passes (the run's other
    attacked rounds: later trials read them instead of retraining).  Without a ``cache_dir`` nothing is written
    and the run trains in memory.
    """
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
        raise ConfigError(f"expected a round ≥ 0, got {round_!r} (field federated.rounds)")
    hit = _MEMORY.get((key, round_))
    if hit is not None:
        _MEMORY.move_to_end((key, round_))
        return hit
    folder = Path(cache_dir) / "federated" / key if cache_dir is not None else None
    lock = _locked(folder) if folder is not None else contextlib.nullcontext()
    with lock:
        found = _load(folder, f"round-{round_}") if folder is not None else None
        if found is None:
            found = _train_to(run, round_, folder, key, keep)
    _remember((key, round_), found)
    return found


def _train_to(run: Run, round_: int, folder: Path | None, key: str,
              keep: Sequence[int] = ()) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train from the latest stored round at or below ``round_`` (else θ_0) to ``round_``; store it, ``latest`` and
    the rounds of ``keep`` on the way."""
    model = copy.deepcopy(run.model)
    start, norm = 0, None
    latest = _load(folder, "latest") if folder is not None else None
    if latest is not None and 0 < int(latest[1].get("round", -1)) <= round_:
        model.load_state_dict(latest[0])
        start, norm = int(latest[1]["round"]), latest[1].get("update_norm")
    for t in range(start + 1, round_ + 1):
        norm = run.step(model, t)
        if t == round_:
            break
        state = _state(model) if folder is not None or t in keep else None
        if t in keep:
            passed = (state, _metrics(run, model, t, norm))
            _remember((key, t), passed)
            if folder is not None:
                _save(folder, f"round-{t}", *passed)
        if folder is not None:  # a killed run resumes here
            _save(folder, "latest", state, {"round": t, "update_norm": norm})
    info = _metrics(run, model, round_, norm)
    state = _state(model)
    if folder is not None:
        _save(folder, f"round-{round_}", state, info)
        if latest is None or int(latest[1].get("round", -1)) <= round_:
            _save(folder, "latest", state, {"round": round_, "update_norm": norm})
    return state, info


def _metrics(run: Run, model: nn.Module, round_: int, norm: float | None) -> dict[str, Any]:
    info = run._evaluate(model, round_, norm)
    if run.untrained is not None:
        images, labels = tensors(run.data)
        pool = torch.as_tensor(np.sort(np.concatenate(run.layout.clients))[:TRAIN_LOSS_SAMPLES])
        device = next(run.untrained.parameters()).device
        info["untrained_loss"] = loss_and_accuracy(run.untrained, images[pool].to(device), labels[pool].to(device),
                                                   loss=run.loss)[0]
    info["samples_per_round"] = int(sum(len(c) for c in run.layout.clients)) * int(run.config["local_epochs"])
    return info


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _remember(key: tuple[str, int], value) -> None:
    _MEMORY[key] = value
    _MEMORY.move_to_end(key)
    while len(_MEMORY) > _MEMORY_SIZE:
        _MEMORY.popitem(last=False)


def diverged(info: dict[str, Any]) -> str | None:
    """Why the run's model at this checkpoint counts as diverged, else None: a non-finite loss, or a training loss
    above the *untrained* model's (a fresh build of the same architecture — never the loss of the checkpoint a run
    started from, which a healthy fine-tune may end a little above)."""
    loss, start = info.get("train_loss"), info.get("untrained_loss")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return "non-finite training loss"
    if isinstance(start, (int, float)) and math.isfinite(start) and loss > start:
        return f"training loss {loss:.3g} above the untrained model's {start:.3g}"
    return None


__all__ = ["Layout", "Run", "layout", "client_batch", "checkpoint", "run_key", "diverged", "FORMAT"]
