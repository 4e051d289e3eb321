"""A small generic name → factory registry.

The CLI, the sweep spec and the Python API resolve attacks, defenses, datasets
and models through these, so they all accept the same names.  An unknown name
raises :class:`~leakbench.errors.ConfigError` listing the known ones.

Each entry remembers the module it came from (:meth:`Registry.origin`): leakbench's own, or a plug-in's
(:mod:`leakbench.plugins`); installed packages' plug-ins are imported before a registry resolves a name.
"""
from __future__ import annotations

import difflib
import inspect
import sys
from typing import Any, Generic, TypeVar
from collections.abc import Callable, Iterator

from .errors import ConfigError

T = TypeVar("T")



def closest(name: str, names) -> str | None:
    """The known name a typo most likely meant: among difflib's close matches, one with the same letters first
    (two letters swapped: 'dgl' means 'dlg', not 'ggl'), else the closest."""
    close = difflib.get_close_matches(name, list(names), n=3)
    swapped = [c for c in close if sorted(c) == sorted(name)]
    return (swapped or close or [None])[0]

class Registry(Generic[T]):
    """Map names to factories (classes or functions) of one kind of component."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Callable[..., T]] = {}
        self._help: dict[str, str] = {}
        self._info: dict[str, Any] = {}
        self._origin: dict[str, str] = {}

    def register(self, name: str, factory: Callable[..., T] | None = None, *, help: str | None = None,
                 info: Any = None):
        """Register ``factory`` under ``name``; usable as a decorator.

        ``info``: metadata of the entry (e.g. a metric's label and direction), read back with :meth:`info`.
        """

        def deco(f: Callable[..., T]) -> Callable[..., T]:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = f
            self._info[name] = info
            self._origin[name] = _origin(f)
            doc = help if help is not None else (f.__doc__ or "").strip().splitlines()
            self._help[name] = doc if isinstance(doc, str) else (doc[0] if doc else "")
            return f

        return deco(factory) if factory is not None else deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plug-in's test tearing down); a name never registered is ignored."""
        for table in (self._items, self._help, self._info, self._origin):
            table.pop(name, None)

    def origin(self, name: str) -> str:
        """The module that defines the entry ``name`` (``leakbench.…`` for leakbench's own)."""
        self.get(name)
        return self._origin.get(name) or _origin(self._items[name])

    def _plugins(self) -> None:
        """Installed packages' plug-ins register before any name is resolved (once per process)."""
        from .plugins import load_entry_points

        load_entry_points()

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered as ``name``; a clear error naming the known ones otherwise."""
        if not isinstance(name, str):
            raise ConfigError(f"expected a {self.kind} name (str), got {type(name).__name__}")
        if name not in self._items:
            self._plugins()
        try:
            return self._items[name]
        except KeyError:
            close = closest(name, self._items)
            hint = f" Did you mean {close!r}?" if close else ""
            raise ConfigError(
                f"unknown {self.kind} {name!r}.{hint} Known {self.kind}{'es' if self.kind.endswith('s') else 's'}: "
                f"{', '.join(self.names())}"
            ) from None

    def create(self, name: str, /, **options) -> T:
        """Instantiate the component ``name`` with keyword ``options`` (which may include one called ``name``)."""
        return self.get(name)(**options)

    def names(self) -> list[str]:
        self._plugins()
        return sorted(self._items)

    def info(self, name: str) -> Any:
        """The metadata registered with ``name`` (None if none was given)."""
        self.get(name)
        return self._info[name]

    def describe(self) -> dict[str, str]:
        """name → one-line description (for ``leakbench list``)."""
        return {n: self._help[n] for n in self.names()}

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str) and name not in self._items:
            self._plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._plugins()
        return len(self._items)


def _origin(factory: Any) -> str:
    """The module a factory comes from: a class's or function's own, else (an instance, a partial) the module that
    called ``register``."""
    if inspect.isclass(factory) or inspect.isfunction(factory):
        return str(getattr(factory, "__module__", "") or "")
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return str(frame.f_globals.get("__name__", "")) if frame is not None else ""
