"""One way to turn option text (``--option iterations=100``, ``--data-option size=32``) into typed values.

The CLI hands options over as strings; sweep specs and the Python API hand over typed values, which
pass through untouched.  A string is converted to the option's declared annotation: ``X | None``
("none"/"null" → None), ``bool`` (1/true/yes/on, 0/false/no/off), ``int``, ``float``, ``str``,
sequences (comma-separated), and for an undeclared type the most specific of None, bool, int,
float or the text itself.  A value that does not fit is one :class:`~leakbench.errors.ConfigError`
naming the option and its owner.
"""
from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any

from .errors import ConfigError

__all__ = ["coerce", "guess"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def guess(value: str) -> Any:
    """Text as None, bool, int, float or itself (for options without a declared type)."""
    lowered = value.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def coerce(value: Any, annotation: Any, *, name: str, owner: str) -> Any:
    """``value`` converted to ``annotation`` when it is text (other values are returned as they are)."""
    if not isinstance(value, str):
        return value
    if _is_union(annotation):
        args = typing.get_args(annotation)
        if type(None) in args and value.lower() in ("none", "null"):
            return None
        rest = [a for a in args if a is not type(None)]
        if str in rest:
            return value
        if len(rest) != 1:
            return guess(value)
        annotation = rest[0]
    if typing.get_origin(annotation) in (list, tuple, collections.abc.Sequence):
        return [part.strip() for part in value.split(",") if part.strip()]
    if annotation is bool:
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
    elif annotation in (int, float):
        try:
            return annotation(value)
        except ValueError:
            pass
    elif annotation is str:
        return value
    else:
        return guess(value)
    raise ConfigError(f"expected {annotation.__name__} for option {name!r} of {owner}, got {value!r}")
