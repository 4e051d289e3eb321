"""Reference models for membership inference, trained with the target's recipe on random halves of a pool.

LiRA (Carlini et al. 2022, Sec. IV-B, Algorithm 1) and RMIA (Zarifzadeh et al. 2024, Sec. 3) compare the target
with models the attacker trains the same way on data that does (IN) or does not (OUT) hold each queried point.
:func:`train_reference_models` trains ``count`` models with a :class:`Recipe` — the same model spec, options,
defense (DP-SGD included: ε from the same Opacus accountant), epochs, batch size, learning rate and loss as
:func:`~.utility.train_model` — each on half of the population ``pool``:

- masks in complementary pairs (Carlini et al.'s code keeps every example in exactly half of the models):
  models 2i and 2i+1 train on the two halves of one seeded permutation, so with an even count every point is
  IN for exactly count/2 models and OUT for as many (an odd pool's leftover point is OUT of both);
- seeds drawn from ``numpy.random.SeedSequence([seed, 7])``; each model's seed and its mask row are recorded;
- seeds trained stacked (:func:`~.seeds.train_seeds`) where :func:`~.utility.utility_seeds` stacks them — on
  CUDA and when :func:`~.seeds.seeds_refusal` allows — otherwise one after the other with ``train_model``;
- cached as one ``.pt`` file (state dicts, seeds, masks, φ on the pool) keyed by the whole configuration in
  ``$LEAKBENCH_CACHE/reference`` (or ``~/.cache/leakbench/reference``; ``cache_dir=False`` disables).

:func:`target_on_half` trains a target the same way on a seeded half of the pool (its members), which is how
the tests, the benchmark and an audit of a recipe measure the attacks; :func:`membership_rows` turns per-point
scores into AUC with its interval and TPR at low FPR where the non-members can measure it (≥ 10/FPR,
:func:`~.stats.measurable_fpr`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ...attacks.membership import MEMBERSHIP_ATTACKS
from ...attacks.membership.reference import ReferenceOutputs, target_confidence
from ...data import ImageDataset
from ...defenses import parse
from ...errors import ConfigError
from ...models import build
from ...threat import observe_weights
from ..training.seeds import seeds_refusal, train_seeds
from ..verdicts.stats import Interval, auc_interval, measurable_fpr
from ..training.utility import TrainResult, _fingerprint, train_model

__all__ = ["Recipe", "ReferenceModels", "train_reference_models", "target_on_half", "half_masks", "target_mask",
           "TrainedTarget", "cached_target", "cache_lock", "canary_audit",
           "MembershipRow", "membership_rows", "run_membership_attacks", "CACHE_VERSION", "divergence",
           "DIVERGED_FACTOR"]

CACHE_VERSION = 1
#: a trained model whose training loss ends above this many times the loss of predicting nothing (all-zero
#: outputs: ln C for cross-entropy) has diverged: its scores measure the divergence, not membership
DIVERGED_FACTOR = 2.0


@torch.no_grad()
def divergence(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, train_loss: float, *,
               loss: str = "ce", what: str = "target") -> str | None:
    """Why the model trained to ``train_loss`` on (``images``, ``labels``) is no trained model (None if it is):
    non-finite parameters or loss, or a loss above :data:`DIVERGED_FACTOR` × the loss of all-zero outputs."""
    from ...losses import get_loss

    if not math.isfinite(float(train_loss)) or any(not bool(torch.isfinite(p).all()) for p in model.parameters()):
        return f"non-finite/diverged {what}: its training ended on a NaN/inf loss or weights ({train_loss!r})"
    dev = next(model.parameters()).device
    shape = model(images[:1].to(dev)).shape[1:]
    chance = float(get_loss(loss)(torch.zeros(len(labels), *shape, device=dev), labels.to(dev)))
    if math.isfinite(chance) and chance > 0 and float(train_loss) > DIVERGED_FACTOR * chance:
        return (f"non-finite/diverged {what}: its training loss {float(train_loss):.4g} is above {DIVERGED_FACTOR:g} × "
                f"{chance:.4g} (the loss of predicting nothing), so its scores would measure the divergence, not "
                "membership; lower the recipe's lr")
    return None


@dataclass(frozen=True)
class Recipe:
    """How the target was trained: what :func:`~.utility.train_model` needs besides the data and the seed."""

    model: str
    model_options: dict = field(default_factory=dict)
    defense: str = "none"
    epochs: int = 5
    batch_size: int = 16
    lr: float = 0.1
    loss: str = "ce"
    model_file: str | None = None

    def build(self, data: ImageDataset, seed: int, device: str | torch.device = "cpu") -> nn.Module:
        model = build(self.model, input_shape=data.shape, classes=data.num_classes, seed=int(seed), device=device,
                      **dict(self.model_options))
        if self.model_file is not None:
            from ...models.files import load_weights

            load_weights(model, self.model_file, field="model_file")
        return model

    def key(self) -> dict[str, Any]:
        d = asdict(self)
        d["defense"] = parse(self.defense).spec
        if self.model_file is not None:
            from ...models.files import file_digest

            d["model_file"] = file_digest(self.model_file)
        return d


def half_masks(pool_size: int, count: int, *, seed: int) -> torch.Tensor:
    """count × pool_size IN masks in complementary pairs, each row holding ⌊pool_size/2⌋ points (seeded)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"expected count ≥ 1 reference models, got {count!r} (argument count)")
    if pool_size < 2:
        raise ConfigError(f"expected a pool of at least 2 points, got {pool_size}")
    rng = np.random.default_rng([int(seed), 11])
    half = pool_size // 2
    masks = np.zeros((count, pool_size), dtype=bool)
    for i in range(0, count, 2):
        order = rng.permutation(pool_size)
        masks[i, order[:half]] = True
        if i + 1 < count:
            masks[i + 1, order[half:2 * half]] = True
    return torch.from_numpy(masks)


def _train(recipe: Recipe, datas: list[ImageDataset], seeds: list[int], device, stacked: bool | None) -> list[tuple]:
    """(model, TrainResult) per seed, stacked as utility_seeds stacks them."""
    defense = parse(recipe.defense)
    models = [recipe.build(d, s, device) for d, s in zip(datas, seeds)]
    if stacked is None:
        stacked = torch.device(device).type == "cuda"
    if stacked and len(models) > 1 and seeds_refusal(defense, models[0]) is None:
        try:
            runs = train_seeds(models, datas, seeds=seeds, defense=defense, epochs=recipe.epochs,
                               batch_size=recipe.batch_size, lr=recipe.lr, device=device, loss=recipe.loss)
            return [(r["model"], TrainResult(**r)) for r in runs]
        except Exception:  # noqa: BLE001 (as utility_seeds: an operation vmap cannot map trains one by one)
            models = [recipe.build(d, s, device) for d, s in zip(datas, seeds)]
    return [(m, train_model(m, d, defense=defense, epochs=recipe.epochs, batch_size=recipe.batch_size, lr=recipe.lr,
                            seed=s, device=device, loss=recipe.loss)) for m, d, s in zip(models, datas, seeds)]


@dataclass
class ReferenceModels:
    """``count`` reference models: their seeds, IN masks over the pool (count × P) and φ on every pool point."""

    recipe: Recipe
    models: list[nn.Module]
    seeds: list[int]
    in_mask: torch.Tensor
    phi: torch.Tensor
    epsilon: float | None = None
    train_loss: list[float] = field(default_factory=list)
    cached: bool = False

    @property
    def count(self) -> int:
        return len(self.models)

    def outputs(self, indices: object = None, *, models: int | None = None) -> ReferenceOutputs:
        """:class:`ReferenceOutputs` on the pool points at ``indices`` (all by default), first ``models`` only."""
        k = self.count if models is None else int(models)
        if not 1 <= k <= self.count:
            raise ConfigError(f"expected 1 ≤ models ≤ {self.count}, got {models!r} (argument models)")
        idx = slice(None) if indices is None else torch.as_tensor(indices).long()
        return ReferenceOutputs(self.phi[:k, idx], self.in_mask[:k, idx])

    def outputs_on(self, images: torch.Tensor, labels: torch.Tensor, *, models: int | None = None) -> ReferenceOutputs:
        """:class:`ReferenceOutputs` on points outside the pool (OUT for every reference model)."""
        k = self.count if models is None else int(models)
        phi = torch.stack([target_confidence(m, images, labels) for m in self.models[:k]])
        return ReferenceOutputs(phi, torch.zeros_like(phi, dtype=torch.bool))


def _cache_path(cache_dir, config: dict) -> Path | None:
    if cache_dir is False:
        return None
    if cache_dir is None or cache_dir is True:
        base = os.environ.get("LEAKBENCH_CACHE")
        root = Path(base) / "reference" if base else Path.home() / ".cache" / "leakbench" / "reference"
    else:
        root = Path(cache_dir)
    key = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return root / f"{key}.pt"


def _load(path: Path) -> dict | None:
    """A cache file read as tensors and plain values only (no pickle); None when unreadable (then retrained)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 (a broken or foreign cache file is retrained and overwritten)
        return None
    return saved if isinstance(saved, dict) else None


def _save(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    torch.save(payload, tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file


@contextlib.contextmanager
def cache_lock(path: Path | None) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s ``.lock`` file (POSIX), so two workers needing the same models train
    them once: the second waits, then finds them cached.  No lock without ``fcntl`` or a path."""
    if path is None:
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX: both may train, os.replace keeps the files whole
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def train_reference_models(recipe: Recipe, pool: ImageDataset, *, count: int, seed: int = 0,
                           device: str | torch.device = "cpu", stacked: bool | None = None,
                           cache_dir: str | os.PathLike | bool | None = None) -> ReferenceModels:
    """Train ``count`` reference models with ``recipe``, each on its half of ``pool`` (module docstring)."""
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"expected a Recipe, got {type(recipe).__name__} (argument recipe)")
    if not isinstance(pool, ImageDataset):
        raise ConfigError(f"expected the pool as an ImageDataset, got {type(pool).__name__} (argument pool)")
    masks = half_masks(len(pool), count, seed=seed)
    seeds = [int(s) for s in np.random.SeedSequence([int(seed), 7]).generate_state(count) % (2 ** 31)]
    config = {"version": CACHE_VERSION, "recipe": recipe.key(), "pool": _fingerprint(pool), "count": count,
              "seed": int(seed)}
    path = _cache_path(cache_dir, config)
    with cache_lock(path):
        return _reference_models(recipe, pool, masks, seeds, config, path, device, stacked)


def _reference_models(recipe, pool, masks, seeds, config, path, device, stacked) -> ReferenceModels:
    if path is not None and path.is_file():
        saved = _load(path)
        if saved is not None and saved.get("config") == json.loads(json.dumps(config, default=str)):
            models = []
            for s, state in zip(saved["seeds"], saved["states"]):
                m = recipe.build(pool, s, device)
                m.load_state_dict(state)
                models.append(m)
            return ReferenceModels(recipe, models, list(saved["seeds"]), saved["in_mask"], saved["phi"],
                                   saved["epsilon"], list(saved["train_loss"]), cached=True)
    datas = [pool.subset(torch.nonzero(row).reshape(-1)) for row in masks]
    runs = _train(recipe, datas, seeds, device, stacked)
    images, labels = pool.images, pool.labels
    phi = torch.stack([target_confidence(m, images, labels) for m, _ in runs])
    refs = ReferenceModels(recipe, [m for m, _ in runs], seeds, masks, phi, runs[0][1].epsilon,
                           [r.train_loss for _, r in runs])
    if path is not None:
        _save(path, {"config": json.loads(json.dumps(config, default=str)), "seeds": seeds,
                     "states": [{k: v.detach().cpu() for k, v in m.state_dict().items()} for m in refs.models],
                     "in_mask": masks, "phi": phi, "epsilon": refs.epsilon, "train_loss": refs.train_loss})
    return refs


def target_mask(pool_size: int, seed: int) -> torch.Tensor:
    """The IN mask over a pool of the target trained with ``seed`` (:func:`target_on_half`): a seeded half."""
    return half_masks(pool_size, 1, seed=10_000 + int(seed))[0]


@dataclass
class TrainedTarget:
    """A membership target: the model, its IN mask over the pool, and its training run's numbers."""

    model: nn.Module
    in_mask: torch.Tensor
    train_loss: float
    train_accuracy: float
    epsilon: float | None
    steps: int
    cached: bool = False


def _named_cache(cache_dir, config: dict, prefix: str):
    """(the cache file ``<prefix>-<key>.pt`` for ``config`` or None, ``config`` as JSON reads it back)."""
    path = _cache_path(cache_dir, config)
    return (None if path is None else path.with_name(f"{prefix}-{path.name}"),
            json.loads(json.dumps(config, default=str)))


def _saved(path, canonical: dict) -> dict | None:
    """The cache file's contents when it exists and was written for ``canonical``, else None."""
    saved = _load(path) if path is not None and path.is_file() else None
    return saved if saved is not None and saved.get("config") == canonical else None


def cached_target(recipe: Recipe, pool: ImageDataset, *, seed: int, device: str | torch.device = "cpu",
                  cache_dir: str | os.PathLike | bool | None = None) -> TrainedTarget:
    """:func:`target_on_half`, cached on disk like the reference models (``target-<key>.pt``, tensors only)."""
    config = {"version": CACHE_VERSION, "target": recipe.key(), "pool": _fingerprint(pool), "seed": int(seed)}
    path, canonical = _named_cache(cache_dir, config, "target")
    with cache_lock(path):
        saved = _saved(path, canonical)
        if saved is not None:
            model = recipe.build(pool, seed, device)
            model.load_state_dict(saved["state"])
            return TrainedTarget(model, saved["mask"].bool(), float(saved["train_loss"]),
                                 float(saved["train_accuracy"]), saved["epsilon"], int(saved["steps"]), cached=True)
        model, mask, run = target_on_half(recipe, pool, seed=seed, device=device)
        target = TrainedTarget(model, mask, float(run.train_loss), float(run.train_accuracy),
                               None if run.epsilon is None else float(run.epsilon), int(run.steps))
        if path is not None:
            _save(path, {"config": canonical, "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                         "mask": mask, "train_loss": target.train_loss, "train_accuracy": target.train_accuracy,
                         "epsilon": target.epsilon, "steps": target.steps})
        return target


def canary_audit(recipe: Recipe, pool: ImageDataset, *, canaries: int, seed: int,
                 device: str | torch.device = "cpu", cache_dir: str | os.PathLike | bool | None = None) -> dict:
    """The one-run audit (Steinke, Nasr & Jagielski 2023) of ``recipe``: the target's training half of ``pool``
    plus each of ``canaries`` random-label noise images by a fair coin, trained once; the canaries are scored by
    −loss and :func:`~.audit.one_run_audit` bounds ε.  Returns (and caches, like the targets) the audit's numbers
    with the accountant's ε and δ of the run."""
    from ...attacks.membership.reference import loss_scores
    from ...defenses import DPSGD, parts_of
    from .audit import check_canaries, include_canaries, one_run_audit

    check_canaries(canaries)
    config = {"version": CACHE_VERSION, "canaries": int(canaries), "recipe": recipe.key(),
              "pool": _fingerprint(pool), "seed": int(seed)}
    path, canonical = _named_cache(cache_dir, config, "canaries")
    with cache_lock(path):
        saved = _saved(path, canonical)
        if saved is not None:
            return dict(saved["audit"])
        gen = torch.Generator().manual_seed(int(seed) + 31)
        images = torch.rand((canaries, *pool.shape), generator=gen, dtype=pool.images.dtype)
        labels = torch.randint(0, max(pool.num_classes, 2), (canaries,), generator=gen)
        included = torch.from_numpy(include_canaries(canaries, seed=seed))
        members = pool.subset(torch.nonzero(target_mask(len(pool), seed)).reshape(-1))
        train = ImageDataset(images=torch.cat([members.images.cpu(), images[included]]),
                             labels=torch.cat([members.labels.cpu(), labels[included].to(members.labels.dtype)]),
                             classes=members.classes, name=members.name)
        model = recipe.build(train, seed, device)
        run = train_model(model, train, defense=recipe.defense, epochs=recipe.epochs, batch_size=recipe.batch_size,
                          lr=recipe.lr, seed=seed, device=device, loss=recipe.loss)
        dp = next((p for p in parts_of(parse(recipe.defense)) if isinstance(p, DPSGD)), None)
        delta = float(dp.delta) if dp is not None else 0.0
        audit = one_run_audit(loss_scores(target_confidence(model, images, labels)), included, delta=delta,
                              claimed=run.epsilon)
        out = {"epsilon": float(audit.epsilon), "canaries": int(audit.canaries), "guesses": int(
            audit.guesses_in + audit.guesses_out), "correct": int(audit.correct), "delta": delta,
            "confidence": float(audit.confidence), "claimed": None if run.epsilon is None else float(run.epsilon)}
        if path is not None:
            _save(path, {"config": canonical, "audit": out})
        return out


def target_on_half(recipe: Recipe, pool: ImageDataset, *, seed: int, device: str | torch.device = "cpu",
                   ) -> tuple[nn.Module, torch.Tensor, TrainResult]:
    """A target trained with ``recipe`` on a seeded half of ``pool``: (model, its IN mask over the pool, run)."""
    mask = target_mask(len(pool), seed)
    data = pool.subset(torch.nonzero(mask).reshape(-1))
    model = recipe.build(data, seed, device)
    run = train_model(model, data, defense=recipe.defense, epochs=recipe.epochs, batch_size=recipe.batch_size,
                      lr=recipe.lr, seed=seed, device=device, loss=recipe.loss)
    return model, mask, run


def run_membership_attacks(target: nn.Module, pool: ImageDataset, references: ReferenceModels,
                           attacks: dict[str, tuple[str, dict]], *, models: int | None = None,
                           queries: object = None) -> dict[str, np.ndarray]:
    """Scores per pool point (or the points at ``queries``) of each named attack: ``attacks`` maps a row label
    to (registered name, options); RMIA's population z is the whole pool."""
    obs = observe_weights(target, input_shape=tuple(pool.shape), num_classes=pool.num_classes)
    idx = torch.arange(len(pool)) if queries is None else torch.as_tensor(queries).long()
    x, y = pool.images[idx], pool.labels[idx]
    ref = references.outputs(idx, models=models)
    pop = references.outputs(None, models=models)
    out = {}
    for label, (name, options) in attacks.items():
        attack = MEMBERSHIP_ATTACKS.create(name, **dict(options))
        result = attack(obs, x, labels=y, reference=ref, population=pool.images, population_labels=pool.labels,
                        population_reference=pop)
        out[label] = result.scores.numpy()
    return out


@dataclass
class MembershipRow:
    """One attack's membership numbers: AUC with its interval, TPR at each FPR (None: not measurable)."""

    attack: str
    auc: Interval
    tpr: dict[float, float | None]
    members: int
    nonmembers: int
    unscored: int = 0

    def tpr_text(self, fpr: float) -> str:
        v = self.tpr.get(fpr)
        return f"{v:.3f}" if v is not None else f"not measurable at n = {self.nonmembers}"


def membership_rows(scores: dict[str, object], is_member: object, *,
                    fprs: tuple[float, ...] = (0.01, 0.001)) -> list[MembershipRow]:
    """:class:`MembershipRow` per attack.  Unscored points (NaN: e.g. no OUT reference model) rank lowest —
    never called members — and are counted.  TPR at an FPR is reported only with ≥ 10/FPR non-members."""
    from ...metrics.membership import tpr_at_fpr

    m = np.asarray(is_member.numpy() if isinstance(is_member, torch.Tensor) else is_member).astype(bool).ravel()
    rows = []
    for name, s in scores.items():
        s = np.asarray(s, dtype=np.float64).ravel()
        bad = ~np.isfinite(s)
        if bad.any():
            floor = float(s[~bad].min()) - 1.0 if (~bad).any() else 0.0
            s = np.where(bad, floor, s)
        nonmembers = int((~m).sum())
        tpr = {f: (tpr_at_fpr(s, m, f) if f > 0 and measurable_fpr(f, nonmembers) else None) for f in fprs}
        rows.append(MembershipRow(name, auc_interval(s, m), tpr, int(m.sum()), nonmembers, int(bad.sum())))
    return rows
