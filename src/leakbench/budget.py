"""Time budgets for loops that a user value sizes: :func:`time_limit` sets one, :func:`check_time` enforces it.

A training run (``epochs``, ``steps``) or any other loop whose length comes from a spec, a file or a client
calls :func:`check_time` once per step; inside a :func:`time_limit` block that has run out it raises
:class:`~leakbench.errors.BudgetExceeded` naming the budget, so a careless ``epochs: 1000000`` ends at the
budget as a ``timed out`` trial instead of running for days.  Limits nest (the earliest deadline wins) and live
in a context variable, so threads and nested calls see their own.  Deadlines are wall-clock times
(``time.time()``): a sweep hands its end time to worker processes as a number.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextvars import ContextVar

from .errors import BudgetExceeded

#: (deadline as time.time(), what set it), or None: no limit
_LIMIT: ContextVar[tuple[float, str] | None] = ContextVar("leakbench_time_limit", default=None)


@contextlib.contextmanager
def time_limit(seconds: float | None = None, what: str = "the time budget", *,
               until: float | None = None) -> Iterator[None]:
    """Within the block, :func:`check_time` raises once ``seconds`` have passed (or wall-clock time ``until``);
    None for both: no new limit.  An enclosing earlier deadline stays in force."""
    deadline = math.inf
    if seconds is not None:
        deadline = time.time() + float(seconds)
    if until is not None:
        deadline = min(deadline, float(until))
    outer = _LIMIT.get()
    if math.isinf(deadline) or (outer is not None and outer[0] <= deadline):
        yield
        return
    token = _LIMIT.set((deadline, what))
    try:
        yield
    finally:
        _LIMIT.reset(token)


def check_time(doing: str = "") -> None:
    """Raise :class:`BudgetExceeded` when the innermost :func:`time_limit` has run out (cheap: call it per step)."""
    limit = _LIMIT.get()
    if limit is not None and time.time() > limit[0]:
        raise BudgetExceeded(f"{doing + ': ' if doing else ''}ran past {limit[1]}")


def seconds_left() -> float:
    """Seconds until the innermost deadline (inf without one)."""
    limit = _LIMIT.get()
    return math.inf if limit is None else limit[0] - time.time()


def memory_available() -> tuple[float, str]:
    """(bytes this process may still allocate, what bounds it): the least of the address-space limit
    (``RLIMIT_AS``, e.g. ``ulimit -v``) less what the process maps, the cgroup's ``memory.max`` less its use,
    and the machine's ``MemAvailable``; (inf, "") when none can be read."""
    found: list[tuple[float, str]] = []
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft not in (resource.RLIM_INFINITY, -1):
            mapped = 0
            with open("/proc/self/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmSize:"):
                        mapped = int(line.split()[1]) * 1024
            found.append((soft - mapped, "the process's memory limit (RLIMIT_AS)"))
    except (ImportError, OSError, ValueError):
        pass
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit, encoding="ascii") as f:
                text = f.read().strip()
            if text != "max" and int(text) < 1 << 60:
                with open(used, encoding="ascii") as f:
                    found.append((int(text) - int(f.read().strip()), "the container's memory limit (cgroup)"))
                break
        except (OSError, ValueError):
            continue
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "the machine's available memory"))
    except (OSError, ValueError):
        pass
    return min(found) if found else (math.inf, "")


__all__ = ["time_limit", "check_time", "seconds_left", "memory_available"]
