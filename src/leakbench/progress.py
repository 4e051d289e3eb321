"""Progress of long work: a rich bar on a terminal, periodic log lines when output goes to a file.

``rich_progress`` yields the ``progress(done, total, loss)`` callback the attacks take; ``sweep_progress``
yields ``advance(status)`` for a sweep's trials.  When stdout is not a terminal (a batch job, ``> log``),
a bar would stay silent until the end, so both print one line at the start, then at most one every
``LEAKBENCH_PROGRESS_EVERY`` seconds (default 30), and one at the end.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn

__all__ = ["rich_progress", "sweep_progress", "LogLines", "on_terminal", "clean"]


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def clean(value: object) -> str:
    """``str(value)`` with control characters (ESC, CR, BiDi overrides...) written as escapes like ``\\x1b``."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))


def _label(value: object) -> str:
    """A user string for a rich markup template: control characters escaped, then markup escaped."""
    from rich.markup import escape

    return escape(clean(value))


def on_terminal() -> bool:
    """Whether stdout is an interactive terminal (rich's view, so FORCE_TERMINAL / TTY_COMPATIBLE count)."""
    return Console().is_terminal


def _every() -> float:
    try:
        value = float(os.environ.get("LEAKBENCH_PROGRESS_EVERY", "30"))
    except ValueError:
        return 30.0
    return value if math.isfinite(value) and value >= 0 else 30.0


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class LogLines:
    """Timestamped progress lines, at most one every ``every`` seconds (and always the first and the last)."""

    def __init__(self, description: str, unit: str, *, every: float | None = None,
                 write: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.description, self.unit = description, unit
        self.every = _every() if every is None else every
        self.clock = clock
        self.start = clock()
        self.last = -math.inf
        self.write = write or (lambda line: print(line, flush=True))

    def __call__(self, done: int, total: int | None, detail: str = "", *, final: bool = False) -> None:
        now = self.clock()
        if not final and now - self.last < self.every and done != total:
            return
        self.last = now
        elapsed = now - self.start
        text = clean(f"{time.strftime('%H:%M:%S')} {self.description}: {done}")
        if total:
            text += f"/{total} {self.unit} ({100 * done / total:.0f}%)"
            if 0.05 * total <= done < total:  # earlier, the ETA is mostly start-up
                text += f", ETA {_clock(elapsed * (total - done) / done)}"
        else:
            text += f" {self.unit}"
        text += f", {_clock(elapsed)} elapsed"
        self.write(text + (f", {detail}" if detail else ""))


@contextlib.contextmanager
def rich_progress(description: str) -> Iterator:
    """Yield ``report(done, total, loss)``: a rich bar with ETA and the current loss, or log lines off a terminal."""
    if not on_terminal():
        lines = LogLines(description, "steps")
        state = {"done": 0, "total": None, "loss": float("nan")}

        def log(done: int, total: int, loss: float) -> None:
            state.update(done=done, total=total, loss=loss)
            lines(done, total, f"loss {loss:.4g}")

        yield log
        if state["done"] and state["done"] != state["total"]:
            lines(state["done"], state["total"], f"loss {state['loss']:.4g}", final=True)
        return
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("loss {task.fields[loss]:.4g}"), TimeElapsedColumn(), TimeRemainingColumn(),
                   transient=False)
    task = bar.add_task(_label(description), total=None, loss=float("nan"))

    def report(done: int, total: int, loss: float) -> None:
        bar.update(task, completed=done, total=total, loss=loss)

    with bar:
        yield report


@contextlib.contextmanager
def sweep_progress(total: int, done: int, name: str) -> Iterator[Callable[[str], None]]:
    """Yield ``advance(status)`` for each finished trial: a bar with counts per status, or log lines."""
    counts: dict[str, int] = {"done": 0, "failed": 0, "n/a": 0}

    def text() -> str:
        return " ".join(f"{k} {v}" for k, v in counts.items() if v)

    if not on_terminal():
        lines = LogLines(name, "trials")
        state = {"done": done}
        lines(done, total, "resuming" if done else "starting")

        def log(status: str) -> None:
            counts[status] = counts.get(status, 0) + 1
            state["done"] += 1
            lines(state["done"], total, text())

        yield log
        return
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[counts]}"), TimeElapsedColumn(), TextColumn("ETA"),
                   TimeRemainingColumn())
    task = bar.add_task(_label(name), total=total, completed=done, counts="")

    def advance(status: str) -> None:
        counts[status] = counts.get(status, 0) + 1
        bar.update(task, advance=1, counts=f"[dim]{text()}[/dim]")

    with bar:
        yield advance
