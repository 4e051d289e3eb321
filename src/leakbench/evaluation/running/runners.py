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
refused before any worker starts (:func:`unguarded_main_call`); should one slip through, its workers exit
with :data:`UNGUARDED_EXIT` and the pool raises the same :class:`~leakbench.errors.ConfigError`.
"""
from __future__ import annotations

import abc
import ast
import collections
import multiprocessing
import os
import sys
import threading
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator

from ... import plugins
from ...errors import ConfigError
from .chunks import batch_group, run_chunk, stack_size
from ..trials.trial import TrialResult, TrialSpec
from .workers import TrialActor, parent_marked, serve

#: the exit code of a spawned worker that found itself re-running an unguarded ``evaluate`` call of the script
UNGUARDED_EXIT = 79


def _guard_message(where: str) -> str:
    return (f"evaluate(..., workers > 1) is called from top-level code of the script ({where}), which every "
            "spawned worker re-runs; wrap the call in `if __name__ == \"__main__\":` (or use workers=1)")


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either operand order)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
        return False
    sides = [node.test.left, *node.test.comparators]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def unguarded_main_call() -> str | None:
    """``"script.py line 12"`` when this call comes from top-level code of the ``__main__`` script outside
    ``if __name__ == "__main__":`` (code a spawned worker re-runs), else None (a guarded call, a function
    called later, an interactive session or notebook, whose main module spawned workers do not re-run)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None
    outer = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            outer = frame
        frame = frame.f_back
    if outer is None:
        return None
    line = outer.f_lineno
    try:
        tree = ast.parse(Path(outer.f_code.co_filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            if _is_main_guard(node) and any(b.lineno <= line <= (b.end_lineno or b.lineno) for b in node.body):
                return None
            return f"{os.path.basename(path)} line {line}"
    return None


def in_spawned_main() -> bool:
    """True inside a spawned child while it re-runs the parent's main script as ``__mp_main__`` (its start-up,
    before ``multiprocessing.parent_process()`` is even set)."""
    if "__mp_main__" not in sys.modules:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


def refuse_unguarded_main() -> None:
    """Refuse to start worker processes from unguarded top-level code of the main script: a
    :class:`ConfigError` here, or (in a worker re-running that code) exit at once with :data:`UNGUARDED_EXIT`."""
    if in_spawned_main():
        raise SystemExit(UNGUARDED_EXIT)
    where = unguarded_main_call()
    if where is not None:
        raise ConfigError(_guard_message(where))


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


def _ray_module():
    try:
        import ray
    except ImportError:
        raise ConfigError("the Ray executor needs the ray extra: pip install 'leakbench[ray]' "
                          "(or run without --ray)") from None
    return ray


#: seconds a cluster address gets to accept a connection before ``--ray ADDRESS`` is refused.
CONNECT_SECONDS = 10.0


def _probe(address: str, timeout: float = CONNECT_SECONDS) -> None:
    """Refuse in at most ``timeout`` seconds a cluster address nothing listens on (Ray itself retries for minutes)."""
    import socket

    hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"expected --ray auto, local or HOST:PORT (ray://HOST:PORT), got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except (OSError, ValueError, OverflowError) as err:
        raise ConfigError(f"cannot connect to the Ray cluster at {address!r} within {timeout:g} s "
                          f"({getattr(err, 'strerror', None) or err}); start the cluster, or use --ray auto or "
                          "--ray local") from None


class RayRunner(Runner):
    """Trials on long-lived Ray actors; ``address`` is ``"local"`` (start a cluster here), ``"auto"`` (a
    running cluster, else a local one) or a cluster address (``ray://host:10001``, ``host:6379``).

    One actor per ``threads`` CPUs of the cluster (per GPU for CUDA trials; at most ``actors`` when given),
    created as trials need them; each actor runs chunks of trials and holds at most two.  Actors of one
    shape (CPUs, GPUs) at a time: a trial of another shape waits for the calls in flight, then the old
    actors give their resources back (a sweep's trials share ``threads`` and ``device``).
    """

    name = "ray"

    def __init__(self, address: str = "auto", *, num_cpus: int | None = None,
                 cache_dir: str | Path | None = None, actors: int | None = None,
                 chunk_seconds: float = 0.5) -> None:
        super().__init__(cache_dir=cache_dir)
        self.address = address
        self.num_cpus = num_cpus
        self.max_actors = actors
        self.sizer = ChunkSizer(chunk_seconds)
        self._started = False
        self._ray = _ray_module()
        self._actors: dict[tuple[int, int], list[list]] = {}  # (cpus, gpus) → [[handle, calls in flight]]
        self._limits: dict[tuple[int, int], int] = {}

    def _connect(self):
        ray = self._ray
        if ray.is_initialized():
            return ray
        options = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        # a cluster started here runs its actors at the driver's priority (Ray's default is nice 15, which
        # starves trials on a shared machine); a running cluster keeps its own setting
        local = dict(num_cpus=self.num_cpus, _system_config={"worker_niceness": 0}, **options)
        if self.address == "local":
            ray.init(**local)
            self._started = True
        elif self.address == "auto":
            try:
                ray.init(address="auto", **options)
            except (ConnectionError, RuntimeError):
                ray.init(**local)
                self._started = True
        else:
            _probe(self.address)
            try:
                ray.init(address=self.address, **options)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise ConfigError(f"cannot connect to the Ray cluster at {self.address!r} ({err}); "
                                  "use --ray auto, --ray local or a reachable address") from None
        return ray

    @staticmethod
    def resources(trial: TrialSpec) -> tuple[int, int]:
        """(CPUs, GPUs) an actor running ``trial`` asks for: the spec's ``threads``, one GPU for CUDA."""
        return max(1, int(trial.threads)), 1 if trial.device.startswith("cuda") else 0

    def _group(self, trial: TrialSpec) -> tuple:
        return self.resources(trial), self.sizer.shape(trial)

    def _limit(self, cpus: int, gpus: int) -> int:
        if (cpus, gpus) not in self._limits:
            total = self._ray.cluster_resources()
            n = int(total.get("CPU", 1) // cpus)
            if gpus:
                n = min(n, int(total.get("GPU", 0) // gpus))
            if self.max_actors is not None:
                n = min(n, self.max_actors)
            self._limits[(cpus, gpus)] = max(1, n)
        return self._limits[(cpus, gpus)]

    def _new_actor(self, cpus: int, gpus: int) -> list:
        remote = self._ray.remote(TrialActor).options(num_cpus=cpus, num_gpus=gpus)
        actor = [remote.remote(self.cache_dir, plugins.sources()), 0]
        self._actors.setdefault((cpus, gpus), []).append(actor)
        return actor

    def _actor(self, trial: TrialSpec) -> list:
        """The actor for ``trial``'s resources with the fewest calls in flight (a new one while there is room)."""
        cpus, gpus = self.resources(trial)
        actors = self._actors.setdefault((cpus, gpus), [])
        idle = [a for a in actors if a[1] == 0]
        if idle:
            return idle[0]
        if len(actors) < self._limit(cpus, gpus):
            return self._new_actor(cpus, gpus)
        return min(actors, key=lambda a: a[1])

    def start(self, *, threads: int = 1, device: str = "cpu", wait: bool = False) -> RayRunner:
        """Create every actor that trials with ``threads`` and ``device`` fit (they warm up in parallel)."""
        ray = self._connect()
        cpus, gpus = self.resources(TrialSpec(kind="attack", dataset="", model="", threads=threads, device=device))
        while len(self._actors.get((cpus, gpus), [])) < self._limit(cpus, gpus):
            self._new_actor(cpus, gpus)
        if wait:
            ray.get([a[0].ready.remote() for a in self._actors[(cpus, gpus)]])
        return self

    def run(self, trials: Iterable[TrialSpec]) -> Iterator[TrialResult]:
        ray = self._connect()
        source = iter(trials)
        ahead: TrialSpec | None = None
        exhausted = False

        def pull() -> TrialSpec | None:
            nonlocal exhausted
            trial = None if exhausted else next(source, None)
            exhausted = trial is None
            return trial
        running: dict[Any, tuple[list, list[TrialSpec]]] = {}
        try:
            while True:
                while not exhausted or ahead is not None:
                    ahead = ahead or pull()
                    if ahead is None:
                        break
                    others = [k for k in self._actors if k != self.resources(ahead) and self._actors[k]]
                    if others and running:  # one shape of actors at a time: let the others finish first
                        break
                    for k in others:  # ... then give their CPUs and GPUs back to the cluster
                        for old in list(self._actors[k]):
                            self._drop(old)
                    actor = self._actor(ahead)
                    if actor[1] >= 2:
                        break
                    # a chunk shares one actor's resources and one shape (timed alike)
                    chunk, ahead = _fill(ahead, self.sizer.size(ahead), pull, self._group)
                    self.sizer.sent(chunk)
                    running[actor[0].run.remote(chunk)] = (actor, chunk)
                    actor[1] += 1
                    self.submitted += len(chunk)
                if not running:
                    return
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    actor, chunk = running.pop(ref)
                    actor[1] -= 1
                    for result in self._results(ref, actor, chunk):
                        self.finished += 1
                        self.sizer.observe(result)
                        yield result
        except BaseException:  # Ctrl-C or the consumer stopped: actor calls cannot be cancelled, so kill
            for actor, _ in running.values():
                self._drop(actor)
            raise

    def _results(self, ref, actor: list, chunk: list[TrialSpec]) -> list[TrialResult]:
        try:
            return self._ray.get(ref)
        except Exception as err:  # the actor or its node died: the chunk's trials are failed, not lost
            from ray.exceptions import RayActorError

            if isinstance(err, RayActorError):
                self._drop(actor)
            return [_failed(t, f"ray actor failed: {type(err).__name__}: {err}") for t in chunk]

    def _drop(self, actor: list) -> None:
        for actors in self._actors.values():
            if actor in actors:
                actors.remove(actor)
                try:
                    self._ray.kill(actor[0])
                except Exception:  # already gone
                    pass

    def close(self) -> None:  # noqa: B027 (a no-op unless the runner holds processes or a cluster)
        if self._ray.is_initialized():
            for actors in list(self._actors.values()):
                for actor in list(actors):
                    self._drop(actor)
        self._actors = {}
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()
            self._started = False

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "address": self.address, "chunk": self.sizer.last,
                "actors": sum(len(a) for a in self._actors.values())}


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


__all__ = ["Runner", "InProcessRunner", "PoolRunner", "RayRunner", "ChunkSizer", "make_runner", "capped_workers",
           "cores", "refuse_unguarded_main", "unguarded_main_call", "UNGUARDED_EXIT"]
