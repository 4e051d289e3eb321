"""Shared pieces of the command line: the Typer app, one-line errors and option parsing.

Every :class:`~leakbench.errors.LeakbenchError` a command raises is printed as
one red line ``error: <message>`` on stderr and the command exits with code 2
(no traceback).  Nothing printed to the terminal is read as markup (the consoles have ``markup=False``;
styles are :class:`~rich.text.Text` objects), and :func:`clean` shows control characters of user strings
(``ESC[2J``) as escapes instead of sending them to the terminal.
"""
from __future__ import annotations

import errno
import functools
import inspect
import json
import os
import sqlite3
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any, NoReturn
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import typer
from rich.console import Console
from rich.text import Text

from .. import __version__
from ..coerce import coerce
from ..data import DATASETS
from ..errors import ConfigError, LeakbenchError
from ..plugins import load as load_plugins
from ..progress import clean

app = typer.Typer(
    name="leakbench",
    help="Measure how much training data leaks from what neural-network training shares.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_format_warning = warnings.formatwarning


def _clean_warning(*args: Any, **kwargs: Any) -> str:
    """Warnings quote user strings too (a plot title with ESC in it): their control characters as escapes."""
    return clean(_format_warning(*args, **kwargs))


warnings.formatwarning = _clean_warning
console = Console(markup=False)
err_console = Console(stderr=True, markup=False)

#: exit code of every user-input error (as for usage errors).
EXIT_USAGE = 2
#: a run stopped by Ctrl-C (128 + SIGINT)
EXIT_INTERRUPTED = 130


# --------------------------------------------------------------------------- errors


def fail(message: str) -> NoReturn:
    """Print ``error: message`` as one red line on stderr and exit with code 2."""
    line = clean(" ".join(str(message).splitlines()))
    err_console.print(Text(f"error: {line}", style="red"), soft_wrap=True, highlight=False)
    raise typer.Exit(EXIT_USAGE)


def _allocation_failure(err: BaseException) -> bool:
    """Whether ``err`` is torch's refusal to allocate (CPU allocator, CUDA out of memory)."""
    oom = getattr(torch, "OutOfMemoryError", None)
    text = str(err)
    return (oom is not None and isinstance(err, oom)) or "can't allocate memory" in text or "out of memory" in text \
        or "Tried to allocate" in text


#: errno values that mean the disk (or the quota) is full: the only ones whose fix is to free space.
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}


def os_failure(err: OSError) -> str:
    """One line for a file-system error that blames what went wrong: a full disk, a path that is a file where a
    directory is needed (or the reverse), a missing path, a permission or read-only place."""
    where = f" ({err.filename})" if err.filename else ""
    what = f"{err.strerror or err}{where}"
    code = err.errno
    if code in _FULL:
        return f"{what}; free disk space, then run the same command again (finished work is kept)"
    if code in (errno.ENOTDIR, errno.EEXIST):
        return f"{what}: a file stands where a directory is needed; choose another path (e.g. another --out)"
    if code == errno.EISDIR:
        return f"{what}: a directory stands where a file is needed; choose a file path"
    if code == errno.ENOENT:
        return f"{what}: no such file or directory; check the path"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{what}: not writable by you; choose a writable path"
    return f"{what}; check the path and run the same command again"


def sqlite_failure(err: sqlite3.Error) -> str:
    """One line for an SQLite error on the results store, blaming what went wrong (schema, lock, disk, damage)."""
    text = " ".join(str(err).split())
    if "no such column" in text or "no such table" in text or "has no column" in text:
        fix = ("the store was written by another leakbench version or program (its schema differs); use a new --db "
               "file")
    elif "locked" in text or "busy" in text:
        fix = "another process is writing the store; wait for it, or use another --db file"
    elif "full" in text or "disk I/O" in text:
        fix = "free disk space, or use a new --db file, and run the same command again: finished trials are kept"
    elif "not a database" in text or "malformed" in text or "corrupt" in text:
        fix = "the store is damaged; use a new --db file"
    elif "readonly" in text or "read-only" in text or "unable to open" in text:
        fix = "the store is not writable here; choose a writable --db path"
    else:
        fix = "use a new --db file"
    return f"results store: {text} ({type(err).__name__}); {fix}"


#: ``--plugin MODULE`` (repeatable), added to every command by :func:`reports_errors`
PLUGIN_OPTION = Annotated[list[str] | None, typer.Option(
    "--plugin", metavar="MODULE",
    help="Import this plug-in first (a module name, or a .py file or package folder): its register decorators add "
         "attacks, defenses, metrics, datasets and models (docs/plugins.md). Repeatable.")]


def _with_plugin_option(command: Callable[..., Any], wrapper: Callable[..., Any]) -> None:
    """Give ``wrapper`` the signature of ``command`` plus ``--plugin`` (what Typer reads to build the options)."""
    signature = inspect.signature(command, eval_str=True)
    if "plugin" in signature.parameters:
        return
    extra = inspect.Parameter("plugin", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=PLUGIN_OPTION)
    params = list(signature.parameters.values())
    wrapper.__signature__ = signature.replace(parameters=[*params, extra])  # type: ignore[attr-defined]
    hints = typing.get_type_hints(command, include_extras=True)
    wrapper.__annotations__ = {**hints, "plugin": PLUGIN_OPTION}


def reports_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn :class:`LeakbenchError` into one red line and exit code 2; Ctrl-C into exit code 130.

    Errors of the machine rather than the code get one line too: SQLite errors on the results store
    (corrupt file, disk full) and file-system errors (no space, read-only, permission).  Every command so
    decorated takes ``--plugin MODULE`` (:mod:`leakbench.plugins`), imported before the command runs.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, plugin: list[str] | None = None, **kwargs: Any) -> Any:
        try:
            if plugin:
                load_plugins(plugin, source="--plugin")
            return command(*args, **kwargs)
        except LeakbenchError as err:
            fail(str(err))
        except sqlite3.Error as err:
            fail(sqlite_failure(err))
        except OSError as err:
            fail(os_failure(err))
        except KeyboardInterrupt:
            err_console.print(Text("interrupted", style="yellow"))
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except RuntimeError as err:  # torch's allocation failures are RuntimeErrors; anything else is a bug
            if not _allocation_failure(err):
                raise
            fail(f"out of memory: {' '.join(str(err).split())[:160]}; use a smaller model, batch size, image size "
                 "or dataset limit")
        except MemoryError:
            fail("out of memory: the model, batch or dataset is larger than this machine's memory; use a smaller "
                 "model, batch size, image size or dataset limit")
        except RecursionError:
            fail("input nested too deeply (RecursionError); flatten the spec or file it came from")

    _with_plugin_option(command, wrapper)
    return wrapper


# --------------------------------------------------------------------------- parsing helpers


def parse_assignments(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    """``["a=1", "b=x"]`` → ``{"a": "1", "b": "x"}``; a clear error for an item without ``=``."""
    parsed: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"expected KEY=VALUE for {flag}, got {item!r} (e.g. {flag} iterations=100)")
        parsed[key.strip()] = value.strip()
    return parsed


def data_options(name: str, raw: Mapping[str, str]) -> dict[str, Any]:
    """Coerce ``--data-option`` strings to the types the loader of dataset ``name`` declares."""
    loader = DATASETS.get(name)
    try:
        hints = typing.get_type_hints(loader)
    except Exception:  # unresolvable annotations: fall back to guessing
        hints = {}
    return {k: coerce(v, hints.get(k, Any), name=k, owner=f"dataset {name!r}") for k, v in raw.items()}


def parse_indices(text: str | None) -> list[int] | None:
    """``"1,5,9"`` → ``[1, 5, 9]``."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"expected comma-separated sample indices like 1,5,9 for --indices, got {text!r}")
    return [int(p) for p in parts]


def parse_device(name: str) -> torch.device:
    """A torch device that exists on this machine."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"expected a torch device like cpu or cuda:0 for --device, got {name!r}") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(),
                 "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()}
    if not available.get(device.type, False):
        raise ConfigError(f"device {name!r} is not available on this machine; use --device cpu")
    return device


def _json_default(value: Any) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return value.tolist()
    return str(value)



def check_out_dir(path: Path, flag: str) -> Path:
    """Make ``path`` a writable directory before any work (a file, /dev/null or a read-only place is refused)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"expected a directory for {flag}, got {str(path)!r}, which is a file; choose another "
                          f"{flag} (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".leakbench-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write into {flag} {str(path)!r} ({err.strerror or err}); choose a writable "
                          "directory") from None
    return path


def write_json(path: Path, content: Any) -> None:
    path.write_text(json.dumps(content, indent=2, default=_json_default) + "\n")



def _print_paths(paths: Sequence[Path]) -> None:
    console.print("wrote " + ", ".join(clean(p) for p in paths), highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------- commands


def _version(value: bool) -> None:
    if value:
        console.print(f"leakbench {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Measure how much training data leaks from what neural-network training shares."""

