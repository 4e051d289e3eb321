"""Defense contract, registry and spec parsing (``name:arg,arg+name:arg``)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..registry import Registry

DEFENSES: Registry["Defense"] = Registry("defense")


class Defense:
    """A transformation of what the client shares.

    ``apply_gradients`` acts on the per-parameter tensors the server would see
    (gradients or an update).  Client-side defenses override the hooks they need.
    """

    spec: str = "none"

    def apply_gradients(self, grads: list[torch.Tensor], *, generator: torch.Generator) -> list[torch.Tensor]:
        return grads

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"{type(self).__name__}({self.spec!r})"


@DEFENSES.register("none", help="no defense: the server sees the exact gradient or update")
class Identity(Defense):
    spec = "none"


@dataclass
class Composition(Defense):
    """Defenses applied left to right, as written in ``"clip:4+noise:0.01"``."""

    parts: tuple[Defense, ...]

    @property
    def spec(self) -> str:  # type: ignore[override]
        return "+".join(p.spec for p in self.parts)

    def apply_gradients(self, grads, *, generator):
        for part in self.parts:
            grads = part.apply_gradients(grads, generator=generator)
        return grads


def _convert(param: inspect.Parameter, value: str, defense: str):
    """A spec argument as the type of the parameter's default (a float without a default or for None)."""
    default = param.default
    if isinstance(default, bool):  # bool("false") would be True
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"expected true or false for {param.name} of defense {defense!r}, got {value!r}")
    try:
        if default is inspect.Parameter.empty or default is None:
            return float(value)
        return type(default)(value)
    except ValueError:
        raise ConfigError(f"expected a number for {param.name} of defense {defense!r}, got {value!r}") from None


def _parse_one(text: str) -> Defense:
    name, _, args = text.strip().partition(":")
    factory = DEFENSES.get(name.strip())
    values = [a.strip() for a in args.split(",") if a.strip()] if args else []
    params = [p for p in inspect.signature(factory).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    if len(values) > len(params):
        expected = ",".join(p.name for p in params) or "no arguments"
        raise ConfigError(f"defense {name!r} takes {expected}, got {args!r} (defense spec {text!r})")
    missing = [p.name for p in params[len(values):] if p.default is inspect.Parameter.empty]
    if missing:
        raise ConfigError(f"defense {name!r} needs {','.join(missing)}, got {args!r} (defense spec {text!r})")
    kwargs = {}
    for p, v in zip(params, values):
        kwargs[p.name] = _convert(p, v, name)
    defense = factory(**kwargs)
    return defense


def parse(spec: "str | Defense | None") -> Defense:
    """A :class:`Defense` from a spec string (``None`` and ``"none"`` give the identity)."""
    if spec is None:
        return Identity()
    if isinstance(spec, Defense):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"expected a defense spec such as 'clip:4+noise:0.01', got {spec!r}")
    parts = tuple(_parse_one(p) for p in spec.split("+"))
    return parts[0] if len(parts) == 1 else Composition(parts)
