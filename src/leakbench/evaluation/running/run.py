"""Run one trial of any kind: :func:`run_trial` dispatches on ``spec.kind`` (see :mod:`.trial`).

The kinds ``attack``, ``utility`` and ``bound`` are in :mod:`.trial`; ``weights`` and ``membership`` in
:mod:`.published`.  Both import :mod:`.trial` only, so this module is where the table of kinds lives.
"""
from __future__ import annotations

import traceback as tb
from pathlib import Path
from typing import Any

import torch

from ... import plugins
from ...errors import BudgetExceeded, LeakbenchError, UnsupportedThreatModel
from ..membership import published, reference_trial, round_trial
from ..trials.trial import KINDS, Clock, TrialResult, TrialSpec, non_finite, trial_budget, worker_id
from ..trials.attack import attack_trial
from ..trials.kinds import bound_trial, utility_trial

#: the membership trial of each form of entry (the margin form, with no ``form``, is the published target's)
MEMBERSHIP_FORMS = {"reference": reference_trial.reference_trial, "run": round_trial.round_membership_trial}


def membership_trial(spec: TrialSpec, clock: Clock, cache_dir) -> TrialResult:
    """A membership trial: reference-model attacks on a trained target (:mod:`.reference_trial`), a reference-free
    attack on a federated run's round (:mod:`.round_trial`), or the margin attack on a two-layer net
    (:func:`.published.membership_trial`)."""
    run = MEMBERSHIP_FORMS.get(spec.membership.get("form"), published.membership_trial)
    return run(spec, clock, cache_dir)


def weights_trial(spec: TrialSpec, clock: Clock, cache_dir) -> TrialResult:
    """A published-weights trial: on a target the library trains (:func:`.published.weights_trial`) or on a
    federated run's round (:func:`.round_trial.round_weights_trial`)."""
    run = round_trial.round_weights_trial if spec.target.get("run") else published.weights_trial
    return run(spec, clock, cache_dir)


#: the function running trials of each kind of :data:`~.trial.KINDS`
RUNNERS = {"attack": attack_trial, "utility": utility_trial, "bound": bound_trial,
           "weights": weights_trial, "membership": membership_trial}


def run_trial(spec: TrialSpec, *, cache_dir: str | Path | None = None, progress=None,
              strict: bool = False, prepared: Any = None) -> TrialResult:
    """Run one trial; never raises for a problem of the trial itself (see the module docstring).

    ``progress(done, total, loss)`` receives the attack's progress.  ``strict=True`` (the CLI's
    ``attack`` command) lets errors propagate instead of recording them as ``failed``/``n/a``.
    ``prepared``: the trial's reconstruction (attack) or utility result (utility) from a batched call of
    :mod:`.chunks`, or the exception that stopped it there; the trial is otherwise run and scored as alone.
    """
    clock = Clock(spec.trial_seconds, progress)
    clock.prepared = prepared
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(spec.threads)))
    try:
        # the sweep's end bounds every loop; a utility trial's training is its work, so trial_seconds bounds it too
        own = spec.trial_seconds if spec.kind == "utility" else None
        with torch.random.fork_rng(devices=[]), trial_budget(spec.deadline, own):
            plugins.ensure(spec.plugins)  # the plug-ins it uses, imported here too (a pool worker, a Ray actor)
            torch.manual_seed(spec.seed)
            run = _runner(spec.kind)
            result = run(spec, clock, cache_dir)
            if result.status == "done":
                bad = non_finite(result.metrics)
                if bad:
                    result = TrialResult(key=spec.key, status="failed",
                                         error=f"non-finite result: {', '.join(bad)} (a diverged run is a failure, "
                                               "not a score)", timings=result.timings)
    except UnsupportedThreatModel as err:
        if strict:
            raise
        result = TrialResult(key=spec.key, status="n/a", error=str(err))
    except BudgetExceeded as err:  # the wall-clock guards: shown as "timed out", never silently dropped from S_D
        result = TrialResult(key=spec.key, status="timed out", error=str(err))
    except Exception as err:  # recorded with the trial, the sweep goes on
        if strict:
            raise
        result = TrialResult(key=spec.key, status="failed", error=f"{type(err).__name__}: {err}",
                             traceback=tb.format_exc())
    finally:
        torch.set_num_threads(threads)
    result.timings = {**result.timings, **clock.total()}
    result.worker = worker_id()
    return result


def _runner(kind: str):
    """The function running trials of ``kind`` (:data:`RUNNERS`)."""
    if kind not in RUNNERS:
        raise LeakbenchError(f"expected a trial kind in {KINDS}, got {kind!r}")
    return RUNNERS[kind]


__all__ = ["run_trial", "RUNNERS"]
