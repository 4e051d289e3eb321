"""Executors: run trials and stream their results back as they finish.

- :class:`InProcessRunner` — one after the other in this process (``workers=1``).
- :class:`PoolRunner` — ``workers`` long-lived spawned processes (warm: torch and the trial's imports
  loaded once, datasets and trained models cached between trials), which die with their parent.
- :class:`RayRunner` — long-lived Ray actors on a local or remote cluster (``pip install 'leakbench[ray]'``),
  each asking for ``threads`` CPUs (and one GPU when the trial's device is CUDA).

``runner.run(trials)`` pulls trials from an iterable only when it has room, so the sweep claims a trial in
the store just before it is submitted, and yields :class:`~.trial.TrialResult` objects in completion order.
Short trials travel in chunks of one shape (as many as fill ``chunk_seconds``, from the mean time of the
trials of that shape so far: :class:`ChunkSizer`), and trials that batch (:func:`~.chunks.batch_group`: the
gradient-matching attacks, utility seeds) in chunks of at least a stack (:func:`~.chunks.stack_size`), which
the worker solves as one batched call (:func:`~.chunks.run_chunk`; a pool shares a stack out evenly among
its workers with room);
a pool worker still sends each result back the moment it finishes, a Ray actor returns a chunk at once —
either way the sweep commits one trial per transaction.  Every trial runs :func:`~.run.run_trial`, which
fixes its seeds and thread count, so all executors give the same results.

The pool is hand-made rather than ``concurrent.futures.ProcessPoolExecutor`` or loky because it streams each
trial's result back the moment it finishes (not per submitted chunk), keeps long-lived spawned workers whose
imports, datasets and trained models stay warm, and when a worker dies fails only the trial it was running,
re-queues the rest of its chunk to the others and spawns a replacement (a broken ``ProcessPoolExecutor``
fails every pending future).

Spawned workers re-run the main script's top-level code (``multiprocessing``'s spawn start method), so a
script that calls :func:`~.sweep.evaluate` with ``workers > 1`` outside ``if __name__ == "__main__":`` is
refused before any worker starts (:func:`~.guard.unguarded_main_call`); should one slip through, its workers exit
with :data:`~.guard.UNGUARDED_EXIT` and the pool raises the same :class:`~leakbench.errors.ConfigError`.
"""
from __future__ import annotations

import os
from pathlib import Path

from ...errors import ConfigError
from .pool import PoolRunner
from .ray_runner import RayRunner
from .runner import InProcessRunner, Runner


def cores() -> int:
    """CPU cores this process may run on (its affinity where the platform tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def capped_workers(workers: int, trials: int | None = None) -> tuple[int, str | None]:
    """``workers`` capped at the cores (and at ``trials``), and the line saying so (None when not capped)."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"expected --workers ≥ 1, got {workers!r}")
    limit = cores() if trials is None else max(1, min(cores(), trials))
    if workers <= limit:
        return workers, None
    why = f"{cores()} core(s)" + (f" and {trials} trial(s) to run" if trials is not None else "")
    return limit, f"--workers {workers} capped at {limit} ({why}): more processes only compete for the same cores"


def make_runner(*, workers: int = 1, ray: str | None = None, cache_dir: str | Path | None = None,
                num_cpus: int | None = None) -> Runner:
    """The executor for ``--workers``/``--ray``: Ray when ``ray`` is given, else a pool for ``workers > 1``
    (never more processes than cores: :func:`capped_workers`)."""
    if ray is not None:
        return RayRunner(ray, num_cpus=num_cpus, cache_dir=cache_dir)
    workers, _ = capped_workers(workers)
    return InProcessRunner(cache_dir=cache_dir) if workers == 1 else PoolRunner(workers, cache_dir=cache_dir)


__all__ = ["make_runner", "capped_workers", "cores"]
