"""Activation functions by name.

Every model family takes ``act=<name>``; the names are those of
:data:`ACTIVATIONS`.  The leaky ReLU's default negative slope is 0.2, the
value of the public R-GAP code (Zhu & Blaschko 2021, ``models/CNN6.py``:
``nn.LeakyReLU(negative_slope=0.2)``), the analytic attack the leaky ReLU is
used with here; Chen & Campbell (2022) use tanh in their CNN variants and give
no slope.  Pass ``negative_slope=`` to change it.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..errors import ConfigError
from ..registry import Registry

#: Default slope of ``leaky-relu`` (R-GAP's value; PyTorch's own default is 0.01).
DEFAULT_NEGATIVE_SLOPE = 0.2

ActivationFactory = Callable[[], nn.Module]

ACTIVATIONS: Registry[nn.Module] = Registry("activation")


@ACTIVATIONS.register("relu")
def _relu() -> nn.Module:
    """ReLU, max(0, z)."""
    return nn.ReLU()


@ACTIVATIONS.register("leaky-relu")
def _leaky_relu(*, negative_slope: float = DEFAULT_NEGATIVE_SLOPE) -> nn.Module:
    """Leaky ReLU, max(z, s·z); slope s from ``negative_slope`` (default 0.2, as R-GAP)."""
    return nn.LeakyReLU(negative_slope=float(negative_slope))


@ACTIVATIONS.register("tanh")
def _tanh() -> nn.Module:
    """Hyperbolic tangent (Chen & Campbell's CNN variants)."""
    return nn.Tanh()


@ACTIVATIONS.register("sigmoid")
def _sigmoid() -> nn.Module:
    """Logistic sigmoid (the LeNet of DLG)."""
    return nn.Sigmoid()


@ACTIVATIONS.register("identity")
def _identity() -> nn.Module:
    """No non-linearity (linear layers)."""
    return nn.Identity()


def canonical_activation(name: str) -> str:
    """The registered spelling of ``name`` (``"Leaky_ReLU"`` → ``"leaky-relu"``).

    Raises :class:`ConfigError` listing the known activations otherwise.
    """
    if not isinstance(name, str):
        raise ConfigError(
            f"expected an activation name (one of {', '.join(ACTIVATIONS.names())}), "
            f"got {type(name).__name__} (field act)"
        )
    key = name.strip().lower().replace("_", "-")
    if key == "leakyrelu":
        key = "leaky-relu"
    if key not in ACTIVATIONS:
        raise ConfigError(
            f"unknown activation {name!r} (field act); known activations: {', '.join(ACTIVATIONS.names())}"
        )
    return key


def activation(name: str, *, negative_slope: float | None = None) -> nn.Module:
    """A fresh activation module for ``name`` (see :data:`ACTIVATIONS`).

    ``negative_slope`` only applies to ``leaky-relu``; giving it for another
    activation is a :class:`ConfigError`.
    """
    return activation_factory(name, negative_slope=negative_slope)()


def activation_factory(name: str, *, negative_slope: float | None = None) -> ActivationFactory:
    """A zero-argument callable making a new activation module per layer."""
    key = canonical_activation(name)
    factory = ACTIVATIONS.get(key)
    if negative_slope is None:
        return factory
    if key != "leaky-relu":
        raise ConfigError(
            f"negative_slope only applies to act='leaky-relu', got act={key!r} (field negative_slope)"
        )
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, (int, float)):
        raise ConfigError(f"expected a number for negative_slope, got {negative_slope!r}")
    slope = float(negative_slope)
    return lambda: factory(negative_slope=slope)


def activation_name(module: nn.Module) -> str | None:
    """The registered name of an activation module, or ``None`` if it is not one of ours."""
    table = {
        nn.ReLU: "relu",
        nn.LeakyReLU: "leaky-relu",
        nn.Tanh: "tanh",
        nn.Sigmoid: "sigmoid",
        nn.Identity: "identity",
    }
    return table.get(type(module))
