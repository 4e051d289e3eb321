"""Run a sweep into a store: plan, skip what is done, claim, execute, commit each trial at once.

    import leakbench as lb
    summary = lb.evaluate("examples/sweep-tiny.yaml", db="results.db", workers=2)

Re-running the same call resumes: finished trials (done or n/a) are skipped,
failed and timed-out ones are retried only with ``retry_failed=True``, and trials left
``running`` by a process that died are run again.  Before anything runs, the
spec passes :func:`~.preflight.preflight` (size, every dataset loaded, every
model built) and the store is bound to the sweep's trials: another spec on the
same store is refused unless ``force=True``.  Ctrl-C gives back the claims
of the trials in flight, so nothing is lost and nothing is repeated.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

from ..errors import ConfigError
from ..progress import sweep_progress
from .running.chunks import batched_order
from .running.eta import CostEstimate, cheapest_groups_first, probes_first
from .running.images import save_trial_files
from .trials.plan import plan
from .running.preflight import check_size, preflight
from .running.runner import Runner
from .running.runners import capped_workers, make_runner
from .running.guard import in_spawned_main, refuse_unguarded_main
from .verdicts.replicate import cell_of
from .sweep_spec.model import SweepSpec, dump_spec, load_spec
from .store import RETRYABLE, Store
from .trials.trial import SWEEP_BUDGET, TrialResult, TrialSpec, worker_id

#: statuses that count as finished (not run again).
FINISHED = ("done", "n/a")


@dataclass(repr=False)
class SweepSummary:
    """What one :meth:`Sweep.run` did and where the sweep stands.

    False when trials failed or timed out, or when nothing was measured (:attr:`nothing`: no trial done, or the
    sweep's budget ended it before any trial ran) (``if not lb.evaluate(...)``), as the CLI then exits 1; its
    ``repr`` says how many: ``SweepSummary(all 108 trials failed, ...)``, ``SweepSummary(12 of 108 trials
    failed, ...)``.
    """

    db: Path
    planned: int
    skipped: int
    ran: int
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    stopped: str | None = None

    @property
    def complete(self) -> bool:
        """Every planned trial is finished (done or n/a)."""
        return sum(self.counts.get(s, 0) for s in FINISHED) == self.planned

    @property
    def failed(self) -> int:
        """Trials that failed or timed out."""
        return sum(self.counts.get(s, 0) for s in RETRYABLE)

    def __bool__(self) -> bool:
        return self.failed == 0 and self.nothing is None

    @property
    def nothing(self) -> str | None:
        """Why this run measured nothing (no verdict holds; the CLI exits 1 with it), else None: the sweep's
        budget ended it before any trial ran, or no trial of the sweep is done (all failed, timed out or n/a)."""
        if self.stopped == "budget.sweep_minutes" and self.ran == 0 and not self.complete:
            left = self.planned - sum(self.counts.get(s, 0) for s in FINISHED)
            return (f"budget.sweep_minutes ended the sweep before any trial ran ({left} trial(s) not run): nothing "
                    "was measured, so no verdict holds; raise budget.sweep_minutes or resume")
        if self.counts.get("done", 0) == 0 and self.stopped != "max_trials":
            counts = ", ".join(f"{v} {k}" for k, v in sorted(self.counts.items())) or "no trial"
            return f"no trial succeeded ({counts}): nothing was measured, so no verdict holds"
        return None

    @property
    def headline(self) -> str:
        """"all 108 trials failed", "12 of 108 trials failed", or "108 of 108 trials finished"."""
        total = sum(self.counts.values()) or self.planned
        if self.failed:
            return f"all {total} trials failed" if self.failed == total else f"{self.failed} of {total} trials failed"
        finished = sum(self.counts.get(s, 0) for s in FINISHED)
        return f"{finished} of {total} trials finished"

    def __repr__(self) -> str:
        stopped = f", stopped={self.stopped!r}" if self.stopped else ""
        return (f"SweepSummary({self.headline}, counts={dict(sorted(self.counts.items()))}, db={str(self.db)!r}, "
                f"ran={self.ran}, skipped={self.skipped}, seconds={self.seconds:.1f}{stopped})")

    __str__ = __repr__


class Sweep:
    """A sweep spec bound to a store and an executor; :meth:`run` it, :meth:`state_dict` to inspect it."""

    def __init__(self, spec: SweepSpec | str | Path | dict, db: str | Path | Store = "results.db", *,
                 workers: int = 1, ray: str | None = None, retry_failed: bool = False,
                 max_trials: int | None = None, runner: Runner | None = None,
                 on_result: Callable[[TrialSpec, TrialResult], None] | None = None, force: bool = False,
                 check: bool = True) -> None:
        if in_spawned_main() or (ray is None and runner is None and isinstance(workers, int) and workers > 1):
            refuse_unguarded_main()  # before the store is touched: a script a spawned worker would re-run
        self.spec = load_spec(spec)
        self.preflight = preflight(self.spec) if check else None  # every dataset, model and the size, up front
        if not check:
            check_size(self.spec)
        self.store = db if isinstance(db, Store) else Store(db)
        if max_trials is not None and (not isinstance(max_trials, int) or max_trials < 0):
            raise ConfigError(f"expected max_trials ≥ 0, got {max_trials!r}")
        self.workers, self.ray, self.retry_failed, self.max_trials = workers, ray, retry_failed, max_trials
        self.runner = runner
        self.on_result = on_result
        self.trials = plan(self.spec)
        self.by_key = {t.key: t for t in self.trials}
        #: lines for the user about how the sweep runs (a --workers value capped at the cores or trials)
        self.notes: list[str] = []
        if ray is None and runner is None:
            self.workers, note = capped_workers(workers, len(self.trials))
            self.notes += [note] if note else []
        self.store.bind(self.by_key, force=force)  # one sweep per store: another spec needs a new db or force
        self.worker = worker_id()
        self.ran = 0
        self._claimed: set[str] = set()

    def todo(self) -> list[TrialSpec]:
        """Trials still to run (pending; also failed and timed-out ones with ``retry_failed``)."""
        status = self.store.status(self.by_key)
        wanted = ("pending", *RETRYABLE) if self.retry_failed else ("pending",)
        return [t for t in self.trials if status.get(t.key, "pending") in wanted]

    def _feed(self, todo: list[TrialSpec], start: float, until: float | None = None) -> Iterator[TrialSpec]:
        """Claim and yield the trials of ``todo`` until a limit: ``max_trials``, ``budget.sweep_minutes``, or
        ``until`` (a ``perf_counter`` time after which no trial starts; those already started finish)."""
        budget = self.spec.budget.sweep_minutes
        # the sweep's end as a wall-clock time: every loop of a trial (training too) stops there, in any process
        end = None if budget is None else time.time() + 60 * budget - (time.perf_counter() - start)
        for i, trial in enumerate(todo):
            if self.max_trials is not None and i >= self.max_trials:
                self.stopped = "max_trials"
                return
            if budget is not None and time.perf_counter() - start > 60 * budget:
                self.stopped = "budget.sweep_minutes"
                return
            if until is not None and time.perf_counter() > until:
                return
            if self.store.claim([trial.key], self.worker, retry_failed=self.retry_failed):
                self._claimed.add(trial.key)
                yield trial if end is None else dataclasses.replace(trial, deadline=end)

    def _commit(self, result: TrialResult) -> None:
        if result.status == "timed out" and SWEEP_BUDGET in (result.error or ""):
            # cut by the sweep's end, not by its own budget: back to pending, so the resumed sweep runs it
            self.store.release([result.key], self.worker)
            self._claimed.discard(result.key)
            self.stopped = "budget.sweep_minutes"
            return
        files = save_trial_files(self.store.images_dir, result) if result.arrays else {}
        result.arrays = {}
        self.store.commit(result, files)
        self._claimed.discard(result.key)
        self.ran += 1

    def run(self, *, progress: bool = False) -> SweepSummary:
        """Run every trial still to do; each is committed to the store as soon as it finishes."""
        start = time.perf_counter()
        self.stopped: str | None = None
        self.store.recover()
        self.store.add(self.trials)
        self.store.set_meta("spec", dump_spec(self.spec))
        self.store.set_meta("sweep", self.spec.name)
        todo = self.todo()
        skipped = len(self.trials) - len(todo)
        runner = self.runner or make_runner(workers=self.workers, ray=self.ray, cache_dir=self.store.cache_dir)
        self.estimate = CostEstimate(todo, self._parallel(runner))
        bar = (sweep_progress(len(self.trials), skipped, self.spec.name, eta=self.estimate.seconds_left) if progress
               else contextlib.nullcontext(None))
        try:
            with bar as advance:
                self._execute(runner, todo, start, advance)
            if self.spec.replicate.auto and self.stopped is None:
                self._replicate(runner, start, progress)
        except KeyboardInterrupt:
            self.stopped = "interrupted"
            raise
        finally:
            if self._claimed:
                self.store.release(self._claimed, self.worker)
                self._claimed.clear()
            if self.runner is None:
                runner.close()
        return SweepSummary(db=self.store.path, planned=len(self.by_key), skipped=skipped, ran=self.ran,
                            counts=self.store.counts(self.by_key), seconds=time.perf_counter() - start,
                            stopped=self.stopped)

    def _parallel(self, runner: Runner) -> int:
        """Trials the runner runs at once (its workers; 1 in this process)."""
        return int(getattr(runner, "workers", None) or self.workers or 1)

    def _execute(self, runner: Runner, todo: list[TrialSpec], start: float, advance,
                 until: float | None = None) -> None:
        # the trials of one batch group next to each other, so that a chunk holds a stack of them; one trial of
        # each shape first (the ETA's prices) unless a time bound orders them (``until``: the caller's order kept)
        order = batched_order(todo)
        for result in runner.run(self._feed(order if until is not None else probes_first(order), start, until)):
            self._commit(result)
            if result.key in self.by_key:
                self.estimate.done(self.by_key[result.key], (result.timings or {}).get("total"))
            if advance is not None:
                advance(result.status)
            if self.on_result is not None:
                self.on_result(self.by_key[result.key], result)

    def _replicate(self, runner: Runner, start: float, progress: bool) -> None:
        """``replicate: auto``: add batches to the cells whose verdict is still open, round by round (resumable:
        trials added by an earlier run and still pending run first)."""
        from .verdicts.replicate import more_trials, open_cells
        from .trials.inputs import dataset_for

        rep = self.spec.replicate
        # replication's own clock: no added trial starts once max_minutes of it are spent (a started one finishes),
        # within a round too
        until = None if rep.max_minutes is None else time.perf_counter() + 60 * rep.max_minutes
        planned = {t.key for t in self.trials}
        limits: dict[tuple, int] = {}
        while True:
            # the store is the only truth: every trial it holds beyond the plan was added by replication (this
            # run or an earlier, interrupted one), so the counts are the same however often the sweep stopped
            known = {r["key"]: r for r in self.store.rows(kind="attack")}
            extra = {k: TrialSpec.from_dict(r["spec"]) for k, r in known.items() if k not in planned}
            self.by_key.update(extra)
            added, rounds = len(extra), _rounds(extra.values(), rep.step)
            pending = [t for k, t in extra.items() if known[k]["status"] == "pending"]
            cells = open_cells(self.store.rows())
            why = None
            if until is not None and time.perf_counter() > until and (pending or cells):
                why = f"replicate.max_minutes ({rep.max_minutes:g}) spent" + (
                    f" ({len(pending)} added trial(s) not run: a resumed sweep runs them first)" if pending else "")
            elif not pending:
                if not cells:
                    why = "every verdict decided (or an exact tie)"
                elif added >= rep.max_trials:
                    why = f"replicate.max_trials ({rep.max_trials}) spent"
                else:
                    trials = [*self.trials, *extra.values()]
                    for t in trials:
                        cell = cell_of(t)
                        if t.kind == "attack" and cell in cells and cell not in limits:
                            limits[cell] = max(1, len(dataset_for(t)) // max(1, t.batch_size))
                    # only trials the store does not hold yet: a round that adds nothing ends replication
                    pending = [t for t in more_trials(trials, cells, step=rep.step, max_batches=rep.max_batches,
                                                      limit=limits) if t.key not in known]
                    pending = pending[: rep.max_trials - added]
                    if not pending:
                        why = f"replicate.max_batches ({rep.max_batches}) or the dataset reached"
                    else:
                        self.store.add(pending)
                        self.by_key.update({t.key: t for t in pending})
                        added, rounds = added + len(pending), _rounds([*extra.values(), *pending], rep.step)
            if why is not None:
                self.store.set_meta("replicate", json.dumps({
                    "added": added, "rounds": rounds, "stopped": why,
                    "open": {" · ".join(map(str, c)): w for c, w in cells.items()}}))
                return
            self.store.set_meta("replicate", json.dumps({"added": added, "rounds": rounds, "stopped": None,
                                                         "open": {}}))
            estimate = CostEstimate(pending, self._parallel(runner))
            estimate.learn_from(self.estimate)  # priced by every trial measured before this round
            if until is not None:  # whole cells, the cheapest first: a cell cut short gains no pairs
                pending = cheapest_groups_first(pending, estimate, cell_of)
            self.estimate = estimate
            bar = (sweep_progress(len(pending), 0, f"{self.spec.name} (replication round {rounds})",
                                  eta=self.estimate.seconds_left) if progress
                   else contextlib.nullcontext(None))
            with bar as advance:
                self._execute(runner, pending, start, advance, until)
            if self.stopped is not None:
                return

    def state_dict(self) -> dict[str, Any]:
        """Where the sweep stands: spec, store counts for its trials, executor."""
        return {"spec": self.spec.model_dump(mode="json"), "db": str(self.store.path), "planned": len(self.trials),
                "counts": self.store.counts(self.by_key), "ran": self.ran, "retry_failed": self.retry_failed,
                "executor": (self.runner.state_dict() if self.runner is not None
                             else {"workers": self.workers, "ray": self.ray})}


def _rounds(added, step: int) -> int:
    """Replication rounds behind the ``added`` trials: the most batches added to one cell, in rounds of ``step``."""
    batches: dict[tuple, set[int]] = {}
    for t in added:
        batches.setdefault(cell_of(t), set()).add(int(t.batch))
    return max((-(-len(b) // max(1, step)) for b in batches.values()), default=0)


def evaluate(spec: SweepSpec | str | Path | dict, db: str | Path = "results.db", *, workers: int = 1,
             ray: str | None = None, retry_failed: bool = False, max_trials: int | None = None,
             progress: bool = False, force: bool = False) -> SweepSummary:
    """Run (or resume) the sweep ``spec`` into the SQLite store ``db``; see :class:`Sweep`.

    Returns a :class:`SweepSummary`, which is False (and warns) when trials failed: their errors are in the
    store (``leakbench evaluate`` prints them and exits 1).  With ``workers > 1`` call it under
    ``if __name__ == "__main__":`` in a script; an unguarded call is refused (worker processes re-run the
    script's top-level code).
    """
    sweep = Sweep(spec, db, workers=workers, ray=ray, retry_failed=retry_failed, max_trials=max_trials, force=force)
    try:
        summary = sweep.run(progress=progress)
    finally:
        sweep.store.close()
    if summary.failed:
        warnings.warn(f"{summary.headline} (store {summary.db}: their errors are in the store; "
                      "leakbench evaluate prints them)", RuntimeWarning, stacklevel=2)
    return summary


__all__ = ["Sweep", "SweepSummary", "evaluate", "FINISHED"]
