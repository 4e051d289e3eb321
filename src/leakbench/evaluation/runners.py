"""Executors: run trials and stream their results back as they finish.

- :class:`InProcessRunner` — one after the other in this process (``workers=1``).
- :class:`PoolRunner` — a pool of ``workers`` spawned processes.
- :class:`RayRunner` — Ray tasks on a local or remote cluster (``pip install 'leakbench[ray]'``),
  each asking for ``threads`` CPUs (and one GPU when the trial's device is CUDA).

``runner.run(trials)`` pulls trials from an iterable only when it has room, so
the sweep claims a trial in the store just before it is submitted, and yields
:class:`~.trial.TrialResult` objects in completion order.  Every trial runs
:func:`~.trial.run_trial`, which fixes its seeds and thread count, so all
executors give the same results.
"""
from __future__ import annotations

import abc
import multiprocessing
import signal
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from ..errors import ConfigError
from .trial import TrialResult, TrialSpec, run_trial


class Runner(abc.ABC):
    """Runs trials; yields results in completion order."""

    name = "runner"

    def __init__(self, *, cache_dir: "str | Path | None" = None) -> None:
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        self.submitted = 0
        self.finished = 0

    @abc.abstractmethod
    def run(self, trials: Iterable[TrialSpec]) -> Iterator[TrialResult]:
        """Run ``trials`` (pulled lazily), yielding each result as it finishes."""

    def close(self) -> None:
        """Release processes or the cluster connection."""

    def state_dict(self) -> dict[str, Any]:
        return {"runner": self.name, "submitted": self.submitted, "finished": self.finished}

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InProcessRunner(Runner):
    """Trials one after the other in this process."""

    name = "local"

    def run(self, trials: Iterable[TrialSpec]) -> Iterator[TrialResult]:
        for trial in trials:
            self.submitted += 1
            result = run_trial(trial, cache_dir=self.cache_dir)
            self.finished += 1
            yield result


def _quiet_worker() -> None:
    """Pool workers leave Ctrl-C to the parent, which stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class PoolRunner(Runner):
    """Trials in a pool of ``workers`` spawned processes (at most ``2 × workers`` submitted at once)."""

    name = "pool"

    def __init__(self, workers: int, *, cache_dir: "str | Path | None" = None) -> None:
        super().__init__(cache_dir=cache_dir)
        if not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"expected --workers ≥ 1, got {workers!r}")
        self.workers = workers
        self._pool: Optional[ProcessPoolExecutor] = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_quiet_worker)
        return self._pool

    def run(self, trials: Iterable[TrialSpec]) -> Iterator[TrialResult]:
        pool = self._executor()
        source = iter(trials)
        running: dict[Future, TrialSpec] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and len(running) < 2 * self.workers:
                    trial = next(source, None)
                    if trial is None:
                        exhausted = True
                        break
                    running[pool.submit(run_trial, trial, cache_dir=self.cache_dir)] = trial
                    self.submitted += 1
                if not running:
                    return
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in done:
                    trial = running.pop(future)
                    self.finished += 1
                    try:
                        result = future.result()
                    except Exception as err:  # the worker process died: the trial is failed, not lost
                        result = TrialResult(key=trial.key, status="failed",
                                             error=f"worker process failed: {type(err).__name__}: {err}")
                    yield result
        except BaseException:
            self._terminate()
            raise

    def _terminate(self) -> None:
        if self._pool is not None:
            processes = list(getattr(self._pool, "_processes", {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for p in processes:
                if p.is_alive():
                    p.terminate()
            self._pool = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "workers": self.workers}


def _ray_module():
    try:
        import ray
    except ImportError:
        raise ConfigError("the Ray executor needs the ray extra: pip install 'leakbench[ray]' "
                          "(or run without --ray)") from None
    return ray


class RayRunner(Runner):
    """Trials as Ray tasks; ``address`` is ``"local"`` (start one here), ``"auto"`` (a running cluster,
    else a local one) or a cluster address (``ray://host:10001``, ``host:6379``)."""

    name = "ray"

    def __init__(self, address: str = "auto", *, num_cpus: Optional[int] = None,
                 cache_dir: "str | Path | None" = None, in_flight: Optional[int] = None) -> None:
        super().__init__(cache_dir=cache_dir)
        self.address = address
        self.num_cpus = num_cpus
        self.in_flight = in_flight
        self._started = False
        self._ray = _ray_module()

    def _connect(self):
        ray = self._ray
        if ray.is_initialized():
            return ray
        options = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        if self.address == "local":
            ray.init(num_cpus=self.num_cpus, **options)
            self._started = True
        elif self.address == "auto":
            try:
                ray.init(address="auto", **options)
            except (ConnectionError, RuntimeError):
                ray.init(num_cpus=self.num_cpus, **options)
                self._started = True
        else:
            try:
                ray.init(address=self.address, **options)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise ConfigError(f"cannot connect to the Ray cluster at {self.address!r} ({err}); "
                                  "use --ray auto, --ray local or a reachable address") from None
        return ray

    def run(self, trials: Iterable[TrialSpec]) -> Iterator[TrialResult]:
        ray = self._connect()
        task = ray.remote(run_trial)
        capacity = self.in_flight or max(1, int(ray.cluster_resources().get("CPU", 1))) * 2
        source = iter(trials)
        running: dict[Any, TrialSpec] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and len(running) < capacity:
                    trial = next(source, None)
                    if trial is None:
                        exhausted = True
                        break
                    gpus = 1 if trial.device.startswith("cuda") else 0
                    ref = task.options(num_cpus=max(1, trial.threads), num_gpus=gpus).remote(
                        trial, cache_dir=self.cache_dir)
                    running[ref] = trial
                    self.submitted += 1
                if not running:
                    return
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    trial = running.pop(ref)
                    self.finished += 1
                    try:
                        result = ray.get(ref)
                    except Exception as err:  # task or worker failure: recorded as a failed trial
                        result = TrialResult(key=trial.key, status="failed",
                                             error=f"ray task failed: {type(err).__name__}: {err}")
                    yield result
        except BaseException:
            for ref in running:
                ray.cancel(ref, force=True)
            raise

    def close(self) -> None:
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()
            self._started = False

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "address": self.address}


def make_runner(*, workers: int = 1, ray: Optional[str] = None, cache_dir: "str | Path | None" = None,
                num_cpus: Optional[int] = None) -> Runner:
    """The executor for ``--workers``/``--ray``: Ray when ``ray`` is given, else a pool for ``workers > 1``."""
    if ray is not None:
        return RayRunner(ray, num_cpus=num_cpus, cache_dir=cache_dir)
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"expected --workers ≥ 1, got {workers!r}")
    return InProcessRunner(cache_dir=cache_dir) if workers == 1 else PoolRunner(workers, cache_dir=cache_dir)


__all__ = ["Runner", "InProcessRunner", "PoolRunner", "RayRunner", "make_runner"]
