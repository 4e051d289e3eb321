"""Every name of a sweep spec resolved through the registries, before any trial runs (used by :mod:`.spec`).

Datasets and their loader options, models, the server's moves and their options, attacks with presets
and options (gradient, published-weights and membership attacks), defenses and their grids, losses,
per-attack threat overrides, devices, include/exclude rules, and the published targets' options.  A
problem is one :class:`~leakbench.errors.ConfigError` naming the spec line and field.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

from ...defenses import family_of
from ...errors import ConfigError, LeakbenchError
from .check import RULE_KEYS, SERVER_SET_BY_TRIAL
from .source import Source

__all__ = ["check_names", "server_options", "attack_culprit", "check_rule", "rule_values"]


def check_names(spec, where: Source | None = None) -> None:
    """Resolve every name of ``spec`` (a validated :class:`~.model.SweepSpec`) through the registries, in one pass.

    The spec is checked entry by entry (each dataset, model, target, attack, defense, rule...): an entry stops at
    its first problem, the next entry is checked all the same, and every problem found is reported in the one
    :class:`ConfigError` line, first problem first: ``"<first> (and 2 more: <second>; <third>)"``.  The checks
    that read several entries together (duplicate labels, data/model pairing) run once the entries are sound.
    """
    where = where or Source("spec", {})
    problems: list[str] = []

    @contextlib.contextmanager
    def entry():
        try:
            yield
        except ConfigError as err:
            problems.append(str(err))
        except (LeakbenchError, ValueError, TypeError):
            if not problems:  # not a consequence of a problem already found: as before, it surfaces
                raise

    def guard(path: tuple, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (LeakbenchError, ValueError, TypeError) as err:
            raise ConfigError(f"{where.where(path)}: {err}") from None

    for unit in _units(spec, where, guard):
        with entry():
            unit()
    if not problems:
        for unit in _together(spec, where):
            with entry():
                unit()
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:MAX_LISTED + 1])}" if len(problems) > 1 else ""
        if len(problems) > MAX_LISTED + 1:
            more += f"; {len(problems) - MAX_LISTED - 1} more not listed"
        raise ConfigError(problems[0] + (more + ")" if more else ""))


#: problems listed after the first in the one error line; the rest are counted.
MAX_LISTED = 5


def _units(spec, where: Source, guard):
    """The checks of one entry each, in the order of the spec's sections."""
    from ...attacks import ATTACKS, create as create_attack
    from ...data import DATASETS, options as data_options
    from ...defenses import parse as parse_defense
    from ...losses import LOSSES
    from ...models import parse_spec

    def dataset(i, d):
        guard(("datasets", i, "name"), DATASETS.get, d.name)
        accepted = data_options(d.name)
        for key in d.options:
            if key not in accepted:
                raise ConfigError(f"{where.where(('datasets', i, 'options', key))}: unknown option {key!r} for "
                                  f"dataset {d.name!r}; accepted options: {', '.join(accepted)}")

    def model(i, m):
        guard(("models", i, "spec"), parse_spec, m.spec)
        if m.server is not None:
            name, options = m.server.move
            accepted = server_options(name)
            for key in options:
                if key not in accepted:
                    raise ConfigError(f"{where.where(('models', i, 'server', name, key))}: unknown option {key!r} "
                                      f"for the server move {name!r}; accepted options: {', '.join(accepted)}")

    def published(section, i, entry):
        if section == "membership" and entry.reference:
            _check_reference(spec, entry, ("membership", i), where, guard)
            return
        if section == "membership" and entry.run is not None:
            _check_run(spec, entry, ("membership", i), where, guard)
            return
        if entry.run is not None:  # published weights: a run's rounds instead of a target the library trains
            _check_run_source(spec, entry, (section, i), where)
        else:
            _check_target(entry.target, (section, i, "target"), where, guard)
        attacks = entry.attack_list if section == "membership" else entry.attacks
        for j, a in enumerate(attacks):
            path = (section, i, "attacks", j)
            if section == "membership":
                from ...attacks.membership import MEMBERSHIP_ATTACKS

                guard(path + ("name",), MEMBERSHIP_ATTACKS.get, a.name)
                if a.name != "membership-margin":
                    raise ConfigError(f"{where.where(path + ('name',))}: {a.name!r} needs reference models: "
                                      "give the membership entry model: and dataset: (and reference_models:) "
                                      "instead of target:, which runs the margin attack on a two-layer net "
                                      "(docs/membership.md)")
                guard(path + ("options",), MEMBERSHIP_ATTACKS.create, a.name, **a.options)
            else:
                guard(path + ("name",), ATTACKS.get, a.name)
                guard(path, create_attack, a.name, preset=a.preset, **a.options)

    def attack(i, a):
        path = ("attacks", i)
        guard(path + ("name",), ATTACKS.get, a.name)
        try:
            create_attack(a.name, preset=a.preset, **a.options)
        except (LeakbenchError, ValueError, TypeError) as err:
            raise ConfigError(f"{where.where(path + attack_culprit(a))}: {err}") from None
        guard(path + ("threat",), lambda: type(spec.threat)(**{**spec.threat.model_dump(), **a.threat}))

    def defense(i, d):
        specs = guard(("defenses", i), d.expand)
        if not specs:
            raise ConfigError(f"{where.where(('defenses', i))}: the grid {dict(d.grid)} gives no defense setting; "
                              "list at least one value or remove the entry")
        for text in specs:
            guard(("defenses", i), parse_defense, text)

    def rule(kind, i, r):
        for key in r:
            if key not in RULE_KEYS:
                raise ConfigError(f"{where.where((kind, i, key))}: unknown rule key {key!r}; "
                                  f"a rule may name: {', '.join(RULE_KEYS)}")
        check_rule(spec, r, kind, i, where)

    def training():
        path = ("utility",) if spec.utility is not None else ("models",)
        guard(path, _needs_utility)

    yield from (functools.partial(dataset, i, d) for i, d in enumerate(spec.datasets))
    yield from (functools.partial(model, i, m) for i, m in enumerate(spec.models))
    for section in ("weights", "membership"):
        yield from (functools.partial(published, section, i, e) for i, e in enumerate(getattr(spec, section)))
    yield from (functools.partial(attack, i, a) for i, a in enumerate(spec.attacks))
    yield from (functools.partial(defense, i, d) for i, d in enumerate(spec.defenses))
    yield lambda: guard(("threat", "loss"), LOSSES.get, spec.threat.loss)
    yield lambda: guard(("device",), _check_device, spec.device)
    for kind in ("include", "exclude"):
        yield from (functools.partial(rule, kind, i, r) for i, r in enumerate(getattr(spec, kind)))
    if spec.utility is not None or any(m.training.epochs for m in spec.models):
        yield training
    if spec.bounds is not None and spec.bounds.cramer_rao:
        yield lambda: guard(("bounds", "cramer_rao"), _needs_bounds)


def _together(spec, where: Source):
    """The checks that read several entries at once: attack labels are distinct; every dataset pairs with every
    model (images with image models, text with text models)."""
    def labels():
        keys = [a.key for a in spec.attacks]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        if dup is not None:
            i = len(keys) - 1 - keys[::-1].index(dup)
            raise ConfigError(f"{where.where(('attacks', i))}: attack {dup!r} is listed twice; "
                              "give one of them a distinct label (label: ...)")

    def modalities():
        from .modality import check_modalities

        check_modalities(spec, where)

    yield modalities
    yield labels


def _check_run(spec, entry, path: tuple, where: Source, guard) -> None:
    """A membership entry on a federated run's rounds: the run it names, its rounds and client, and attacks that
    need no reference models."""
    from ...attacks.membership import MEMBERSHIP_ATTACKS
    from .weights import RUN_ATTACKS

    _check_run_source(spec, entry, path, where)
    free = {a["name"] for a in RUN_ATTACKS}
    labels = []
    for j, a in enumerate(entry.attack_list):
        guard(path + ("attacks", j, "name"), MEMBERSHIP_ATTACKS.get, a.name)
        if a.name not in free:
            raise ConfigError(f"{where.where(path + ('attacks', j, 'name'))}: {a.name!r} needs reference models, "
                              f"which a run's rounds do not have; use {', '.join(sorted(free))} here, or the "
                              "model:/dataset: form for LiRA and RMIA (docs/membership.md)")
        guard(path + ("attacks", j, "options"), MEMBERSHIP_ATTACKS.create, a.name, **a.options)
        if a.key in labels:
            raise ConfigError(f"{where.where(path + ('attacks', j))}: attack {a.key!r} is listed twice; give one "
                              "of them a distinct label (label: ...)")
        labels.append(a.key)


def _check_run_source(spec, entry, path: tuple, where: Source) -> None:
    """The run a ``weights`` or ``membership`` entry names (a federated model entry), its rounds and its client."""
    model = spec.run_model(entry.run)
    if model is None:
        runs = [m.key for m in spec.models if m.federated is not None]
        raise ConfigError(f"{where.where(path + ('run',))}: {entry.run!r} names no model entry with a federated: "
                          f"section; " + (f"federated models: {', '.join(map(repr, runs))}" if runs else
                                          "add federated: to a models: entry (docs/evaluation.md)"))
    fed = model.federated
    missing = [r for r in entry.rounds or () if r not in fed.rounds]
    if missing:
        raise ConfigError(f"{where.where(path + ('rounds',))}: round {missing[0]} is not attacked in run "
                          f"{entry.run!r}; its rounds: {', '.join(map(str, fed.rounds))} (add it to its "
                          "federated.rounds, so both attacks see the same checkpoints)")
    if entry.client is not None and entry.client >= fed.clients:
        raise ConfigError(f"{where.where(path + ('client',))}: run {entry.run!r} has {fed.clients} clients "
                          f"(0..{fed.clients - 1}), got client {entry.client}")


def _check_reference(spec, entry, path: tuple, where: Source, guard) -> None:
    """A reference-model membership entry: its dataset and options, model, recipe loss, defenses and attacks."""
    from ...attacks.membership import MEMBERSHIP_ATTACKS
    from ...data import DATASETS, options as data_options
    from ...defenses import parse as parse_defense
    from ...losses import LOSSES
    from ...models import parse_spec

    guard(path + ("dataset", "name"), DATASETS.get, entry.dataset.name)
    accepted = data_options(entry.dataset.name)
    for key in entry.dataset.options:
        if key not in accepted:
            raise ConfigError(f"{where.where(path + ('dataset', 'options', key))}: unknown option {key!r} for "
                              f"dataset {entry.dataset.name!r}; accepted options: {', '.join(accepted)}")
    guard(path + ("model", "spec"), parse_spec, entry.model.spec)
    if entry.model.server is not None:
        raise ConfigError(f"{where.where(path + ('model', 'server'))}: a membership target is trained and queried, "
                          "no server move applies; remove server")
    if entry.model.training.epochs:
        raise ConfigError(f"{where.where(path + ('model', 'training'))}: a membership target is trained with the "
                          "entry's training: recipe (epochs, batch_size, lr), not model.training; move it there")
    if entry.training is not None:
        guard(path + ("training", "loss"), LOSSES.get, entry.training.loss)
    for j, d in enumerate(entry.defenses or []):
        for text in guard(path + ("defenses", j), d.expand):
            guard(path + ("defenses", j), parse_defense, text)
    labels = []
    for j, a in enumerate(entry.attack_list):
        guard(path + ("attacks", j, "name"), MEMBERSHIP_ATTACKS.get, a.name)
        guard(path + ("attacks", j, "options"), MEMBERSHIP_ATTACKS.create, a.name, **a.options)
        if a.key in labels:
            raise ConfigError(f"{where.where(path + ('attacks', j))}: attack {a.key!r} is listed twice; give one "
                              "of them a distinct label (label: ...)")
        labels.append(a.key)


def server_options(name: str) -> list[str]:
    """The options a server move accepts (its function's keyword arguments less those the trial sets)."""
    import inspect

    import importlib

    from .entries import SERVER_MOVES

    module, _, function = SERVER_MOVES[name].rpartition(".")
    fn = getattr(importlib.import_module(module), function)
    return [p for p in inspect.signature(fn).parameters if p not in SERVER_SET_BY_TRIAL]


def _check_target(target, path: tuple, where: Source, guard) -> None:
    import dataclasses

    from ...data import DATASETS, options as data_options
    from ...models.targets import TargetConfig

    guard(path + ("dataset", "name"), DATASETS.get, target.dataset.name)
    accepted = data_options(target.dataset.name)
    for key in target.dataset.options:
        if key not in accepted:
            raise ConfigError(f"{where.where(path + ('dataset', 'options', key))}: unknown option {key!r} for "
                              f"dataset {target.dataset.name!r}; accepted options: {', '.join(accepted)}")
    known = [f.name for f in dataclasses.fields(TargetConfig)]
    for key in target.options:
        if key not in known:
            raise ConfigError(f"{where.where(path + ('options', key))}: unknown option {key!r} for train_target; "
                              f"known options: {', '.join(known)}")
    guard(path + ("options",), lambda: TargetConfig(**target.options).check())


def _attack_fields(name: str) -> set[str]:
    import dataclasses

    from ...attacks import ATTACKS

    options = getattr(ATTACKS.get(name), "Options", None)
    return {f.name for f in dataclasses.fields(options)} if dataclasses.is_dataclass(options) else set()


def _check_device(name: str) -> None:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"expected a torch device like cpu or cuda:0, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} is not available on this machine; use device: cpu")


def _needs_utility() -> None:
    try:
        from ..training import utility  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"training models and measuring utility need leakbench.evaluation.training.utility, which "
                          f"cannot be imported here ({err}); remove the utility section and training epochs") from None


def _needs_bounds() -> None:
    try:
        from ...analysis.bounds import cramer_rao  # noqa: F401
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"the Cramér–Rao bound needs leakbench.analysis.bounds.cramer_rao, which is not "
                          f"available here ({err}); remove the bounds section") from None


def attack_culprit(a) -> tuple:
    """The field of an attack entry (a :class:`~.spec.AttackEntry`) that :func:`create` refuses: ``("options", key)``,
    ``("preset",)`` or ``()``."""
    from ...attacks import create as create_attack

    unknown = next((k for k in a.options if k not in _attack_fields(a.name)), None)
    if unknown is not None:
        return ("options", unknown)
    if a.preset is not None:
        try:
            create_attack(a.name, preset=a.preset)
        except (LeakbenchError, ValueError, TypeError):
            return ("preset",)
    for key, value in a.options.items():  # the first option that fails on its own (with the preset)
        try:
            create_attack(a.name, preset=a.preset, **{key: value})
        except (LeakbenchError, ValueError, TypeError):
            return ("options", key)
    return ("options",) if a.options else ()


def rule_values(spec) -> dict[str, set[str]]:
    """Per rule key, the values a rule can match in ``spec`` (names and labels, as text)."""
    defenses = spec.defense_specs()
    refs = [e for e in spec.membership if e.reference]
    defenses = [*defenses, *(d for e in refs for d in e.defense_specs(spec.defense_specs()))]
    families = {family_of(d)[0] for d in defenses}
    return {"dataset": {v for d in [*spec.datasets, *(e.dataset for e in refs)] for v in (d.name, d.key)},
            "model": {v for m in [*spec.models, *(e.model for e in refs)] for v in (m.spec, m.key)},
            "attack": {v for a in [*spec.attacks, *(a for e in spec.membership if e.target is None
                                                    for a in e.attack_list)] for v in (a.name, a.key)},
            "defense": set(defenses) | families,
            "batch_size": {str(b) for b in spec.batch_sizes},
            "seed": {str(s) for s in [*spec.seeds, *(s for e in refs for s in e.seeds)]},
            "round": {str(r) for m in spec.models if m.federated is not None for r in m.federated.rounds}}


def check_rule(spec, rule: Mapping[str, Any], kind: str, i: int, where: Source) -> None:
    """Every value an include/exclude rule names must match something in the spec (a typo selects nothing)."""
    known = rule_values(spec)
    if not rule:
        raise ConfigError(f"{where.where((kind, i))}: an empty rule {{}} matches every trial; name at least one of "
                          f"{', '.join(RULE_KEYS)}")
    for key, wanted in rule.items():
        values = wanted if isinstance(wanted, list) else [wanted]
        if not values:
            raise ConfigError(f"{where.where((kind, i, key))}: an empty list matches no trial; give a value")
        for value in values:
            if str(value) not in known.get(key, set()):
                raise ConfigError(f"{where.where((kind, i, key))}: {kind} rule value {value!r} matches no {key} of "
                                  f"this spec, so the rule selects nothing; known: {', '.join(sorted(known[key])) or 'none'}")
