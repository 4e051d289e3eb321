"""Error types shared by every stage.

Messages read "expected X, got Y (field ...)" and say how to fix the input.
User input is checked with these, never with ``assert``.
"""
from __future__ import annotations

from collections.abc import Callable


class LeakbenchError(Exception):
    """Base class of every error leakbench raises on purpose."""


class ConfigError(LeakbenchError, ValueError):
    """A name, spec, shape or option given by the user is wrong."""


class UnsupportedThreatModel(LeakbenchError, ValueError):
    """An attack cannot run on this observation (missing grant, wrong architecture...)."""


class NothingRecovered(LeakbenchError):
    """An attack ran but determined nothing about the batch: it returns no reconstruction (never a flat image)."""


class BudgetExceeded(LeakbenchError):
    """Work ran past a time budget (a trial's ``budget.trial_seconds``, a sweep's ``budget.sweep_minutes``)."""


class DataNotFound(LeakbenchError, FileNotFoundError):
    """A dataset's files are absent; the message says where to put them."""


def expect(condition: bool, message: str | Callable[[], str], *, error: type[LeakbenchError] = ConfigError) -> None:
    """Raise ``error(message)`` when ``condition`` is false (an ``assert`` for user input); ``message`` may be
    a callable, built only on failure."""
    if not condition:
        raise error(message() if callable(message) else message)


def expect_same_shape(got: object, expected: object, what: str, field: str) -> None:
    """Raise :class:`ConfigError` unless ``got`` has exactly ``expected``'s shape (tensors, arrays or shapes):
    "expected {what} with shape (10,), got (1,) ({field})".

    The one check wherever two tensors must match element for element: broadcasting never stands in for it (a
    bias of shape (1,) against (10,) subtracts without complaint and is still the wrong tensor)."""
    def shape(v: object) -> tuple | None:
        s = getattr(v, "shape", v)
        try:
            return tuple(int(d) for d in s)  # type: ignore[union-attr]
        except TypeError:
            return None

    sg, se = shape(got), shape(expected)
    if sg is None or sg != se:
        raise ConfigError(f"expected {what} with shape {se}, got {sg if sg is not None else type(got).__name__} "
                          f"({field})")
