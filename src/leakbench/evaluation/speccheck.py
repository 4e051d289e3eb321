"""Limits and consistency checks of sweep specs (used by :mod:`.spec`): UTF-8, alias expansion, rules, options.

- :func:`read_text`: the spec file as UTF-8, or one line naming the line and the byte;
- :func:`check_size`: refuse a YAML document that expands to more than :data:`MAX_SPEC_NODES`
  values (an alias bomb) or refers to itself, measured without expanding it;
- :func:`check_rule`: an include/exclude rule whose value matches nothing in the spec is a typo;
- :func:`attack_culprit`: the field of an attack entry that its attack refuses (an option or the preset).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

import yaml

from ..defenses import family_of
from ..errors import ConfigError, LeakbenchError

if TYPE_CHECKING:
    from .spec import AttackEntry, SweepSpec, _Source

#: most YAML nodes a spec may expand to (aliases counted at every use): an alias bomb is refused before expansion.
MAX_SPEC_NODES = 100_000
#: most trials a spec may plan unless it raises ``max_trials`` (or ``leakbench evaluate --yes``).
MAX_TRIALS = 10_000


def read_text(path: Path) -> str:
    """The spec file as UTF-8 text; one line naming the byte otherwise."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read the sweep spec {str(path)!r} ({err.strerror or err}); check the path "
                          "and its permissions") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path.name} line {line}: expected UTF-8 text, got byte 0x{raw[err.start]:02x} at "
                          f"offset {err.start}; save the spec as UTF-8") from None


def check_size(node: yaml.Node | None, name: str, limit: int = MAX_SPEC_NODES) -> None:
    """Count the nodes ``node`` expands to (each alias at every use) without expanding it; refuse past ``limit``.

    Shared nodes are counted once per use through a memo on node identity, so an 8-level
    "billion laughs" alias bomb costs a few hundred steps to measure, not 10⁸ to expand.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(n: yaml.Node) -> int:
        known = sizes.get(id(n))
        if known is not None:
            return known
        if id(n) in active:
            raise ConfigError(f"{name} line {n.start_mark.line + 1}: an alias refers to itself (recursive "
                              "anchor); write the value out")
        active.add(id(n))
        if isinstance(n, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in n.value)
        elif isinstance(n, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in n.value)
        else:
            total = 1
        active.discard(id(n))
        sizes[id(n)] = total = min(total, limit + 1)
        return total

    if node is not None and size(node) > limit:
        raise ConfigError(f"{name}: expected a spec of at most {limit:,} YAML values with its aliases expanded, "
                          f"got more (an alias bomb?); write the lists out or use fewer nested aliases")


def attack_culprit(a: AttackEntry) -> tuple:
    """The field of an attack entry that :func:`create` refuses: ``("options", key)``, ``("preset",)`` or ``()``."""
    from ..attacks import create as create_attack
    from .specnames import _attack_fields

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


def rule_values(spec: SweepSpec) -> dict[str, set[str]]:
    """Per rule key, the values a rule can match in ``spec`` (names and labels, as text)."""
    defenses = spec.defense_specs()
    families = {family_of(d)[0] for d in defenses}
    return {"dataset": {v for d in spec.datasets for v in (d.name, d.key)},
            "model": {v for m in spec.models for v in (m.spec, m.key)},
            "attack": {v for a in spec.attacks for v in (a.name, a.key)},
            "defense": set(defenses) | families,
            "batch_size": {str(b) for b in spec.batch_sizes},
            "seed": {str(s) for s in spec.seeds}}


def check_rule(spec: SweepSpec, rule: Mapping[str, Any], kind: str, i: int, where: _Source) -> None:
    """Every value an include/exclude rule names must match something in the spec (a typo selects nothing)."""
    from .spec import RULE_KEYS

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
                                  f"this spec, so the rule selects nothing; known: {', '.join(sorted(known[key]))}")


__all__ = ["MAX_SPEC_NODES", "MAX_TRIALS", "read_text", "check_size", "check_rule", "rule_values", "attack_culprit"]
