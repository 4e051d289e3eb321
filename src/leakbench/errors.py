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
