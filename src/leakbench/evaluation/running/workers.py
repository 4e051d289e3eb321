"""The worker side of the executors: warm start, dying with the parent, serving chunks of trials.

A pool worker (:func:`serve`) and a Ray actor (:class:`TrialActor`) are long-lived: they import torch and
everything a trial imports lazily once (:func:`warm_up`), and keep the datasets and trained models that
:mod:`.trial` caches per process between trials.  A pool worker takes trials in chunks from a pipe and
sends each result back the moment it finishes, so the parent still commits one trial at a time; trials of
one batch group run as one batched call (:func:`~.chunks.run_chunk`), their results sent as it ends.

A pool worker dies with its parent, even after ``kill -9`` of the parent: on Linux the kernel sends it
SIGKILL (``prctl(PR_SET_PDEATHSIG)``); everywhere a watchdog thread exits when the parent pid changes
(the orphan is re-parented), and an idle worker exits when its pipe closes.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from ... import plugins
from ...errors import LeakbenchError
from .chunks import run_chunk
from ..trials.trial import TrialResult, TrialSpec, worker_id

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
PR_SET_PDEATHSIG = 1
#: modules a trial imports on first use (``torch._dynamo`` alone is ≈ 3 s, pulled in by ``torch.optim``).
WARM_MODULES = ("leakbench.data", "leakbench.models", "leakbench.threat", "leakbench.attacks",
                "leakbench.metrics", "torch._dynamo")


def die_with_parent(parent_pid: int, *, kernel: bool = True, interval: float = 0.5) -> bool:
    """Make this process exit when ``parent_pid`` dies; returns whether the kernel (Linux) will signal it.

    ``kernel=False`` skips ``PR_SET_PDEATHSIG``, which fires when the *thread* that started this process
    ends: right only when the main thread started it.
    """
    armed = False
    if kernel and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="leakbench-parent-watch", daemon=True).start()
    return armed


@contextlib.contextmanager
def parent_marked(parent_pid: int | None) -> Iterator[None]:
    """Processes started inside carry ``LEAKBENCH_PARENT_PID``: :mod:`leakbench._startup` arms their death
    with the parent before the first heavy import, so a worker still starting never outlives its sweep
    (``None``: no mark, for a process started off the main thread, where the kernel signal misfires)."""
    from ..._startup import PARENT_ENV

    if parent_pid is None:
        yield
        return
    with _ENV_LOCK:
        before = os.environ.get(PARENT_ENV)
        os.environ[PARENT_ENV] = str(parent_pid)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(PARENT_ENV, None)
            else:
                os.environ[PARENT_ENV] = before


_ENV_LOCK = threading.Lock()


def warm_up() -> None:
    """Import what the first trial would import lazily (several seconds that every worker pays once)."""
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional piece missing here fails in the trial that needs it, with its message
            pass


def _send(conn, message: Any) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionError, EOFError, OSError):
        os._exit(0)  # the parent is gone: nobody is left to commit the result


def load_plugins(sources) -> None:
    """The parent's plug-ins (:func:`leakbench.plugins.sources`), imported before any trial; one that fails here
    fails the trials that use it, with its one line (:func:`leakbench.plugins.ensure`)."""
    for item in sources or ():
        with contextlib.suppress(LeakbenchError):
            plugins.load_sources([item])


def serve(conn, parent_pid: int, cache_dir: str | None, kernel: bool = True, plugin_sources=()) -> None:
    """A pool worker's loop: receive a chunk (a list of trials, ``None`` to stop), send back each result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it gives back the claims
    die_with_parent(parent_pid, kernel=kernel)
    warm_up()
    load_plugins(plugin_sources)
    _send(conn, ("ready", worker_id()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for result in run_chunk(chunk, cache_dir=cache_dir):  # trials of one batch group solved together
            try:
                _send(conn, ("result", result))
            except Exception as err:  # the result does not pickle: the trial failed, the worker goes on
                _send(conn, ("result", TrialResult(key=result.key, status="failed", worker=worker_id(),
                                                   error=f"result not sendable: {type(err).__name__}: {err}")))


def ray_device(trial: TrialSpec) -> TrialSpec:
    """Ray shows an actor only its own GPUs, as ``cuda:0``…: ``cuda:N`` becomes ``cuda`` (not part of the key)."""
    if trial.device.startswith("cuda") and trial.device != "cuda":
        import dataclasses

        return dataclasses.replace(trial, device="cuda")
    return trial


class TrialActor:
    """A Ray actor that runs chunks of trials (decorated with ``ray.remote`` by the Ray executor)."""

    def __init__(self, cache_dir: str | Path | None = None, plugin_sources=()) -> None:
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        warm_up()
        load_plugins(plugin_sources)

    def ready(self) -> str:
        return worker_id()

    def run(self, trials: list[TrialSpec]) -> list[TrialResult]:
        return list(run_chunk([ray_device(t) for t in trials], cache_dir=self.cache_dir))


__all__ = ["die_with_parent", "warm_up", "load_plugins", "serve", "TrialActor", "ray_device", "WARM_MODULES"]
