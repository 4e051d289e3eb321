"""Several independent attacks at once: :func:`attack_batch`.

Trials that share a shape — the model's weights, the attack and its options, the batch size — but not
their images, seeds or defense draws are independent problems.  Attacks that can solve them together
(the gradient-matching engine: Inverting Gradients, DLG with Adam or SGD, liu2024 on pixels without the
tensor-feature term; :mod:`.batched_matching`) stack them into one optimisation; every other attack, and
every problem a stack refuses (L-BFGS, the BN prior), runs one after the other.  Each problem's result
equals what :func:`~.base.attack` returns for the same observation and seed, up to float rounding.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, UnsupportedThreatModel
from ..threat import Observation
from .base import Progress, Reconstruction, create


def attack_batch(name: str, observations: Sequence[Observation], *, seeds: Sequence[int] | None = None,
                 preset: str | None = None, progress: Progress | None = None,
                 **options: Any) -> list[Reconstruction | Exception]:
    """Run attack ``name`` on every observation (observation i with ``seeds[i]``, default 0 each).

    Returns one entry per observation: its :class:`Reconstruction`, or the exception that stopped it (an
    unmet requirement is an :class:`~leakbench.errors.UnsupportedThreatModel`), so one failure never costs
    the others their results.  ``progress(done, total, loss)`` reports the shared optimisation.
    """
    observations = list(observations)
    bad = next((type(o).__name__ for o in observations if not isinstance(o, Observation)), None)
    if bad is not None:
        raise ConfigError(f"expected Observations (from leakbench.observe), got a {bad} (argument observations)")
    seeds = [0] * len(observations) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(observations):
        raise ConfigError(f"expected one seed per observation ({len(observations)}), got {len(seeds)} "
                          "(argument seeds)")
    runner = create(name, preset=preset, **options)
    results: list[Reconstruction | Exception | None] = [None] * len(observations)
    ready = []
    for i, obs in enumerate(observations):
        reasons = runner.requirements(obs)
        if reasons:
            results[i] = UnsupportedThreatModel(f"attack {name!r} cannot run on this observation: "
                                                + "; ".join(reasons))
        else:
            ready.append(i)
    start = time.perf_counter()
    solved = runner.run_batch([observations[i] for i in ready], [seeds[i] for i in ready], progress=progress)
    share = (time.perf_counter() - start) / max(len(ready), 1)
    resolved = {"preset": runner.preset, **dataclasses.asdict(runner.options)}
    for i, rec in zip(ready, solved):
        if isinstance(rec, Reconstruction):
            rec.trace.setdefault("seconds", share)
            rec.attack, rec.options = name, dict(resolved)
        results[i] = rec
    return results  # type: ignore[return-value]


__all__ = ["attack_batch"]
