"""The executor contract (:class:`Runner`), the in-process executor, and how trials are grouped into chunks
(:class:`ChunkSizer`: trials of one batch share a chunk, whose size follows the measured trial seconds)."""
from __future__ import annotations

import abc
import collections
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..trials.trial import TrialResult, TrialSpec
from .chunks import batch_group, run_chunk, stack_size


class Runner(abc.ABC):
    """Runs trials; yields results in completion order."""

    name = "runner"

    def __init__(self, *, cache_dir: str | Path | None = None) -> None:
        # absolute: a Ray actor's working directory is not the driver's
        self.cache_dir = None if cache_dir is None else os.path.abspath(cache_dir)
        self.submitted = 0
        self.finished = 0

    @abc.abstractmethod
    def run(self, trials: Iterable[TrialSpec]) -> Iterator[TrialResult]:
        """Run ``trials`` (pulled lazily), yielding each result as it finishes."""

    def close(self) -> None:  # noqa: B027 (a no-op unless the runner holds processes or a cluster)
        """Release processes or the cluster connection."""

    def state_dict(self) -> dict[str, Any]:
        return {"runner": self.name, "submitted": self.submitted, "finished": self.finished}

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InProcessRunner(Runner):
    """Trials in this process: those that batch (:func:`~.chunks.batch_group`) in chunks of
    :func:`~.chunks.stack_size` solved together, the others one after the other."""

    name = "local"

    def run(self, trials: Iterable[TrialSpec]) -> Iterator[TrialResult]:
        source = iter(trials)
        ahead: TrialSpec | None = None  # pulled (so claimed) by the last fill, heads the next chunk
        while True:
            ahead = ahead or next(source, None)  # a full chunk pulls nothing ahead: a kill loses only the chunk
            if ahead is None:
                return
            chunk, ahead = _fill(ahead, stack_size(ahead), lambda: next(source, None), _batch_key)
            self.submitted += len(chunk)
            for result in run_chunk(chunk, cache_dir=self.cache_dir):
                self.finished += 1
                yield result


def _batch_key(trial: TrialSpec) -> object:
    """A trial's batch group (a trial that runs alone is a group of its own)."""
    return batch_group(trial) or ("alone", trial.key)


class ChunkSizer:
    """How many trials of one shape to send at once: enough to fill ``seconds`` at the mean time of the last
    trials of that shape.  A trial's shape is what sets its length, seeds and images aside (kind, data,
    model, defense, batch size, attack and its options): a sweep mixes 0.01 s analytic attacks with
    minutes of gradient matching, and a chunk sized on the first would hand one worker a pile of the second
    while the others idle.  A shape not timed yet goes one trial at a time."""

    def __init__(self, seconds: float, *, most: int = 16, window: int = 32) -> None:
        self.seconds, self.most, self.window = float(seconds), int(most), int(window)
        self.recent: dict[tuple, collections.deque[float]] = {}
        self._shapes: dict[str, tuple] = {}
        self.last = 1

    @staticmethod
    def shape(trial: TrialSpec | None) -> tuple:
        if trial is None:
            return ()
        return (trial.kind, trial.dataset_key or trial.dataset, trial.model_key or trial.model, trial.defense,
                trial.batch_size, trial.attack_key or trial.attack, trial.preset,
                repr(sorted(trial.options.items())) if isinstance(trial.options, dict) else repr(trial.options))

    def sent(self, chunk: list[TrialSpec]) -> None:
        """Remember the shapes of trials handed to a worker (their results are timed under that shape)."""
        for trial in chunk:
            self._shapes[trial.key] = self.shape(trial)

    def observe(self, result: TrialResult) -> None:
        shape = self._shapes.pop(result.key, ())
        self.recent.setdefault(shape, collections.deque(maxlen=self.window)).append(max(result.seconds, 1e-4))

    def size(self, trial: TrialSpec | None = None) -> int:
        """Trials to send at once: enough to fill ``seconds``, and at least a stack of trials that batch."""
        recent = self.recent.get(self.shape(trial))
        if not recent or self.seconds <= 0:
            self.last = 1
        else:
            self.last = max(1, min(self.most, int(self.seconds / (sum(recent) / len(recent)))))
        if trial is not None:
            self.last = max(self.last, stack_size(trial))
        return self.last


def _fill(first: TrialSpec, size: int, pull: Callable[[], TrialSpec | None],
          group: Callable[[TrialSpec], object]) -> tuple[list[TrialSpec], TrialSpec | None]:
    """A chunk: ``first`` and the trials ``pull`` gives after it while they share its ``group``, up to
    ``size``; the first one of another group comes back (pulled, so claimed: it heads the next chunk)."""
    chunk, want = [first], group(first)
    while len(chunk) < size:
        trial = pull()
        if trial is None or group(trial) != want:
            return chunk, trial
        chunk.append(trial)
    return chunk, None


def _failed(trial: TrialSpec, why: str) -> TrialResult:
    return TrialResult(key=trial.key, status="failed", error=why)


__all__ = ["Runner", "InProcessRunner", "ChunkSizer"]
