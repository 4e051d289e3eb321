"""Plug-ins: your own modules whose ``register`` decorators add attacks, defenses, metrics, datasets and models.

A plug-in is an ordinary Python module (or package) that, when imported, registers components through the
registries leakbench's own components use (:func:`leakbench.attacks.register`,
:func:`leakbench.defenses.register`, :func:`leakbench.metrics.register`, ``DATASETS.register``,
``MODELS.register``).  Three ways bring it in (docs/plugins.md):

- a sweep spec's ``plugins: [my_pkg.defenses, ...]`` — module names, imported from the Python path
  (installed packages, ``PYTHONPATH``), never from the current directory just because a spec names them;
- ``--plugin MODULE`` on any command — a module name as above, or a path you name on the command line
  (``--plugin ./l1_match.py``, ``--plugin ./my_pkg``);
- installed packages declaring an entry point in the group ``leakbench.plugins``
  (``[project.entry-points."leakbench.plugins"] mine = "my_pkg.leakbench"``), imported the first time a
  registry is asked for a name (``LEAKBENCH_NO_ENTRY_POINTS=1`` skips them).

A sweep's trials carry the source digest of every plug-in whose components they use (:func:`digest`), so an
edited plug-in never mixes with old results, and pool workers and Ray actors import the plug-ins before
they run a trial (:func:`load_sources` when they start, :func:`ensure` per trial).  A plug-in that fails is
one line naming the module and what failed.

This module imports nothing from the rest of leakbench but its errors, so every stage may use it.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping

from .errors import ConfigError

#: the entry-point group installed packages declare their plug-ins in
GROUP = "leakbench.plugins"
#: set to 1 to skip installed packages' entry points
NO_ENTRY_POINTS_ENV = "LEAKBENCH_NO_ENTRY_POINTS"
#: where a script run as the main program registers (a pool worker re-imports it; a Ray actor cannot)
MAIN = "__main__"

__all__ = ["GROUP", "NO_ENTRY_POINTS_ENV", "Plugin", "load", "load_entry_points", "loaded", "sources",
           "load_sources", "digest", "unit_of", "is_builtin", "ensure", "origin_text"]


@dataclass(frozen=True)
class Plugin:
    """A loaded plug-in: its module name, how it came in, and its file or folder when given as a path."""

    name: str
    source: str  # "spec", "--plugin", "entry point NAME of DIST"
    path: str = ""


_LOADED: dict[str, Plugin] = {}
_DIGESTS: dict[str, str] = {}
_ENTRY_POINTS = {"state": "todo"}  # todo → loading → done


def is_builtin(module: str | None) -> bool:
    """Whether ``module`` is part of leakbench itself."""
    return module == "leakbench" or str(module or "").startswith("leakbench.")


def loaded() -> dict[str, Plugin]:
    """The plug-ins loaded in this process, by module name."""
    return dict(_LOADED)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())[:200]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _is_path(name: str) -> bool:
    return name.endswith(".py") or "/" in name or os.sep in name or name.startswith(".") or name.startswith("~")


@contextlib.contextmanager
def _without_implicit_cwd() -> Iterator[None]:
    """``sys.path`` without the current directory that ``python -m``/``-c`` put there (kept when ``PYTHONPATH``
    names it): a module a spec names comes from an installed package or the path the user set."""
    here = os.path.realpath(os.getcwd())
    chosen = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    implicit = [p for p in sys.path if (p == "" or os.path.realpath(p) == here) and here not in chosen]
    if not implicit:
        yield
        return
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in implicit]
    try:
        yield
    finally:
        added = [p for p in sys.path if p not in saved]  # what the import itself added stays
        sys.path[:] = saved + added


def _import_name(name: str, source: str) -> None:
    if not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(f"plug-in {name!r} ({source}): expected a module name such as my_pkg.defenses"
                          + (", or a path on the command line (--plugin ./file.py)" if source == "spec" else ""))
    if name in sys.modules:
        return
    # a spec names modules of installed packages or PYTHONPATH; a name typed on the command line, or one the parent
    # process imported (a trial's), resolves as Python would
    with _without_implicit_cwd() if source == "spec" else contextlib.nullcontext():
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            missing = err.name or name
            if name == missing or name.startswith(missing + "."):
                raise ConfigError(f"plug-in {name!r} ({source}): no such module on the Python path; install its "
                                  "package or put its folder on PYTHONPATH (the current directory is not searched"
                                  + ("; name a file with --plugin ./file.py" if source != "spec" else "")
                                  + ")") from None
            raise ConfigError(f"plug-in {name!r} ({source}): importing it failed: {_one_line(err)}; install what "
                              "it needs") from None
        except Exception as err:  # noqa: BLE001 - the user's module raised while importing: one line
            raise ConfigError(f"plug-in {name!r} ({source}): importing it failed: {_one_line(err)}; fix the "
                              "module") from None


def _import_path(text: str, source: str) -> str:
    """Import the file or package folder ``text`` under its stem's name; returns the name."""
    path = Path(text).expanduser()
    if path.is_dir():
        init, name = path / "__init__.py", path.resolve().name
        if not init.is_file():
            raise ConfigError(f"plug-in {text!r} ({source}): a folder without __init__.py; name a .py file or a "
                              "package folder")
    elif path.is_file() and path.suffix == ".py":
        init, name = path, path.stem
    else:
        raise ConfigError(f"plug-in {text!r} ({source}): no such .py file or package folder")
    if not name.isidentifier():
        raise ConfigError(f"plug-in {text!r} ({source}): {name!r} is not a module name; rename the file")
    there = sys.modules.get(name)
    if there is not None:
        same = os.path.realpath(getattr(there, "__file__", "") or "") == os.path.realpath(init)
        if same:
            return name
        raise ConfigError(f"plug-in {text!r} ({source}): a module named {name!r} is already imported from "
                          f"{getattr(there, '__file__', None) or 'elsewhere'}; rename the file")
    locations = [str(path.resolve())] if path.is_dir() else None
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=locations)
    if spec is None or spec.loader is None:
        raise ConfigError(f"plug-in {text!r} ({source}): cannot be imported as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - the user's module raised while importing: one line
        sys.modules.pop(name, None)
        fix = "install what it needs" if isinstance(err, ModuleNotFoundError) else "fix the module"
        raise ConfigError(f"plug-in {text!r} ({source}): importing it failed: {_one_line(err)}; {fix}") from None
    return name


def load(names: Iterable[str] | None, *, source: str) -> list[str]:
    """Import the plug-ins ``names`` (module names; paths too when ``source`` is ``"--plugin"``, the command
    line); returns their module names.  Already loaded ones are not imported again."""
    out = []
    for raw in names or ():
        text = str(raw).strip()
        if not text:
            raise ConfigError(f"plug-in {raw!r} ({source}): expected a module name")
        if _is_path(text):
            if source != "--plugin":
                raise ConfigError(f"plug-in {text!r} ({source}): a spec names modules, not files (a file is "
                                  "imported only when you name it on the command line: --plugin PATH); put its "
                                  "folder on PYTHONPATH and give the module name")
            name = _import_path(text, source)
            path = os.path.realpath(text)
        else:
            _import_name(text, source)
            name, path = text, ""
        if name not in _LOADED:
            _LOADED[name] = Plugin(name, source, path)
        digest(name)  # the source as imported
        out.append(name)
    return out


def load_entry_points() -> None:
    """Import every installed package's plug-in (entry-point group :data:`GROUP`) once per process.

    Called by the registries before they resolve a name; skipped while leakbench itself is still importing
    (a plug-in imports leakbench) and when ``LEAKBENCH_NO_ENTRY_POINTS`` is set."""
    if _ENTRY_POINTS["state"] != "todo" or os.environ.get(NO_ENTRY_POINTS_ENV, "") not in ("", "0"):
        return
    package = sys.modules.get("leakbench")
    if package is None or getattr(getattr(package, "__spec__", None), "_initializing", False):
        return
    _ENTRY_POINTS["state"] = "loading"
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group=GROUP):
            dist = getattr(getattr(ep, "dist", None), "name", None)
            source = f"entry point {ep.name}" + (f" of {dist}" if dist else "")
            load([ep.module], source=source)
    finally:
        _ENTRY_POINTS["state"] = "done"


def sources() -> list[tuple[str, str, str]]:
    """(name, source, path) of every plug-in loaded here: what a pool worker or Ray actor loads when it starts."""
    return [(p.name, p.source, p.path) for p in _LOADED.values()]


def load_sources(items: Iterable[tuple[str, str, str]]) -> None:
    """Load the plug-ins of :func:`sources` (in a worker: paths as given on the parent's command line)."""
    for name, source, path in items or ():
        if path:
            load([path], source="--plugin")
        else:
            load([name], source=source)


def unit_of(module: str) -> str:
    """The plug-in a component defined in ``module`` belongs to: the loaded plug-in (package) holding it, else
    the module itself."""
    for name in _LOADED:
        if module == name or module.startswith(name + "."):
            return name
    return module


def _files(module) -> list[Path]:
    paths = getattr(module, "__path__", None)
    if paths is not None:  # a package: every .py file in it
        return sorted({f for p in paths for f in Path(p).rglob("*.py") if "__pycache__" not in f.parts})
    file = getattr(module, "__file__", None)
    return [Path(file)] if file and os.path.isfile(file) else []


def digest(unit: str) -> str:
    """SHA-256 (16 hex digits) of the plug-in ``unit``'s source: its module file, or every .py of its package
    (relative names and contents); computed once per process, when first asked (at import for loaded ones)."""
    if unit in _DIGESTS:
        return _DIGESTS[unit]
    module = sys.modules.get(unit)
    if module is None:
        raise ConfigError(f"plug-in {unit!r} is not imported in this process")
    h = hashlib.sha256(f"{unit}\n".encode())
    files = _files(module)
    base = Path(getattr(module, "__path__", [""])[0]) if getattr(module, "__path__", None) else None
    for f in files:
        h.update((f.relative_to(base).as_posix() if base else f.name).encode() + b"\0")
        h.update(f.read_bytes())
    if not files:  # no source file (an extension module): its version
        h.update(str(getattr(module, "__version__", "")).encode())
    _DIGESTS[unit] = h.hexdigest()[:16]
    return _DIGESTS[unit]


def ensure(plugins: Mapping[str, str] | None) -> None:
    """Before a trial runs (in any process): import the plug-ins ``{unit: digest}`` it uses that are not
    imported yet, and refuse one whose source is no longer the one the trial was planned with."""
    for unit, want in (plugins or {}).items():
        if unit == MAIN:  # the script (a pool worker re-imports it; a notebook has no file to compare)
            if not getattr(sys.modules.get(MAIN), "__file__", None):
                continue
        elif unit not in sys.modules:
            load([unit], source="trial")
        got = digest(unit)
        if want and got != want:
            raise ConfigError(f"plug-in {unit!r} changed since this trial was planned (source digest {got}, "
                              f"planned with {want}); run the sweep again: it plans the edited plug-in's trials "
                              "as new ones")


def origin_text(module: str | None) -> str:
    """Where a component registered from ``module`` comes from, for ``leakbench list``."""
    if module is None or is_builtin(module):
        return "leakbench"
    unit = unit_of(module)
    plugin = _LOADED.get(unit)
    if plugin is None:
        return f"{module} (imported)"
    return f"{unit} ({plugin.source}{': ' + plugin.path if plugin.path else ''})"
