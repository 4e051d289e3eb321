"""Defense contract, registry and spec parsing (``name:arg,arg+name:arg``).

A defense acts at one *stage* of the client's round (Liu et al. 2024, Sec. 3 and 5.1):

- ``"shared"`` — on the tensors the client sends (prune, clip, noise, graddrop,
  quantize): :meth:`Defense.apply_gradients`, a pure function of the tensors;
- ``"model"`` — inside the model during the client step (dropout);
- ``"step"`` — how one step's gradient is computed from the batch (DP-SGD);
- ``"round"`` — what a round shares (local aggregation: θ_k − θ_0 after k steps);
- ``"aggregate"`` — how clients' outputs are combined (secure aggregation).

Client-side defenses say what they change by filling a :class:`ClientPlan`
(:meth:`Defense.configure`); :func:`leakbench.defenses.pipeline.share` runs the
plan, and both :func:`leakbench.observe` and the utility training go through it.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar
from collections.abc import Callable

import torch

from ..errors import ConfigError
from ..registry import Registry

DEFENSES: Registry[Defense] = Registry("defense")
STAGES = ("shared", "model", "step", "round", "aggregate")

#: the client whose round is being computed: 0 the attacked client, 1 … L − 1 the others under ``secagg:L``.
#: A shared-stage defense that keeps state per client run (top-k's error-feedback memory) keys it by this and the
#: generator, since all clients of one observation draw from the same generator.
_CLIENT: contextvars.ContextVar[int] = contextvars.ContextVar("leakbench_client", default=0)


def current_client() -> int:
    """The index of the client whose shared tensors are being computed (0 outside :func:`client_scope`)."""
    return _CLIENT.get()


@contextlib.contextmanager
def client_scope(index: int):
    """Within this block :func:`current_client` is ``index``."""
    token = _CLIENT.set(int(index))
    try:
        yield
    finally:
        _CLIENT.reset(token)


#: ``gradient(model, params, x, y, loss_fn, generator) -> list[Tensor]``: one step's gradient, in ``params`` order.
GradientFn = Callable[..., list[torch.Tensor]]


@dataclass
class ClientPlan:
    """How one client round is computed; defenses fill the slots they own (``None`` = the plain default).

    ``gradient`` replaces the mean-loss gradient of a step (DP-SGD); ``wrappers`` are context
    managers ``wrapper(model, generator)`` active around the client's forward passes (dropout);
    ``local_steps``/``local_lr`` make the round share θ_k − θ_0 (``local_steps`` epochs over the client's
    batch, each one full-batch step, or ⌈n/``local_batch``⌉ minibatch steps, reshuffled per epoch with
    ``local_shuffle``); ``clients``/``reduce``/``population``
    aggregate several clients (secure aggregation); ``before``/``after`` are the shared-stage
    defenses applied to each client's output and to the aggregate.
    """

    gradient: GradientFn | None = None
    gradient_owner: str = ""
    wrappers: list[Callable[..., Any]] = field(default_factory=list)
    local_steps: int | None = None
    local_lr: float = 0.0
    local_batch: int | None = None
    local_shuffle: bool = False
    clients: int = 1
    reduce: str = "mean"
    population: Any = None
    before: list[Defense] = field(default_factory=list)
    after: list[Defense] = field(default_factory=list)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)


def format_value(value: Any) -> str:
    """A spec argument as text that parses back to the same value (``4.0`` → ``4``, ``1e-05``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        short = format(value, "g")
        return short if float(short) == value else repr(value)
    return str(value)


@functools.cache
def positional_parameters(factory: Callable[..., Any]) -> tuple[inspect.Parameter, ...]:
    """The parameters a spec fills in order (positional-or-keyword), cached per factory."""
    return tuple(p for p in inspect.signature(factory).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD)


class Defense:
    """A transformation of what the client shares, or of how the client computes it.

    Subclasses registered with :func:`register` get ``name`` and a ``spec`` rebuilt from
    their positional constructor arguments (stored as attributes of the same names).
    ``apply_gradients`` acts on the per-parameter tensors the server would see;
    client-side defenses set ``stage`` and override :meth:`configure`.
    """

    name: ClassVar[str] = ""
    stage: ClassVar[str] = "shared"

    @property
    def spec(self) -> str:
        """The spec string that :func:`parse` turns back into this defense (trailing defaults omitted)."""
        params = positional_parameters(type(self))
        values = [getattr(self, p.name) for p in params]
        keep = len(values)
        while keep and params[keep - 1].default is not inspect.Parameter.empty \
                and values[keep - 1] == params[keep - 1].default:
            keep -= 1
        args = ",".join(format_value(v) for v in values[:keep])
        return f"{self.name}:{args}" if args else self.name

    @property
    def family(self) -> str:
        """The registry name (``"clip+noise"`` for a composition): what tables and plots group by."""
        return self.name or "none"

    @property
    def parameters(self) -> dict[str, Any]:
        """The constructor arguments by name, defaults included (``clip:4`` → ``{"C": 4.0, "scope": "global"}``)."""
        return {p.name: getattr(self, p.name) for p in positional_parameters(type(self))}

    @property
    def arguments(self) -> str:
        """The spec's arguments as written in it (``"clip:4+noise:0.01"`` → ``"4, 0.01"``)."""
        return ", ".join(part.spec.partition(":")[2] for part in parts_of(self) if ":" in part.spec)

    def apply_gradients(self, grads: list[torch.Tensor], *, generator: torch.Generator) -> list[torch.Tensor]:
        """The shared tensors after this defense (identity for client-side defenses)."""
        return grads

    def configure(self, plan: ClientPlan) -> None:
        """Fill the slots of ``plan`` this defense owns (shared-stage defenses are placed by the pipeline)."""

    def describe(self) -> dict[str, Any]:
        """What the server knows about this defense (recorded in ``Observation.extras["defense"]``)."""
        return {}

    def extend(self, model: Any, generator: torch.Generator) -> Any:
        """The model the round trains, for a defense that changes the architecture (PRECODE); ``model`` itself
        otherwise.  Called by :func:`~.pipeline.extend_model` before the parameters are read."""
        return model

    def __call__(self, grads: list[torch.Tensor], *, seed: int = 0,
                 generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """Apply the shared-stage transformation to ``grads`` with a generator seeded by ``seed``."""
        inside = [p.spec for p in parts_of(self) if p.stage != "shared"]
        if inside:
            raise ConfigError(f"defense {inside[0]!r} acts inside the client's computation, not on given gradients: "
                              "use leakbench.observe(..., defense=...) or leakbench.defenses.share(...)")
        gen = generator if generator is not None else torch.Generator(device="cpu").manual_seed(int(seed))
        return self.apply_gradients(list(grads), generator=gen)

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"{type(self).__name__}({self.spec!r})"


def register(name: str, *, help: str | None = None):
    """Class decorator: register a :class:`Defense` subclass under ``name`` and set its ``name``."""

    def deco(cls: type[Defense]) -> type[Defense]:
        cls.name = name
        DEFENSES.register(name, cls, help=help)
        return cls

    return deco


@register("none", help="no defense: the server sees the exact gradient or update")
class Identity(Defense):
    spec = "none"


@dataclass
class Composition(Defense):
    """Defenses in the order written, as in ``"clip:4+noise:0.01"``.

    Shared-stage parts apply left to right to what the client sends; with ``secagg`` in the
    spec, those to its left act on each client's output and those to its right on the aggregate.
    Client-side parts act inside the client's round wherever they are written.
    """

    parts: tuple[Defense, ...]

    @property
    def spec(self) -> str:  # type: ignore[override]
        return "+".join(p.spec for p in self.parts)

    @property
    def family(self) -> str:  # type: ignore[override]
        return "+".join(p.family for p in self.flat())

    @property
    def parameters(self) -> dict[str, Any]:  # type: ignore[override]
        """Per part, in written order: ``{"clip": {...}, "noise": {...}}`` (a repeated name gets ``#2``)."""
        out: dict[str, Any] = {}
        for p in self.flat():
            key = p.family if p.family not in out else f"{p.family}#{sum(k.split('#')[0] == p.family for k in out) + 1}"
            out[key] = p.parameters
        return out

    def flat(self) -> list[Defense]:
        out: list[Defense] = []
        for p in self.parts:
            out.extend(p.flat() if isinstance(p, Composition) else [p])
        return out

    def apply_gradients(self, grads, *, generator):
        for part in self.parts:
            grads = part.apply_gradients(grads, generator=generator)
        return grads

    def describe(self) -> dict[str, Any]:
        return {k: v for p in self.parts for k, v in p.describe().items()}

    def extend(self, model, generator):
        for part in self.parts:
            model = part.extend(model, generator)
        return model


def parts_of(defense: Defense) -> list[Defense]:
    """The defenses of a composition in written order (a single defense alone)."""
    return defense.flat() if isinstance(defense, Composition) else [defense]


# --------------------------------------------------------------------------- argument checks


def check_fraction(value: float, field_name: str, defense: str, *, closed: bool = True) -> float:
    """``value`` as a float in [0, 1] (or [0, 1) with ``closed=False``); a ConfigError naming the field otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0)
    if not ok:
        interval = "[0, 1]" if closed else "[0, 1)"
        raise ConfigError(f"expected {field_name} in {interval} for defense {defense!r}, got {value!r}")
    return float(value)


def check_positive(value: float, field_name: str, defense: str, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = "≥ 0" if allow_zero else "> 0"
        raise ConfigError(f"expected {field_name} {bound} for defense {defense!r}, got {value!r}")
    return float(value)


def check_choice(value: str, field_name: str, defense: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"expected {field_name} in {choices} for defense {defense!r}, got {value!r}")
    return value


# --------------------------------------------------------------------------- parsing


def _convert(param: inspect.Parameter, value: str, defense: str):
    """A spec argument as the type of the parameter's default (int when annotated so, else a float, without one)."""
    default = param.default
    if default is inspect.Parameter.empty and param.annotation in (int, "int"):
        default = 0  # a required int argument (e.g. local:k)
    if isinstance(default, bool):  # bool("false") would be True
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"expected true or false for {param.name} of defense {defense!r}, got {value!r}")
    try:
        if default is inspect.Parameter.empty or default is None:
            return float(value)
        if isinstance(default, int):
            number = float(value)  # accept "5" and "5.0", not "1.5"
            if not number.is_integer():
                raise ValueError
            return int(number)
        return type(default)(value)
    except (ValueError, OverflowError):
        raise ConfigError(f"expected a number for {param.name} of defense {defense!r}, got {value!r}") from None


def _parse_one(text: str) -> Defense:
    name, _, args = text.strip().partition(":")
    factory = DEFENSES.get(name.strip())
    values = [a.strip() for a in args.split(",") if a.strip()] if args else []
    params = positional_parameters(factory)
    if len(values) > len(params):
        expected = ",".join(p.name for p in params) or "no arguments"
        raise ConfigError(f"defense {name!r} takes {expected}, got {args!r} (defense spec {text!r})")
    missing = [p.name for p in params[len(values):] if p.default is inspect.Parameter.empty]
    if missing:
        raise ConfigError(f"defense {name!r} needs {','.join(missing)}, got {args!r} (defense spec {text!r})")
    kwargs = {}
    for p, v in zip(params, values):
        kwargs[p.name] = _convert(p, v, name)
    try:
        return factory(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{err} (defense spec {text.strip()!r})") from None


def family_of(spec: str) -> tuple[str, str]:
    """``"clip:4+noise:0.01"`` → ``("clip+noise", "4, 0.01")`` through :func:`parse` (``"none"`` → ``("none", "")``).

    A spec that no longer parses (a store written with a defense this process has not registered) is
    split on its separators, so reports of old stores still group it."""
    try:
        d = parse(spec)
    except ConfigError:
        parts = [p.strip().partition(":") for p in str(spec).split("+")]
        return "+".join(name for name, _, _ in parts), ", ".join(args for _, _, args in parts if args)
    return d.family, d.arguments


def parse(spec: str | Defense | None) -> Defense:
    """A :class:`Defense` from a spec string (``None`` and ``"none"`` give the identity)."""
    if spec is None:
        return Identity()
    if isinstance(spec, Defense):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"expected a defense spec such as 'clip:4+noise:0.01', got {spec!r}")
    parts = tuple(_parse_one(p) for p in spec.split("+"))
    return parts[0] if len(parts) == 1 else Composition(parts)
