"""A rich progress bar usable as a ``progress(done, total, loss)`` callback."""
from __future__ import annotations

import contextlib
from typing import Iterator

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextlib.contextmanager
def rich_progress(description: str) -> Iterator:
    """Yield ``report(done, total, loss)`` that drives a rich bar with ETA and the current loss."""
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("loss {task.fields[loss]:.4g}"), TimeElapsedColumn(), TimeRemainingColumn(),
                   transient=False)
    task = bar.add_task(description, total=None, loss=float("nan"))

    def report(done: int, total: int, loss: float) -> None:
        bar.update(task, completed=done, total=total, loss=loss)

    with bar:
        yield report
