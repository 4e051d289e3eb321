"""Local worker processes (:class:`PoolRunner`): each serves chunks of trials over a pipe, is restarted when
it dies, and a trial that kills its worker is failed with the reason."""
from __future__ import annotations

import collections
import multiprocessing
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any

from ... import plugins
from ...errors import ConfigError
from ..trials.trial import TrialResult, TrialSpec
from .chunks import batch_group
from .guard import UNGUARDED_EXIT, _guard_message, refuse_unguarded_main
from .runner import ChunkSizer, Runner, _failed, _fill
from .workers import parent_marked, serve


class _Worker:
    """One pool process, its pipe and the trials sent to it that have not come back (in order)."""

    def __init__(self, ctx, parent_pid: int, cache_dir: str | None, index: int) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        # the kernel's parent-death signal follows the thread that starts the process: only the main thread's
        kernel = threading.current_thread() is threading.main_thread()
        # the plug-ins loaded here, imported by the worker before its first trial
        self.process = ctx.Process(target=serve, args=(child, parent_pid, cache_dir, kernel, plugins.sources()),
                                   daemon=True,
                                   name=f"leakbench-worker-{index}")
        with parent_marked(parent_pid if kernel else None):  # dies with us even while it still imports torch
            self.process.start()
        child.close()
        self.pending: list[TrialSpec] = []
        self.ready = False

    def send(self, chunk: list[TrialSpec]) -> None:
        self.pending.extend(chunk)
        self.conn.send(chunk)

    def receive(self) -> list[TrialResult]:
        """Results waiting in the pipe (``ready`` notes are consumed; a closed pipe has none)."""
        out = []
        while True:
            try:
                if not self.conn.poll():
                    break
                kind, payload = self.conn.recv()
            except (EOFError, OSError):
                break
            if kind == "ready":
                self.ready = True
            else:
                index = next((i for i, t in enumerate(self.pending) if t.key == payload.key), None)
                if index is not None:
                    del self.pending[index]
                    out.append(payload)
        return out

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _check_exit(worker: _Worker) -> None:
    """A worker that exited re-running the script's unguarded ``evaluate`` call: refuse the sweep."""
    if worker.process.exitcode == UNGUARDED_EXIT:
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        raise ConfigError(_guard_message(os.path.basename(main) if main else "the main script"))


class PoolRunner(Runner):
    """Trials in ``workers`` long-lived spawned processes; each holds about two chunks (one running)."""

    name = "pool"

    def __init__(self, workers: int, *, cache_dir: str | Path | None = None, chunk_seconds: float = 0.25) -> None:
        super().__init__(cache_dir=cache_dir)
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ConfigError(f"expected --workers ≥ 1, got {workers!r}")
        self.workers = workers
        self.sizer = ChunkSizer(chunk_seconds)
        self._ctx = multiprocessing.get_context("spawn")
        self._pool: list[_Worker] = []
        self._spawned = 0
        self._requeued: collections.deque[TrialSpec] = collections.deque()

    def _spawn(self) -> _Worker:
        self._spawned += 1
        return _Worker(self._ctx, os.getpid(), self.cache_dir, self._spawned)

    def start(self, *, wait: bool = False) -> PoolRunner:
        """Start the workers (they warm up in parallel); with ``wait``, until each has said it is ready."""
        if len(self._pool) < self.workers:
            refuse_unguarded_main()
        while len(self._pool) < self.workers:
            self._pool.append(self._spawn())
        while wait and not all(w.ready for w in self._pool):
            wait_any([w.conn for w in self._pool if not w.ready] + [w.process.sentinel for w in self._pool])
            for w in self._pool:
                w.receive()
                if not w.ready and not w.process.is_alive():
                    _check_exit(w)
                    raise ConfigError(f"a pool worker failed to start (exit code {w.process.exitcode})")
        return self

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._pool]

    def run(self, trials: Iterable[TrialSpec]) -> Iterator[TrialResult]:
        self.start()
        self._requeued.clear()
        source = iter(trials)
        exhausted = False
        ahead: TrialSpec | None = None  # pulled (claimed) but not sent: it waits for room or its own chunk

        def pull() -> TrialSpec | None:
            nonlocal exhausted
            if self._requeued:
                return self._requeued.popleft()
            if exhausted:
                return None
            trial = next(source, None)
            exhausted = trial is None
            return trial

        try:
            while True:
                while True:  # top up the least-loaded worker, a chunk of one shape at a time
                    worker = min(self._pool, key=lambda w: len(w.pending))
                    ahead = ahead or pull()
                    if ahead is None:
                        break
                    n = self.sizer.size(ahead)
                    if len(worker.pending) > n:
                        break
                    # trials that batch: up to a stack for every worker with room; a group larger than one stack,
                    # or the sweep's last, is shared out evenly, a smaller one stays whole (a stack of its own)
                    free = sorted((w for w in self._pool if len(w.pending) <= n), key=lambda w: len(w.pending))
                    if batch_group(ahead) is None:
                        free = [worker]
                    chunk, ahead = _fill(ahead, n * len(free), pull, self.sizer.shape)
                    last = ahead is None and exhausted and not self._requeued
                    if len(chunk) <= n and not last:
                        free = [worker]
                    parts = min(len(free), len(chunk))
                    for w, i in zip(free, range(parts)):
                        part = chunk[len(chunk) * i // parts:len(chunk) * (i + 1) // parts]
                        self._send(w, part)
                        self.sizer.sent(part)
                    self.submitted += len(chunk)
                busy = [w for w in self._pool if w.pending]
                if not busy:
                    return
                wait_any([w.conn for w in busy] + [w.process.sentinel for w in busy])
                for i, worker in enumerate(list(self._pool)):
                    for result in self._collect(i, worker):
                        self.finished += 1
                        self.sizer.observe(result)
                        yield result
        except BaseException:  # Ctrl-C, or the consumer stopped: the sweep gives the claims back
            if any(w.pending for w in self._pool):
                self._terminate()
            raise

    def _send(self, worker: _Worker, chunk: list[TrialSpec]) -> None:
        try:
            worker.send(chunk)
        except OSError:  # the worker died while idle: a fresh one takes the chunk
            worker.pending.clear()
            worker.kill()
            worker = self._pool[self._pool.index(worker)] = self._spawn()
            worker.send(chunk)

    def _collect(self, index: int, worker: _Worker) -> list[TrialResult]:
        results = worker.receive()
        if worker.pending and not worker.process.is_alive():  # died mid-trial: that trial failed, not lost
            _check_exit(worker)
            code = worker.process.exitcode
            results.append(_failed(worker.pending[0], f"worker process died (exit code {code}) in this trial"))
            self._requeued.extend(worker.pending[1:])  # queued behind it, never started: run elsewhere
            worker.pending.clear()
            worker.kill()
            self._pool[index] = self._spawn()
        return results

    def _terminate(self) -> None:
        for w in self._pool:
            w.kill()
        self._pool = []

    def close(self) -> None:
        """Stop the workers: at once if trials are still in flight, else after they finish their loop."""
        if any(w.pending for w in self._pool):
            self._terminate()
            return
        for w in self._pool:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._pool:
            w.process.join(timeout=10)
            w.kill()
        self._pool = []

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "workers": self.workers, "chunk": self.sizer.last}


__all__ = ["PoolRunner"]
