"""The audit core (flwr-free): a client's update → a leakbench observation → the named attacks → scores.

One update θ_after − θ_before of a client that ran local SGD (:class:`~.keys.LocalTraining`) becomes
an ``update`` observation through :func:`leakbench.captured.from_update`; each attack named as in the
CLI and sweep specs (registry name, ``preset``, ``options``, ``threat: {labels_known: true}``, ``label``)
runs on it as :func:`leakbench.evaluation.trial.run_attack` runs it in a sweep trial.  With the client's
real batch (simulation, or the client auditing itself) the reconstruction is scored after Hungarian
matching (:func:`leakbench.compare`, Liu et al. 2024 eq. (1)) beside the chance control of a trial: a
flat image at the population's mean pixel.  Without it (deployment) it is kept unscored with the attack's
own confidence and final matching loss.
"""
from __future__ import annotations

import dataclasses
import math
import time
import traceback as tb
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ...errors import ConfigError, UnsupportedThreatModel
from .keys import LocalTraining

#: the fields of a sweep spec's per-attack ``threat`` a captured update can grant.
THREAT_FIELDS = ("labels_known",)


@dataclass(frozen=True)
class AttackChoice:
    """One attack as the CLI and sweep specs name it."""

    name: str
    preset: str | None = None
    options: dict = field(default_factory=dict)
    labels_known: bool = False
    label: str | None = None

    @property
    def key(self) -> str:
        return self.label or self.name


def attack_choices(attacks: str | Mapping | Iterable[str | Mapping]) -> list[AttackChoice]:
    """Attacks from names or sweep-spec entries (``{name, preset, options, threat, label}``), checked now.

    An unknown name, preset or option raises the registry's :class:`ConfigError` listing the known ones.
    """
    from pydantic import ValidationError

    from ...attacks import create
    from ...evaluation.spec import AttackEntry

    items = [attacks] if isinstance(attacks, (str, Mapping)) else list(attacks or [])
    if not items:
        raise ConfigError("expected at least one attack, e.g. attacks=['inverting-gradients'] (argument attacks)")
    out: list[AttackChoice] = []
    for i, item in enumerate(items):
        try:
            entry = AttackEntry.model_validate(item)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ConfigError(f"attacks[{i}]{'.' + where if where else ''}: {first.get('msg')}; expected a name or "
                              "{name, preset, options, threat, label}") from None
        unknown = sorted(set(entry.threat) - set(THREAT_FIELDS))
        if unknown:
            raise ConfigError(f"attacks[{i}].threat: a captured update can grant {list(THREAT_FIELDS)}, got "
                              f"{unknown} (BN statistics and server moves are not part of a client's update)")
        create(entry.name, preset=entry.preset, **entry.options)
        out.append(AttackChoice(entry.name, entry.preset, dict(entry.options),
                                bool(entry.threat.get("labels_known", False)), entry.label))
    keys = [c.key for c in out]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"expected distinct attacks, got {keys}; give repeated names a label (field label)")
    return out


@dataclass
class Audited:
    """One attack on one update: ``status`` done / n/a / failed; ``scored`` when the real batch was known."""

    attack: str
    name: str
    status: str
    scored: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    per_sample: dict[str, list] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    traceback: str | None = None
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def chance(x: torch.Tensor, mean: float | None = None) -> dict[str, float]:
    """The chance control of a trial: a flat image at ``mean`` (default: ``x``'s mean pixel) scored against ``x``."""
    grey = float(x.double().mean()) if mean is None else float(mean)
    mse = float((x.double() - grey).pow(2).mean())
    return {"chance_rmse": math.sqrt(mse), "chance_psnr": 10 * math.log10(1.0 / mse) if mse > 0 else math.inf}


def best(outcomes: Sequence[Audited]) -> dict[str, float]:
    """The best scores over the done, scored attacks: lowest RMSE, highest PSNR (NaN when none scored)."""
    done = [o for o in outcomes if o.status == "done" and o.scored]
    rmse = [o.metrics["rmse"] for o in done if isinstance(o.metrics.get("rmse"), (int, float))]
    psnr = [o.metrics["psnr"] for o in done if isinstance(o.metrics.get("psnr"), (int, float))]
    return {"rmse": min(rmse) if rmse else math.nan, "psnr": max(psnr) if psnr else math.nan}


class Auditor:
    """Runs the named attacks on captured updates: ``Auditor(["fc-inversion"]).audit(obs, x, y)``.

    ``loss``, ``normalize``, ``input_shape`` and ``train`` are the threat-model arguments of
    :func:`leakbench.captured.from_update`; ``seed`` seeds every attack.
    """

    def __init__(self, attacks: str | Mapping | Iterable[str | Mapping], *, seed: int = 0, device: str = "cpu",
                 loss: str = "ce", normalize: tuple | None = None, input_shape: Sequence[int] | None = None,
                 train: bool = False, save_images: bool = True) -> None:
        self.choices = attack_choices(attacks)
        self.seed, self.device, self.loss = int(seed), torch.device(device), loss
        self.normalize, self.train, self.save_images = normalize, bool(train), bool(save_images)
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)

    def observe(self, model_before: nn.Module, model_after: nn.Module, training: LocalTraining, *,
                labels: torch.Tensor | None = None, defense: str = "none"):
        """The ``update`` observation of ``model_after − model_before`` (:func:`leakbench.captured.from_update`)."""
        from ...captured import from_update

        return from_update(model_before.to(self.device), model_after.to(self.device), **training.options(),
                           labels=labels, loss=self.loss, input_shape=self.input_shape, normalize=self.normalize,
                           train=self.train, defense=defense)

    def audit(self, model_before: nn.Module, model_after: nn.Module, training: LocalTraining, *,
              x: torch.Tensor | None = None, y: torch.Tensor | None = None, defense: str = "none",
              chance_mean: float | None = None) -> list[Audited]:
        """Every attack on the update; scored against ``(x, y)`` when given (the batch behind the update)."""
        if x is not None:
            if y is None or x.shape[0] != training.batch_size or y.shape[0] != x.shape[0]:
                raise ConfigError(f"expected the client's batch of {training.batch_size} samples (x, y) behind the "
                                  f"update, got x of {None if x is None else tuple(x.shape)} and y of "
                                  f"{None if y is None else tuple(y.shape)} (check the partition given to the "
                                  "auditor and the num-examples the client reported)")
        plain = self.observe(model_before, model_after, training, defense=defense)
        labelled = None
        out = []
        for choice in self.choices:
            obs = plain
            if choice.labels_known:
                if y is None:
                    out.append(Audited(choice.key, choice.name, "n/a", False,
                                       error="labels_known needs the client's labels: give the auditor the partitions"))
                    continue
                if labelled is None:
                    labelled = self.observe(model_before, model_after, training, labels=y, defense=defense)
                obs = labelled
            out.append(self._run(choice, obs, x, y, chance_mean))
        return out

    def _run(self, choice: AttackChoice, obs, x, y, chance_mean) -> Audited:
        from ...attacks import create
        from ...evaluation.trial import non_finite

        start = time.perf_counter()
        attack = create(choice.name, preset=choice.preset, **choice.options)
        reasons = attack.requirements(obs)
        if reasons:
            return Audited(choice.key, choice.name, "n/a", x is not None, error="; ".join(reasons))
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                rec = attack(obs, seed=self.seed)
            result = self._score(choice, rec, x, y, chance_mean)
        except UnsupportedThreatModel as err:
            return Audited(choice.key, choice.name, "n/a", x is not None, error=str(err))
        except Exception as err:  # recorded beside the round, the federated run goes on
            return Audited(choice.key, choice.name, "failed", x is not None, error=f"{type(err).__name__}: {err}",
                           traceback=tb.format_exc(), seconds=time.perf_counter() - start)
        result.seconds = time.perf_counter() - start
        bad = non_finite(result.metrics)
        if bad:
            result.status, result.error = "failed", f"non-finite result: {', '.join(bad)}"
        return result

    def _score(self, choice: AttackChoice, rec, x, y, chance_mean) -> Audited:
        from ...metrics import compare

        images = rec.images.detach().to("cpu", torch.float32)
        labels = None if rec.labels is None else rec.labels.detach().cpu()
        if labels is not None and labels.ndim == 2:
            labels = labels.argmax(dim=1)
        confidence = None if rec.confidence is None else rec.confidence.detach().cpu()
        loss = rec.trace.get("loss")
        final_loss = float(loss[-1]) if isinstance(loss, (list, tuple)) and loss else None
        if x is None:  # deployment: the attack's own word only
            metrics: dict[str, Any] = {"images": int(images.shape[0]), "final_loss": final_loss}
            if confidence is not None and confidence.numel():
                metrics.update(confidence_mean=float(confidence.double().mean()),
                               confidence_max=float(confidence.double().max()))
            arrays = {"reconstruction": images.numpy()} if self.save_images else {}
            return Audited(choice.key, choice.name, "done", False, metrics=metrics, arrays=arrays)
        x, y = x.detach().cpu(), y.detach().cpu()
        scores = compare(dataclasses.replace(rec, images=images, labels=labels, confidence=confidence), x, y)
        per_sample = scores.pop("per_sample")
        order = scores.pop("order")
        metrics = {k: v for k, v in scores.items() if v is None or isinstance(v, (int, float))}
        metrics["matching"] = str(scores.get("matching", "total-mse"))
        metrics["final_loss"] = final_loss
        metrics.update(chance(x, chance_mean))
        arrays = {}
        if self.save_images:
            arrays = {"x": x.float().numpy(), "y": y.numpy(), "reconstruction": images.numpy(),
                      "order": np.asarray(order, dtype=np.int64)}
        return Audited(choice.key, choice.name, "done", True, metrics=metrics, per_sample=per_sample, arrays=arrays)


__all__ = ["AttackChoice", "Audited", "Auditor", "attack_choices", "best", "chance", "THREAT_FIELDS"]
