"""The attack contract: :class:`Attack`, :class:`Reconstruction`, the registry and :func:`attack`.

Every attack declares its options as a dataclass (``Options``) with named
presets (the paper's settings, ``quick`` for tests, ...), says in
:meth:`Attack.requirements` why it cannot run on an observation before any work
is done, and returns a :class:`Reconstruction`.
"""
from __future__ import annotations

import abc
import dataclasses
import math
import time
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar
from collections.abc import Callable

import torch

from ..coerce import coerce
from ..errors import ConfigError, LeakbenchError, UnsupportedThreatModel
from ..registry import Registry
from ..threat import Observation

#: ``callback(step, images)`` is called during optimisation (every ``trace_every`` steps).
Callback = Callable[[int, torch.Tensor], None]
#: ``progress(done, total, loss)`` reports advancement of long work.
Progress = Callable[[int, int, float], None]


@dataclass
class Reconstruction:
    """What an attack rebuilt: images, labels when recovered, per-sample confidence, and a trace."""

    images: torch.Tensor
    labels: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    trace: dict[str, Any] = field(default_factory=dict)
    attack: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.images.shape[0])


ATTACKS: Registry[Attack] = Registry("attack")

#: the threat-model tags an attack declares (``Attack.tags``), in the terms of the gradient-inversion SoKs: what the
#: attacker must see or control for the attack to run as leakbench runs it
THREAT_TAGS: dict[str, str] = {
    "gradient": "the shared gradient of one client step (FedSGD)",
    "update": "also a FedAvg update after several local steps",
    "weights": "the trained model's weights (no client round)",
    "queries": "query access to the trained model's outputs",
    "labels": "the batch's labels: used when the threat model grants them, otherwise recovered from what is shared",
    "bn-stats": "the batch-norm statistics of the client's batch",
    "modified-model": "a malicious server's modified model (an imprint block, trap weights, a fishing or random-feature head)",
    "rounds": "observations over several rounds",
    "adaptive": "knows the defense named in the observation and attacks around it (an adaptive attack: S_D against "
                "it is the defense's measure, Carletti et al. 2025)",
}


class Attack(abc.ABC):
    """Base class of every attack.  Subclasses set ``name``, ``Options``, ``presets`` and ``run``."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = object
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: a preset whose values changed after it first shipped counts its revisions here (2 = changed once);
    #: a sweep trial's key carries the revision, so a resumed store never mixes results of old and new values
    preset_revisions: ClassVar[dict[str, int]] = {}
    #: True for gradient matching (an optimisation that applies to every differentiable model): an evaluation
    #: whose attack set on a model holds none of these reports its S_D as a lower bound on leakage
    matching: ClassVar[bool] = False
    #: what the attack reconstructs: "image" (pixels) or "text" (token ids); a sweep pairs it with datasets of
    #: that modality only (the other pairs are "n/a" with the reason)
    modality: ClassVar[str] = "image"
    #: what the attack needs from the threat model, from :data:`THREAT_TAGS` (``leakbench list attacks`` shows
    #: them; the report groups attacks by them)
    tags: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, preset: str | None = None, **options: Any) -> None:
        fields = {f.name: f for f in dataclasses.fields(self.Options)}
        hints = typing.get_type_hints(self.Options)
        chosen = preset or "default"
        if chosen != "default" and chosen not in self.presets:
            raise ConfigError(f"unknown preset {chosen!r} for attack {self.name!r}; "
                              f"known presets: {', '.join(['default', *sorted(self.presets)])}")
        merged = dict(self.presets.get(chosen, {}))
        for key, value in options.items():
            if key not in fields:
                raise ConfigError(f"unknown option {key!r} for attack {self.name!r}; "
                                  f"known options: {', '.join(sorted(fields))}")
            merged[key] = coerce(value, hints.get(key, Any), name=key, owner=f"attack {self.name!r}")
            _refuse_non_finite(self.name, key, merged[key], fields[key].default)
        self.preset = chosen
        self.options = self.Options(**merged)
        self.validate()

    def validate(self) -> None:
        """Check option values (raise :class:`ConfigError`); the default runs the options' own ``check()``
        when they have one, and otherwise accepts all."""
        check = getattr(self.options, "check", None)
        if callable(check):
            check()

    def requirements(self, obs: Observation) -> list[str]:
        """Reasons this attack cannot run on ``obs`` (empty when it can)."""
        return []

    @abc.abstractmethod
    def run(self, obs: Observation, *, seed: int = 0, callback: Callback | None = None,
            progress: Progress | None = None) -> Reconstruction:
        """Rebuild the batch behind ``obs`` (requirements already checked)."""

    def run_batch(self, observations: list[Observation], seeds: list[int], *,
                  progress: Progress | None = None) -> list[Reconstruction | Exception]:
        """Rebuild several batches (requirements already checked), each result or error its own.  The default
        runs them one after the other; attacks that can solve independent problems together override it."""
        out: list[Reconstruction | Exception] = []
        for obs, seed in zip(observations, seeds):
            try:
                out.append(self.run(obs, seed=seed, progress=progress))
            except Exception as err:  # noqa: BLE001 (one problem's failure is its own)
                out.append(err)
        return out

    def __call__(self, obs: Observation, *, seed: int = 0, callback: Callback | None = None,
                 progress: Progress | None = None) -> Reconstruction:
        reasons = self.requirements(obs)
        if reasons:
            raise UnsupportedThreatModel(f"attack {self.name!r} cannot run on this observation: "
                                         + "; ".join(reasons))
        start = time.perf_counter()
        rec = self.run(obs, seed=seed, callback=callback, progress=progress)
        check_reconstruction(rec, self.name)
        rec.trace.setdefault("seconds", time.perf_counter() - start)
        rec.attack = self.name
        rec.options = {"preset": self.preset, **dataclasses.asdict(self.options)}
        return rec


def _refuse_non_finite(attack: str, key: str, value: Any, default: Any) -> None:
    """A float option whose default is a finite number takes finite numbers only: NaN or inf there (``lr: inf``)
    makes every run diverge, so it is refused where the attack is made (and so by ``evaluate --dry-run``)."""
    finite_default = isinstance(default, (int, float)) and not isinstance(default, bool) and math.isfinite(default)
    if (finite_default and isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"expected a finite number, got {value!r} (option {key} of attack {attack!r})")


def _diverged(trace: dict[str, Any]) -> bool:
    """An optimisation whose loss curve ends on NaN/inf: what it returns is not a reconstruction."""
    curve = trace.get("loss") if isinstance(trace, dict) else None
    if not isinstance(curve, (list, tuple)) or not curve:
        return False
    last = curve[-1]
    return isinstance(last, (int, float)) and not math.isfinite(float(last))


class NonFiniteReconstruction(LeakbenchError, ValueError):
    """An attack's result holds NaN/inf: the observation gave it nothing to solve (a zero or degenerate gradient)."""


def check_reconstruction(rec: Reconstruction, name: str) -> None:
    """Refuse a reconstruction whose images or confidence hold NaN/inf, or whose images are not a batch tensor."""
    if not isinstance(rec.images, torch.Tensor) or rec.images.dim() < 2:
        raise NonFiniteReconstruction(f"attack {name!r} returned no image batch (got "
                                      f"{type(rec.images).__name__}); it cannot run on this observation")
    if _diverged(rec.trace):
        raise NonFiniteReconstruction(
            f"attack {name!r} diverged: its optimisation ended on a NaN/inf loss ({rec.trace['loss'][-1]!r}), so "
            "what it returned is no reconstruction; lower its lr or check the observation")
    for field_name, t in (("images", rec.images), ("confidence", rec.confidence)):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                raise NonFiniteReconstruction(
                    f"attack {name!r} returned {int(bad.sum())} NaN/inf value(s) in its reconstruction ({field_name}):"
                    " the observation gives it nothing to solve (e.g. a zero or degenerate gradient); check the "
                    "observation, or use another attack")


def register(cls: type[Attack]) -> type[Attack]:
    """Class decorator: add an :class:`Attack` subclass to :data:`ATTACKS` under ``cls.name``."""
    doc = (cls.__doc__ or "").strip().splitlines()
    check_tags(cls.name, cls.tags)
    ATTACKS.register(cls.name, cls, help=doc[0] if doc else "")
    return cls


def check_tags(name: str, tags: Any) -> None:
    """Refuse threat tags outside :data:`THREAT_TAGS` (one line naming the attack and the field)."""
    if isinstance(tags, str) or not isinstance(tags, (tuple, list)):
        raise ConfigError(f"expected tags a tuple of threat tags, got {type(tags).__name__} "
                          f"(field tags of attack {name!r})")
    unknown = [t for t in tags if t not in THREAT_TAGS]
    if unknown:
        raise ConfigError(f"expected threat tags among {', '.join(THREAT_TAGS)}, got {unknown[0]!r} "
                          f"(field tags of attack {name!r})")


def attack_tags(name: str) -> tuple[str, ...]:
    """The threat tags of registered attack ``name`` (empty for an attack that declares none, e.g. a plug-in's)."""
    return tuple(getattr(ATTACKS.get(name), "tags", ()) or ()) if name in ATTACKS else ()


def create(name: str, *, preset: str | None = None, **options: Any) -> Attack:
    """Instantiate the attack ``name`` with a preset and option overrides."""
    return ATTACKS.get(name)(preset=preset, **options)


def preset_revision(name: str, preset: str | None) -> int:
    """The revision of attack ``name``'s ``preset`` (``None`` is ``default``): 0 while never changed, and for
    attacks without presets (``membership-margin``, which lives in its own registry)."""
    if name not in ATTACKS:
        return 0
    return int(ATTACKS.get(name).preset_revisions.get(preset or "default", 0))


def attack(name: str, observation: Observation, *, preset: str | None = None, seed: int = 0,
           callback: Callback | None = None, progress: Progress | bool | None = None,
           **options: Any) -> Reconstruction:
    """Run attack ``name`` on ``observation``: ``lb.attack("inverting-gradients", obs, iterations=2000)``."""
    if not isinstance(observation, Observation):
        raise ConfigError(f"expected an Observation (from leakbench.observe), got {type(observation).__name__}")
    runner = create(name, preset=preset, **options)
    if progress is True:
        from ..progress import rich_progress

        with rich_progress(f"{name}") as report:
            return runner(observation, seed=seed, callback=callback, progress=report)
    return runner(observation, seed=seed, callback=callback, progress=progress or None)
