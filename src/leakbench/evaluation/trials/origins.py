"""Which plug-ins a trial uses: the modules behind its attack, defense parts, dataset, model family, loss and the
plug-in metrics that score it, each with its source digest (:mod:`leakbench.plugins`).

:func:`stamp` writes them into the trial's ``plugins`` field, which is part of its key: an edited plug-in is a
new trial (never mixed with old results), and every process imports them before running the trial.  Trials
of leakbench's own components carry none and keep the keys they always had.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from ... import plugins
from ...attacks import ATTACKS
from ...attacks.membership import MEMBERSHIP_ATTACKS
from ...data import DATASETS
from ...defenses import DEFENSES, parse, parts_of
from ...errors import ConfigError
from ...losses import LOSSES
from ...metrics import METRICS
from ...models import MODELS
from ...models.custom import is_class_spec
from .trial import TrialSpec

__all__ = ["component_origins", "used_plugins", "stamp"]


def _model_family(spec: str) -> str | None:
    if not isinstance(spec, str) or is_class_spec(spec, MODELS.names()):
        return None  # a class by import path carries its own source digest
    from ...models.spec import parse_spec

    try:
        return parse_spec(spec)[0]
    except ConfigError:
        return None


def component_origins(trial: TrialSpec) -> Iterator[str]:
    """The modules that registered the components ``trial`` names (leakbench's own included)."""
    for registry in (ATTACKS, MEMBERSHIP_ATTACKS):
        if trial.attack and trial.attack in registry:
            yield registry.origin(trial.attack)
    try:
        for part in parts_of(parse(trial.defense)):
            if part.name in DEFENSES:
                yield DEFENSES.origin(part.name)
    except ConfigError:
        pass
    target_data = (trial.target or {}).get("dataset") or {}
    for name in (trial.dataset, target_data.get("name")):
        if name and name in DATASETS:
            yield DATASETS.origin(name)
    family = _model_family(trial.model)
    if family is not None and family in MODELS:
        yield MODELS.origin(family)
    loss = (trial.threat or {}).get("loss")
    if isinstance(loss, str) and loss in LOSSES:
        yield LOSSES.origin(loss)
    if trial.kind == "attack":  # every registered metric scores it
        yield from (METRICS.origin(name) for name in METRICS.names())


def used_plugins(trial: TrialSpec) -> dict[str, str]:
    """``{plug-in: source digest}`` of the plug-ins whose components ``trial`` uses (sorted by name)."""
    units = {plugins.unit_of(m) for m in component_origins(trial) if m and not plugins.is_builtin(m)}
    return {unit: plugins.digest(unit) for unit in sorted(units)}


def stamp(trial: TrialSpec) -> TrialSpec:
    """``trial`` with its ``plugins`` field filled (itself when it uses none)."""
    used = used_plugins(trial)
    return dataclasses.replace(trial, plugins=used) if used != dict(trial.plugins or {}) else trial
