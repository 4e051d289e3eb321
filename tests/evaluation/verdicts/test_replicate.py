"""Adaptive replication: batches are added only to cells whose verdict is open, stay paired, and resume."""
from __future__ import annotations

import json
import time

import pytest

from leakbench.evaluation import Sweep
from leakbench.report import write_report
from leakbench.evaluation.verdicts.replicate import open_cells

SPEC = {
    "name": "rep", "datasets": [{"name": "digits", "options": {"size": 8}}],
    "models": [{"spec": "mlp:16", "act": "relu"}], "batch_sizes": [1, 2], "images": 2,
    "attacks": ["fc-inversion"],
    # two nearly identical noise levels: a statistical tie that more batches cannot break (budget-bound)
    "defenses": ["none", {"noise": [0.3, 0.31]}],
    "replicate": {"auto": True, "step": 2, "max_batches": 6, "max_trials": 40},
}


def _batches(rows):
    out = {}
    for r in rows:
        out.setdefault((r["defense"], r["batch_size"]), set()).add(r["batch"])
    return out


def test_replication_adds_paired_batches_to_open_cells_only_and_resumes(tmp_path):
    db = tmp_path / "r.db"
    sweep = Sweep(SPEC, db)
    first = sweep.run()
    rows = [r for r in sweep.store.rows(kind="attack") if r["status"] == "done"]
    state = json.loads(sweep.store.meta("replicate"))
    assert state["added"] > 0 and state["stopped"]
    batches = _batches(rows)
    # every defense of a cell attacked the same batches (pairing kept), never more than max_batches
    for b in (1, 2):
        sets = {frozenset(v) for (d, size), v in batches.items() if size == b}
        assert len(sets) == 1 and max(next(iter(sets))) < 6
    assert first.complete and first.counts.get("done") == len(sweep.by_key)
    open_now = open_cells(sweep.store.rows())
    assert set(state["open"]) == {" · ".join(map(str, c)) for c in open_now}
    sweep.store.close()
    again = Sweep(SPEC, db)
    second = again.run()
    assert second.ran == 0 and json.loads(again.store.meta("replicate"))["added"] == state["added"]
    page = write_report(again.store, tmp_path / "report").index.read_text()
    assert f"Adaptive replication added {state['added']} trial(s)" in page
    again.store.close()


def test_an_interrupted_replication_round_resumes_its_pending_trials(tmp_path):
    db = tmp_path / "r.db"
    stop = {"n": 0}

    def interrupt(spec, result):
        stop["n"] += 1
        if spec.batch >= 2:  # the first added trial: stop the sweep mid-round
            raise KeyboardInterrupt

    sweep = Sweep(SPEC, db, on_result=interrupt)
    with pytest.raises(KeyboardInterrupt):
        sweep.run()
    pending = [r for r in sweep.store.rows(kind="attack") if r["status"] == "pending"]
    assert pending  # the round's other trials are in the store, not yet run
    sweep.store.close()
    again = Sweep(SPEC, db)
    again.run()
    rows = again.store.rows(kind="attack")
    assert all(r["status"] == "done" for r in rows)
    reference = Sweep(SPEC, tmp_path / "ref.db")
    reference.run()
    assert sorted(r["key"] for r in rows) == sorted(r["key"] for r in reference.store.rows(kind="attack"))
    again.store.close()
    reference.store.close()


def test_no_replication_without_auto(tmp_path):
    spec = {**SPEC, "replicate": {"auto": False}}
    sweep = Sweep(spec, tmp_path / "r.db")
    sweep.run()
    assert sweep.store.meta("replicate") is None
    assert {r["batch"] for r in sweep.store.rows(kind="attack")} == {0, 1}
    sweep.store.close()


#: one batch a round: B = 2 holds 2 batches of 8 images, so its cell stays undecided (n < 3) after round one
STEP1 = {**SPEC, "replicate": {"auto": True, "step": 1, "max_batches": 8, "max_trials": 60}}


def _extra(sweep):
    planned = {t.key for t in sweep.trials}
    return [r for r in sweep.store.rows(kind="attack") if r["key"] not in planned]


def test_replication_counts_only_trials_it_really_added(tmp_path):
    # each round adds batches the store does not hold yet; a round that adds nothing ends replication
    sweep = Sweep(STEP1, tmp_path / "r.db")
    sweep.run()
    state = json.loads(sweep.store.meta("replicate"))
    extra = _extra(sweep)
    # before: later rounds re-planned the first round's batches ("added 60 trials in 19 rounds" over 6 rows)
    assert state["added"] == len(extra) > 0
    assert 1 <= state["rounds"] <= len({(r["batch_size"], r["batch"]) for r in extra})
    assert state["stopped"] != "replicate.max_trials (60) spent"
    assert len({r["key"] for r in extra}) == len(extra)
    sweep.store.close()


def test_an_interrupted_replication_ends_with_the_same_counts(tmp_path):
    def interrupt(spec, result):
        if spec.batch >= 2:
            raise KeyboardInterrupt

    sweep = Sweep(STEP1, tmp_path / "i.db", on_result=interrupt)
    with pytest.raises(KeyboardInterrupt):
        sweep.run()
    sweep.store.close()
    again = Sweep(STEP1, tmp_path / "i.db")
    again.run()
    reference = Sweep(STEP1, tmp_path / "ref.db")
    reference.run()
    got, want = (json.loads(s.store.meta("replicate")) for s in (again, reference))
    assert (got["added"], got["rounds"]) == (want["added"], want["rounds"]) == (len(_extra(reference)),
                                                                                 want["rounds"])
    again.store.close()
    reference.store.close()


def test_max_minutes_bounds_a_round_and_a_resumed_sweep_runs_what_it_left(tmp_path):
    # before: max_minutes was read between rounds only, so one long round ran past it (the demo's first round:
    # 2 min 53 s against max_minutes: 2)
    slow = {**STEP1, "replicate": {**STEP1["replicate"], "max_minutes": 0.02}}

    def sleep_past_the_bound(spec, result):
        if spec.batch >= 2:  # an added trial: the bound (1.2 s) is spent once it finishes
            time.sleep(1.3)

    sweep = Sweep(slow, tmp_path / "m.db", on_result=sleep_past_the_bound)
    assert sweep.run()
    state = json.loads(sweep.store.meta("replicate"))
    extra = _extra(sweep)
    done = [r for r in extra if r["status"] == "done"]
    pending = [r for r in extra if r["status"] == "pending"]
    assert done and pending  # no added trial started after the bound; those already started finished
    assert state["stopped"] == (f"replicate.max_minutes (0.02) spent ({len(pending)} added trial(s) not run: a "
                                "resumed sweep runs them first)")
    sweep.store.close()
    again = Sweep(STEP1, tmp_path / "m.db")
    again.run()
    reference = Sweep(STEP1, tmp_path / "ref.db")
    reference.run()
    assert all(r["status"] == "done" for r in again.store.rows(kind="attack"))
    assert sorted(r["key"] for r in _extra(again)) == sorted(r["key"] for r in _extra(reference))
    again.store.close()
    reference.store.close()
