"""A chunk of trials run as few batched calls as possible: :func:`run_chunk`.

Attack trials that differ only in their images and seeds (same data, model, defense, B, attack, preset and
options: :func:`batch_group`) go to :func:`leakbench.attacks.attack_batch` together, which stacks the
gradient-matching ones into one optimisation.  Utility trials that differ only in their training seed train
together on CUDA (:func:`~.utility.utility_seeds`; on a CPU the stacked step measured slower than the seeds one
after the other).  Every other trial runs alone.  Each trial is then finished by
:func:`~.run.run_trial` with its batched result (``prepared``): the same scoring, the same per-trial
failure, n/a and non-finite checks as a trial run alone, one :class:`~.trial.TrialResult` each — a NaN trial
fails alone, its chunk-mates are untouched.

The trials of one batched call share one deadline: the sum of their ``budget.trial_seconds``; past it,
every trial of the call still running is ``timed out``.

How many to stack (:func:`stack_size`): on a CPU, :data:`CPU_STACK` (measured fastest per trial on 2 cores,
``benchmarks/bench_batched.py``); on CUDA, as many as half the free memory holds at an estimate taken from the
model (:func:`cuda_stack`); a stack that still runs out of memory is halved and run again.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ... import plugins
from ...budget import check_time
from ...errors import BudgetExceeded, LeakbenchError
from .run import run_trial
from ..trials.trial import TrialResult, TrialSpec, TrialTimeout, trial_budget

#: trials stacked per batched call on a CPU: measured fastest per trial on 2 cores (IG quick B = 1 / fast B = 4 on
#: the demo CNN, s a trial at k = 8/16/32/64: 0.093/0.067/0.056/0.050 and 0.161/0.160/0.107/0.110); 64 adds
#: little and a kill loses twice the chunk
CPU_STACK = 32
#: the most trials one chunk sends to a CUDA worker (which then stacks what its memory holds)
CUDA_CHUNK = 256
#: fields of an attack trial that may differ inside one batched call
ATTACK_FREE = ("seed", "batch", "images", "indices")


@functools.lru_cache(maxsize=64)
def _stackable_attack(name: str, preset: str | None, options_json: str) -> bool:
    from ...attacks import ATTACKS, Attack, create

    if name not in ATTACKS or ATTACKS.get(name).run_batch is Attack.run_batch:
        return False
    try:
        options = create(name, preset=preset, **json.loads(options_json)).options
    except Exception:  # noqa: BLE001 (a bad option fails in its own trial, with its message)
        return False
    return getattr(options, "optimizer", "adam") != "lbfgs" and not getattr(options, "generator", False)


def batch_group(trial: TrialSpec) -> tuple | None:
    """Trials with the same (non-None) group can run in one batched call; None: the trial runs alone (also
    every trial of a sweep whose ``stack`` is 1)."""
    if trial.stack == 1:
        return None
    if trial.kind == "attack" and not trial.server:
        if not _stackable_attack(trial.attack, trial.preset, json.dumps(trial.options, sort_keys=True, default=str)):
            return None
        fixed = {k: v for k, v in trial.identity().items() if k not in ATTACK_FREE}
    elif trial.kind == "utility" and trial.device.startswith("cuda") and "federated" not in trial.training:
        # (on a CPU stacked training is slower; a federated round's utility reads its run, nothing to stack)
        fixed = trial.identity()                                       # (:func:`~.utility.utility_seeds`)
        fixed["utility"] = {k: v for k, v in dict(trial.utility).items() if k != "seed"}
    else:
        return None
    return (json.dumps(fixed, sort_keys=True, default=str), trial.device, trial.threads)


def batched_order(trials: Iterable[TrialSpec]) -> list[TrialSpec]:
    """``trials`` with the members of each batch group next to each other (the groups in the order they first
    appear, each group's members in their order), so that a runner's chunks can hold whole stacks: a plan
    alternates attacks batch after batch."""
    groups: dict[Any, list[TrialSpec]] = {}
    for trial in trials:
        groups.setdefault(batch_group(trial) or ("alone", trial.key), []).append(trial)
    return [t for members in groups.values() for t in members]


def stack_size(trial: TrialSpec) -> int:
    """How many trials of ``trial``'s group a chunk should hold (1 for a trial that runs alone): the sweep's
    ``stack`` where it sets one, else :data:`CUDA_CHUNK` on CUDA and :data:`CPU_STACK` on a CPU."""
    if batch_group(trial) is None:
        return 1
    if trial.stack is not None:
        return int(trial.stack)
    return CUDA_CHUNK if trial.device.startswith("cuda") else CPU_STACK


def cuda_stack(obs, device: torch.device) -> int:
    """Problems of ``obs``'s shape that half the free CUDA memory holds: per problem, about 10 copies of the
    parameters (target, simulated gradient, its graph) and 6 of the activations of one forward pass."""
    free, _ = torch.cuda.mem_get_info(device)
    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel() if torch.is_tensor(out) else 0))
             for m in obs.model.modules()]
    try:
        with torch.no_grad():
            obs.model(torch.zeros((obs.batch_size, *obs.input_shape), device=device, dtype=obs.dtype))
    finally:
        for h in hooks:
            h.remove()
    params = sum(p.numel() for p in obs.model.parameters())
    per = obs.dtype.itemsize * (10 * params + 6 * sum(sizes) + 4 * obs.batch_size * math.prod(obs.input_shape))
    return max(1, min(CUDA_CHUNK, int(free * 0.5 // max(per, 1))))


def observation_for(spec: TrialSpec, cache_dir) -> Any:
    """The observation attack trial ``spec`` attacks (as :func:`~.run.run_trial` computes it: same seeds)."""
    from ...threat import observe
    from ..trials.inputs import apply_server, batch_for, dataset_for, model_for, observed_defense

    device = torch.device(spec.device)
    data = dataset_for(spec)
    model = model_for(spec, data, device, None if cache_dir is None else Path(cache_dir))
    if spec.server:
        model = apply_server(spec, model, data)
    x, y = batch_for(spec, data)
    return observe(model, x.to(device), y.to(device), defense=observed_defense(spec), seed=spec.seed, population=data,
                   **spec.threat)


class _Deadline:
    """The shared budget of a batched call: ``limit`` seconds (None: none) from its start."""

    def __init__(self, limit: float | None, count: int) -> None:
        self.limit, self.count, self.start = limit, count, time.perf_counter()

    def __call__(self, done: int, total: int, loss: float) -> None:
        check_time(f"the batched call of {self.count} trials ran {done} of {total} steps")
        if self.limit is not None and time.perf_counter() - self.start > self.limit:
            raise TrialTimeout(f"ran {done} of {total} steps: the batched call of {self.count} trials exceeded "
                               f"their summed budget.trial_seconds ({self.limit:g} s)")


def _budget(trials: list[TrialSpec]) -> float | None:
    limits = [t.trial_seconds for t in trials]
    return None if any(v is None for v in limits) else float(sum(limits))


class _Threads:
    def __init__(self, count: int) -> None:
        self.count = max(1, int(count))

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.count)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def _attack_group(trials: list[TrialSpec], cache_dir) -> dict[str, Any]:
    """Each trial's reconstruction (or the exception that stopped it) from batched calls; trials whose
    observation fails are left out (they run alone and fail with their own message)."""
    from ...attacks import attack_batch

    observations: dict[str, Any] = {}
    for t in trials:
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(t.seed)
                observations[t.key] = observation_for(t, cache_dir)
        except Exception:  # noqa: BLE001 (run alone, the trial reports its own error)
            continue
    ready = [t for t in trials if t.key in observations]
    if not ready:
        return {}
    head = ready[0]
    size = len(ready)
    if head.device.startswith("cuda"):
        size = cuda_stack(observations[head.key], torch.device(head.device))
    out: dict[str, Any] = {}
    pending = [ready[i:i + size] for i in range(0, len(ready), size)]
    while pending:
        part = pending.pop(0)
        try:
            with _Threads(head.threads):
                recs = attack_batch(head.attack, [observations[t.key] for t in part], seeds=[t.seed for t in part],
                                    preset=head.preset, progress=_Deadline(_budget(part), len(part)), **head.options)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if len(part) == 1:
                raise
            half = len(part) // 2
            pending[:0] = [part[:half], part[half:]]
            continue
        out.update({t.key: r for t, r in zip(part, recs)})
    return out


def _utility_group(trials: list[TrialSpec], cache_dir) -> dict[str, Any]:
    from ..trials.kinds import utility_arguments
    from ..training.utility import utility_seeds

    arguments = utility_arguments(trials[0], cache_dir)
    arguments.pop("seed")
    seeds = [int(dict(t.utility).get("seed", 0)) for t in trials]
    with _Threads(trials[0].threads):
        results = utility_seeds(seeds=seeds, stacked=True, **arguments)
    return {t.key: r for t, r in zip(trials, results)}


def run_chunk(trials: Iterable[TrialSpec], *, cache_dir: str | Path | None = None) -> Iterator[TrialResult]:
    """Run ``trials``, batching those of one :func:`batch_group`; yields one result per trial (groups in the order
    they first appear).  A batched call that fails as a whole leaves its trials to run alone."""
    groups: dict[Any, list[TrialSpec]] = {}
    for i, trial in enumerate(trials):
        with contextlib.suppress(LeakbenchError):  # a plug-in that fails here fails its trial, in run_trial
            plugins.ensure(trial.plugins)
        key = batch_group(trial)
        groups.setdefault(("alone", i) if key is None else key, []).append(trial)
    for members in groups.values():
        prepared: dict[str, Any] = {}
        started = time.perf_counter()
        if len(members) > 1:
            head = members[0]
            own = _budget(members) if head.kind == "utility" else None  # training is a utility trial's work
            try:
                run = _attack_group if head.kind == "attack" else _utility_group
                with trial_budget(head.deadline, own, "budget.trial_seconds (summed over the stack)"):
                    prepared = run(members, cache_dir)
            except BudgetExceeded as err:  # out of time: each trial is timed out, none runs again alone
                prepared = {t.key: err for t in members}
            except Exception:  # noqa: BLE001 (each trial then runs alone and reports its own error)
                prepared = {}
        share = (time.perf_counter() - started) / len(members)
        for trial in members:
            done = prepared.get(trial.key)
            result = run_trial(trial, cache_dir=cache_dir, prepared=done)
            if done is not None:  # its share of the batched call is its attack (training) time, and counts in its
                lap = "attack" if trial.kind == "attack" else "train"  # total (the chunk sizer reads it)
                timings = result.timings
                result.timings = {**timings, lap: timings.get(lap, 0.0) + share, "batched": share,
                                  "total": timings.get("total", 0.0) + share, "stacked": float(len(members))}
            yield result


__all__ = ["run_chunk", "batch_group", "batched_order", "stack_size", "cuda_stack", "observation_for", "CPU_STACK", "CUDA_CHUNK"]
