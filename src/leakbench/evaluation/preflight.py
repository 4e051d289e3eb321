"""Check everything a sweep's trials need before the first one runs (what ``evaluate --dry-run`` reports).

:func:`load_spec` resolves names; :func:`preflight` goes further, so a sweep never says "valid" and
then fails every trial at run time:

- the sweep's size: :func:`count_trials` counts the planned trials without building one
  ``TrialSpec`` per batch, and :func:`check_size` refuses more than :data:`~.spec.MAX_TRIALS`
  unless the spec's ``max_trials`` (or ``leakbench evaluate --yes``) allows them;
- every dataset is loaded once (bad option values such as ``size: big``, a missing npz or folder,
  NaN pixels, too few samples for the batch sizes and ``images``);
- every model is built once on every dataset's shape with its ``act``, ``init`` and options
  (``act: relux``, ``cnn:99-1-1-0`` on 8×8 images) and one client round is observed on the
  smallest batch under the spec's threat settings (a ±1 loss on a 10-class dataset);
- the plan is not empty.

Errors are :class:`~leakbench.errors.ConfigError` lines naming the spec field
(``datasets[0].options``, ``models[1] on datasets[0]``, ``threat``...).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, LeakbenchError
from .spec import MAX_TRIALS, SweepSpec


@dataclass
class Preflight:
    """What :func:`preflight` checked: trials per kind, the datasets' shapes, the models built, its time."""

    trials: int
    kinds: dict[str, int] = field(default_factory=dict)
    datasets: dict[str, tuple[tuple[int, ...], int, int]] = field(default_factory=dict)  # key → (shape, n, classes)
    models: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.kinds.items() if n)
        data = "; ".join(f"{k}: {v[1]} × {'×'.join(map(str, v[0]))}, {v[2]} classes"
                         for k, v in self.datasets.items())
        return (f"{self.trials} trial(s) ({kinds}); checked {len(self.datasets)} dataset(s) ({data}) and "
                f"{self.models} model build(s) in {self.seconds:.1f} s")


def _upper_bound(spec: SweepSpec) -> int:
    """Trials of the full cross product before include/exclude rules (an upper bound, O(1))."""
    settings = len(spec.datasets) * len(spec.models) * len(spec.defense_specs())
    batches = sum(max(1, spec.images // b) for b in spec.batch_sizes) * len(spec.seeds)
    per_batch = len(spec.attacks) + (1 if spec.bounds is not None and spec.bounds.cramer_rao else 0)
    return settings * (batches * per_batch + (1 if spec.utility is not None else 0))


def count_trials(spec: SweepSpec) -> dict[str, int]:
    """Planned trials per kind, as :func:`~.plan.plan` makes them, without one ``TrialSpec`` per batch.

    The plan of the spec with ``images: 1`` holds one representative per batch-less setting;
    each representative of a per-batch kind stands for ``max(1, images // batch_size)`` batches.
    """
    from .plan import plan

    counts: dict[str, int] = {}
    for t in plan(spec.model_copy(update={"images": 1})):
        n = max(1, spec.images // t.batch_size) if t.images and t.batch_size else 1
        counts[t.kind] = counts.get(t.kind, 0) + n
    return counts


def _count(spec: SweepSpec) -> tuple[int, dict[str, int], bool]:
    """(trials, per kind, exact): exact from :func:`count_trials` when its representatives are few, else the bound."""
    limit = spec.max_trials or MAX_TRIALS
    representatives = _upper_bound(spec.model_copy(update={"images": 1}))
    if representatives > 4 * limit:  # counting them one by one would itself be slow: report the upper bound
        return _upper_bound(spec), {}, False
    kinds = count_trials(spec)
    return sum(kinds.values()), kinds, True


def check_size(spec: SweepSpec, *, yes: bool = False) -> int:
    """The number of planned trials; a :class:`ConfigError` past the limit (``max_trials``, else MAX_TRIALS)."""
    limit = spec.max_trials or MAX_TRIALS
    total, _, exact = _count(spec)
    if total <= limit or yes:
        return total
    raise ConfigError(f"field max_trials: the spec would make {'' if exact else 'up to '}{total:,} trials, more "
                      f"than the limit of {limit:,}; shrink images/seeds/the grids, or allow it with max_trials: "
                      f"{total} in the spec (or leakbench evaluate --yes)")


def preflight(spec: SweepSpec, *, yes: bool = False) -> Preflight:
    """Check what every trial of ``spec`` needs (see the module docstring); one line per problem found first."""
    from ..data import load
    from ..models import build
    from ..threat import observe

    start = time.perf_counter()
    check_size(spec, yes=yes)
    total, kinds, _ = _count(spec)
    if total == 0:
        raise ConfigError("field include/exclude: the spec plans no trial (the rules exclude everything); "
                          "loosen the include/exclude rules")
    report = Preflight(trials=total, kinds=kinds or {"trials (upper bound)": total})
    device = torch.device(spec.device)
    smallest = min(spec.batch_sizes)
    for i, d in enumerate(spec.datasets):
        where = f"datasets[{i}] ({d.key})"
        try:
            data = load(d.name, **d.options)  # not the trials' cache: a pool's parent need not hold the data
        except Exception as err:  # noqa: BLE001 - any loader failure is the entry's problem
            raise ConfigError(f"{where}: cannot load it: {_first_line(err)}") from None
        need = max(spec.images, max(spec.batch_sizes))
        if len(data) < need:
            raise ConfigError(f"{where}: holds {len(data)} samples, the spec draws {need} (images: {spec.images}, "
                              f"batch_sizes: {list(spec.batch_sizes)}); lower them or load more samples")
        report.datasets[d.key] = (data.shape, len(data), data.num_classes)
        x, y = data.batch(smallest, seed=0)
        for j, m in enumerate(spec.models):
            where = f"models[{j}] ({m.key}) on datasets[{i}] ({d.key}, shape {'×'.join(map(str, data.shape))})"
            try:
                model = build(m.spec, input_shape=data.shape, classes=data.num_classes, act=m.act, init=m.init,
                              seed=m.seed, device=device, **dict(m.options))
            except Exception as err:  # noqa: BLE001
                raise ConfigError(f"{where}: cannot build it: {_first_line(err)}") from None
            report.models += 1
            try:
                observe(model, x.to(device), y.to(device), seed=0, population=data,
                        **_threat_arguments(spec))
            except Exception as err:  # noqa: BLE001
                raise ConfigError(f"threat with {where}: one client round fails: {_first_line(err)}") from None
    report.seconds = time.perf_counter() - start
    return report


def _threat_arguments(spec: SweepSpec) -> dict[str, Any]:
    """The observe() arguments of the spec's threat section (as the trials pass them; other keys are left out)."""
    from ..threat import observe

    accepted = inspect.signature(observe).parameters
    return {k: v for k, v in spec.threat.model_dump().items() if k in accepted}


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    text = text[:300]
    return text if isinstance(err, LeakbenchError) else f"{type(err).__name__}: {text}"


__all__ = ["Preflight", "preflight", "count_trials", "check_size"]
