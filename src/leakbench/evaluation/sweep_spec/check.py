"""Limits of sweep specs and the checks of their text (used by :mod:`.specsource`, :mod:`.spec` and :mod:`.specnames`).

- :data:`MAX_SPEC_NODES`, :data:`MAX_TRIALS`, :data:`RULE_KEYS`, :data:`SERVER_SET_BY_TRIAL`;
- :func:`read_text`: the spec file as UTF-8, or one line naming the line and the byte;
- :func:`check_size`: refuse a YAML document that expands to more than :data:`MAX_SPEC_NODES`
  values (an alias bomb) or refers to itself, measured without expanding it.

The spec files import one way: speccheck ← specsource ← specnames ← spec.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from ...errors import ConfigError

#: most YAML nodes a spec may expand to (aliases counted at every use): an alias bomb is refused before expansion.
MAX_SPEC_NODES = 100_000
#: most trials a spec may plan unless it raises ``max_trials`` (or ``leakbench evaluate --yes``).
MAX_TRIALS = 10_000
#: the keys an include/exclude rule may name
RULE_KEYS = ("dataset", "model", "batch_size", "attack", "defense", "seed", "round")
#: the options of a server move that the trial sets (never the spec)
SERVER_SET_BY_TRIAL = ("model", "calibration", "input_shape")


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


__all__ = ["MAX_SPEC_NODES", "MAX_TRIALS", "RULE_KEYS", "SERVER_SET_BY_TRIAL", "read_text", "check_size"]
