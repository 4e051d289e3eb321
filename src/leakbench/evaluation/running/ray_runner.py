"""Ray actors as executors (:class:`RayRunner`): a local cluster or one at an address, probed first, every
actor importing the sweep's plug-ins before it resolves a name."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ... import plugins
from ...errors import ConfigError
from ..trials.trial import TrialResult, TrialSpec
from .runner import ChunkSizer, Runner, _failed, _fill
from .workers import TrialActor


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


__all__ = ["RayRunner"]
