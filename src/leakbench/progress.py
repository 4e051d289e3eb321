"""Progress of long work: a rich bar on a terminal, periodic log lines when output goes to a file.

``rich_progress`` yields the ``progress(done, total, loss)`` callback the attacks take; ``sweep_progress``
yields ``advance(status)`` for a sweep's trials.  When stdout is not a terminal (a batch job, ``> log``),
a bar would stay silent until the end, so both print one line at the start, then at most one every
``LEAKBENCH_PROGRESS_EVERY`` seconds (default 8, also while one step takes longer), and one at the end.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn

__all__ = ["rich_progress", "sweep_progress", "LogLines", "on_terminal", "clean", "keep_partial", "keep_here"]

#: None: a Ctrl-C propagates as usual; a dict: long work stops at it, keeps its best so far and says where here
_PARTIAL: ContextVar[dict | None] = ContextVar("leakbench_keep_partial", default=None)


@contextlib.contextmanager
def keep_partial() -> Iterator[dict]:
    """Within the block a Ctrl-C stops long work (gradient matching) with its best result so far instead of
    discarding it; the yielded dict then holds ``"stopped"`` (where).  The caller still exits as interrupted
    (``leakbench attack`` saves the partial result and exits 130).  A sweep never sets this: Ctrl-C stops it."""
    state: dict = {}
    token = _PARTIAL.set(state)
    try:
        yield state
    finally:
        _PARTIAL.reset(token)


def keep_here(where: str) -> bool:
    """Called on a Ctrl-C: True (and ``where`` recorded) when the caller keeps partial results."""
    state = _PARTIAL.get()
    if state is None:
        return False
    state["stopped"] = where
    return True


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


#: a run estimated longer than this (seconds) is announced with the cheaper way (:func:`rich_progress`)
WARN_SECONDS = 300.0
#: seconds between log lines (``LEAKBENCH_PROGRESS_EVERY``); with the heartbeat every EVERY / 8 s a line comes at
#: most 9 s after the last, however long one step takes
EVERY = 8.0


def _every() -> float:
    try:
        value = float(os.environ.get("LEAKBENCH_PROGRESS_EVERY", str(EVERY)))
    except ValueError:
        return EVERY
    return value if math.isfinite(value) and value >= 0 else EVERY


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

    def __call__(self, done: int, total: int | None, detail: str = "", *, final: bool = False,
                 eta: float | None = None) -> None:
        now = self.clock()
        if not final and now - self.last < self.every and done != total:
            return
        self.last = now
        elapsed = now - self.start
        text = clean(f"{time.strftime('%H:%M:%S')} {self.description}: {done}")
        if total:
            text += f"/{total} {self.unit} ({100 * done / total:.0f}%)"
            if eta is not None and done < total:  # the caller's estimate (weighted by measured costs)
                text += f", ETA {_clock(eta)}"
            elif 0.05 * total <= done < total:  # earlier, the ETA is mostly start-up
                text += f", ETA {_clock(elapsed * (total - done) / done)}"
        else:
            text += f" {self.unit}"
        text += f", {_clock(elapsed)} elapsed"
        self.write(text + (f", {detail}" if detail else ""))


@contextlib.contextmanager
def rich_progress(description: str, *, advice: str = "", warn_after: float = WARN_SECONDS) -> Iterator:
    """Yield ``report(done, total, loss)``: a rich bar with ETA and the current loss, or log lines off a terminal
    (one at most every ``LEAKBENCH_PROGRESS_EVERY`` seconds, default 8, and one within 9 s however long a step).

    After the first steps it times them and, when the whole run would take more than ``warn_after`` seconds,
    says so once, with ``advice`` (the cheaper way)."""
    estimate = _Estimate(description, advice, warn_after)
    if not on_terminal():
        lines = LogLines(description, "steps")
        state = {"done": 0, "total": None, "loss": float("nan")}

        def log(done: int, total: int, loss: float) -> None:
            state.update(done=done, total=total, loss=loss)
            lines(done, total, f"loss {loss:.4g}")
            estimate(done, total, lines.write)

        def beat() -> None:  # a step longer than the period still gives a line
            lines(state["done"], state["total"], f"step {state['done'] + 1} running, loss {state['loss']:.4g}")

        with _Heartbeat(beat, lines.every / 8):
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
        estimate(done, total, lambda line: bar.console.print(line, style="yellow", markup=False, highlight=False))

    with bar:  # the bar redraws its elapsed time ten times a second, however long a step takes
        yield report


class _Estimate:
    """After a few steps (≥ 3 and ≥ 1 s), the time the whole run will take; said once if above ``warn_after``."""

    def __init__(self, description: str, advice: str, warn_after: float) -> None:
        self.description, self.advice, self.warn_after = description, advice, warn_after
        self.start = time.monotonic()
        self.said = False

    def __call__(self, done: int, total: int | None, write: Callable[[str], None]) -> None:
        if self.said or not total or done < 3 or done >= total:
            return
        elapsed = time.monotonic() - self.start
        if elapsed < 1.0:
            return
        whole = elapsed / done * total
        self.said = True
        if whole > self.warn_after:
            write(clean(f"{self.description}: this run will take about {_clock(whole)} ({total:,} steps at "
                        f"{elapsed / done:.3g} s a step)" + (f"; {self.advice}" if self.advice else "")))


class _Heartbeat:
    """Calls ``beat()`` every ``period`` seconds from a daemon thread while the block runs (``period`` 0: never)."""

    def __init__(self, beat: Callable[[], None], period: float) -> None:
        self.beat, self.period = beat, period
        self.stop = threading.Event()

    def __enter__(self) -> _Heartbeat:
        if self.period > 0:
            self.thread = threading.Thread(target=self._run, daemon=True, name="leakbench-heartbeat")
            self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            self.beat()

    def __exit__(self, *exc) -> None:
        self.stop.set()


@contextlib.contextmanager
def sweep_progress(total: int, done: int, name: str, *,
                   eta: Callable[[], float | None] | None = None) -> Iterator[Callable[[str], None]]:
    """Yield ``advance(status)`` for each finished trial: a bar with counts per status, or log lines.

    ``eta()``: seconds left (weighted by the trials' measured costs, :class:`~leakbench.evaluation.running.eta
    .CostEstimate`), shown instead of the count-based ETA."""
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
            left = eta() if eta is not None else None
            lines(state["done"], total, text(), eta=left)

        yield log
        return
    remaining = TextColumn("{task.fields[eta]}") if eta is not None else TimeRemainingColumn()
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[counts]}"), TimeElapsedColumn(), TextColumn("ETA"), remaining)
    task = bar.add_task(_label(name), total=total, completed=done, counts="", eta="-:--:--")

    def advance(status: str) -> None:
        counts[status] = counts.get(status, 0) + 1
        left = eta() if eta is not None else None
        bar.update(task, advance=1, counts=f"[dim]{text()}[/dim]",
                   eta=_clock(left) if left is not None else "-:--:--")

    with bar:
        yield advance
