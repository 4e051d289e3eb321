"""Sweeps in one process: resume after a stop (nothing repeated, nothing lost), Ctrl-C, failures recorded."""
from __future__ import annotations

import os
import sqlite3

import pytest
import yaml

from leakbench.evaluation import Store, Sweep, evaluate

TINY = {
    "name": "tiny",
    "datasets": [{"name": "digits"}],
    "models": ["cnn:3-4-2-1"],
    "batch_sizes": [1, 2],
    "images": 2,
    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 6}, "label": "ig"},
                {"name": "dlg", "options": {"iterations": 2}}],
    "defenses": ["none", "noise:0.01"],
}
N_TRIALS = 2 * (2 + 1) * 2  # defenses × (2 batches of 1 + 1 batch of 2) × attacks


def finished(db) -> dict[str, tuple]:
    with sqlite3.connect(db) as c:
        return {k: (s, a, f) for k, s, a, f in c.execute("SELECT key, status, attempts, finished FROM trials")}


def test_stop_and_resume_runs_each_trial_once(tmp_path):
    db = tmp_path / "r.db"
    first = evaluate(TINY, db, max_trials=3)
    assert first.ran == 3 and first.stopped == "max_trials" and not first.complete
    before = {k: v for k, v in finished(db).items() if v[0] == "done"}
    assert len(before) == 3
    second = evaluate(TINY, db)
    assert second.skipped == 3 and second.ran == N_TRIALS - 3 and second.complete
    after = finished(db)
    assert len(after) == N_TRIALS and all(s == "done" and a == 1 for s, a, _ in after.values())
    assert all(after[k] == v for k, v in before.items()), "finished trials must not run again"
    third = evaluate(TINY, db)
    assert third.ran == 0 and third.skipped == N_TRIALS
    with Store(db) as store:
        rows = store.rows()
        assert all(r["npz"] and os.path.isfile(r["npz"]) and os.path.isfile(r["png"]) for r in rows)
        assert yaml.safe_load(store.meta("spec"))["name"] == "tiny"


def test_interrupt_gives_claims_back(tmp_path):
    db = tmp_path / "r.db"
    seen = []

    def stop_after_two(trial, result):
        seen.append(trial.key)
        if len(seen) == 2:
            raise KeyboardInterrupt

    sweep = Sweep(TINY, db, on_result=stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        sweep.run()
    assert sweep.store.counts() == {"done": 2, "pending": N_TRIALS - 2}
    assert sweep.state_dict()["counts"] == {"done": 2, "pending": N_TRIALS - 2}
    sweep.store.close()
    assert evaluate(TINY, db).ran == N_TRIALS - 2


def _unchecked(spec, db, **options):
    """Run a sweep without its preflight (so trials that cannot work fail at run time)."""
    sweep = Sweep(spec, db, check=False, **options)
    try:
        return sweep.run()
    finally:
        sweep.store.close()


def test_failed_trial_is_recorded_and_the_sweep_goes_on(tmp_path):
    spec = {**TINY, "attacks": TINY["attacks"][:1], "defenses": ["none"],
            "datasets": [{"name": "digits"}, {"name": "digits", "options": {"limit": 1}, "label": "one-digit"}]}
    db = tmp_path / "r.db"
    summary = _unchecked(spec, db)
    # the preflight refuses this spec; unchecked, the trials that cannot draw their images fail:
    # with one sample, the 2 images of a setting cannot be drawn: its 3 trials fail, the other 3 run
    assert summary.counts == {"done": 3, "failed": 3} and summary.ran == 6
    with Store(db) as store:
        failed = store.rows(status="failed")
    assert {r["dataset"] for r in failed} == {"one-digit"}
    assert all("ConfigError" in r["error"] and "Traceback" in r["traceback"] for r in failed)
    assert _unchecked(spec, db).ran == 0  # failed trials are not retried by default
    again = _unchecked(spec, db, retry_failed=True)
    assert again.ran == 3 and again.counts["failed"] == 3
    assert {v[1] for v in finished(db).values() if v[0] == "failed"} == {2}  # attempts


class _InterruptDuringTrial:
    """A runner stopped (Ctrl-C) while its first trial runs: the sweep has claimed it, nothing is committed."""

    def __init__(self):
        self.claimed = []

    def run(self, trials):
        for trial in trials:
            self.claimed.append(trial.key)
            raise KeyboardInterrupt
        yield  # a generator, like every runner

    def state_dict(self):
        return {"runner": "interrupt"}


def test_interrupt_during_a_trial_gives_its_claim_back(tmp_path):
    """The claim in flight at Ctrl-C returns to pending with its attempt undone (Store.release), so a resumed
    sweep runs it as if it had never started."""
    db = tmp_path / "r.db"
    runner = _InterruptDuringTrial()
    sweep = Sweep(TINY, db, runner=runner)
    with pytest.raises(KeyboardInterrupt):
        sweep.run()
    assert len(runner.claimed) == 1
    assert sweep.store.counts() == {"pending": N_TRIALS}
    sweep.store.close()
    state = finished(db)
    assert state[runner.claimed[0]] == ("pending", 0, None)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT worker FROM trials WHERE key = ?", runner.claimed[:1]).fetchone() == (None,)
