"""Executors: chunk sizes, a warm pool in chunks gives the local results, a worker that dies fails only its trials."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from leakbench.errors import ConfigError
from leakbench.evaluation import Store, Sweep, evaluate, load_spec, plan
from leakbench.evaluation.running.chunks import CPU_STACK, batch_group, stack_size
from leakbench.evaluation.running.runner import ChunkSizer
from leakbench.evaluation.running.pool import PoolRunner
from leakbench.evaluation.running.runners import make_runner
from leakbench.evaluation.trials.trial import TrialResult
from leakbench.evaluation.running.workers import die_with_parent

SHORT = {
    "name": "short",
    "datasets": [{"name": "digits"}],
    "models": ["cnn:3-4-2-1"],
    "batch_sizes": [1],
    "images": 10,
    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 5}}],
    "defenses": ["none"],
}
LONG = {**SHORT, "name": "long", "images": 4, "attacks": [{"name": "inverting-gradients",
                                                          "options": {"iterations": 1500}}]}


@pytest.fixture(scope="module")
def pool():
    runner = PoolRunner(2, chunk_seconds=5.0).start(wait=True)
    yield runner
    runner.close()


def _result(seconds: float) -> TrialResult:
    return TrialResult(key="k", status="done", timings={"total": seconds})


def test_chunk_sizer_fills_its_seconds():
    sizer = ChunkSizer(0.5, most=16)
    assert sizer.size() == 1  # nothing measured yet: one at a time
    for _ in range(4):
        sizer.observe(_result(0.1))
    assert sizer.size() == 5
    sizer.observe(_result(0.0))  # a trial of no time does not divide by zero
    assert 1 <= sizer.size() <= 16
    long = ChunkSizer(0.5)
    long.observe(_result(3.0))
    assert long.size() == 1
    assert ChunkSizer(0.5, most=4).size() == 1


def test_chunk_sizer_times_each_shape_of_trial_apart():
    """Fast trials of one attack do not size the chunks of a slow one (a chunk of 16 slow trials on one
    worker while the other idles): an untimed shape goes one at a time, each shape by its own mean.  (DLG's
    L-BFGS does not batch, so its chunks follow time alone.)"""
    trials = plan(load_spec({**SHORT, "attacks": [{"name": "dlg", "options": {"iterations": 5}},
                                                  {"name": "dlg", "options": {"iterations": 900},
                                                   "label": "dlg-slow"}]}))
    quick = [t for t in trials if t.options.get("iterations") == 5]
    slow = [t for t in trials if t.options.get("iterations") == 900]
    sizer = ChunkSizer(0.5, most=16)
    assert sizer.shape(quick[0]) == sizer.shape(quick[1]) != sizer.shape(slow[0])
    sizer.sent(quick[:4])
    for trial in quick[:4]:
        sizer.observe(TrialResult(key=trial.key, status="done", timings={"total": 0.01}))
    assert sizer.size(quick[5]) == 16 and sizer.size(slow[0]) == 1
    sizer.sent(slow[:2])
    for trial in slow[:2]:
        sizer.observe(TrialResult(key=trial.key, status="done", timings={"total": 0.2}))
    assert sizer.size(slow[3]) == 2 and sizer.size(quick[5]) == 16


def test_chunk_sizer_sends_at_least_a_stack_of_trials_that_batch():
    trials = plan(load_spec(LONG))
    sizer = ChunkSizer(0.5, most=16)
    assert batch_group(trials[0]) == batch_group(trials[1]) is not None
    assert sizer.size(trials[0]) == stack_size(trials[0]) == CPU_STACK


@pytest.mark.slow  # timed trials in a pool: `make test-slow`
def test_pool_keeps_both_workers_busy_when_slow_trials_follow_fast_ones(pool, tmp_path):
    """After a sweep of fast trials the pool's sizer knows them; slow trials of another attack that batch are
    shared out evenly between the workers with room, so both workers share them (each runs at least one)."""
    Sweep(SHORT, tmp_path / "fast.db", runner=pool).run()
    sweep = Sweep(LONG, tmp_path / "slow.db", runner=pool)
    summary = sweep.run()
    assert summary.counts == {"done": 4}
    assert len({r["worker"] for r in sweep.store.rows()}) == 2


def test_bad_worker_counts_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="workers"):
            PoolRunner(bad)
    with pytest.raises(ConfigError, match="workers"):
        make_runner(workers=0)


def test_warm_pool_in_chunks_matches_local_and_commits_each_trial_once(tmp_path, pool):
    local = evaluate(SHORT, tmp_path / "local.db")
    pids = pool.pids
    for name in ("pool.db", "again.db"):  # the second sweep reuses the same warm workers
        sweep = Sweep(SHORT, tmp_path / name, runner=pool)
        summary = sweep.run()
        sweep.store.close()
        assert summary.complete and summary.ran == 10
    assert pool.pids == pids, "the workers are long-lived: no respawn between sweeps"
    assert pool.state_dict()["chunk"] > 1, "short trials travel in chunks"
    with Store(tmp_path / "local.db") as a, Store(tmp_path / "pool.db") as b:
        ra = {r["key"]: r for r in a.rows()}
        rb = {r["key"]: r for r in b.rows()}
    assert local.complete and ra.keys() == rb.keys() == {t.key for t in plan(load_spec(SHORT))}
    for key in ra:
        assert ra[key]["metrics"] == rb[key]["metrics"]
        assert ra[key]["per_sample"] == rb[key]["per_sample"]
        assert rb[key]["status"] == "done" and rb[key]["attempts"] == 1
    assert {int(r["worker"].rpartition(":")[2]) for r in rb.values()} <= set(pids)


@pytest.mark.slow
def test_a_worker_that_dies_fails_only_its_trial_and_is_replaced(pool):
    pool.sizer = ChunkSizer(0.25)  # one trial at a time: each worker holds one running and one queued
    trials = plan(load_spec(LONG))
    victim = pool.pids[0]
    timer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
    timer.start()
    try:
        results = {r.key: r for r in pool.run(trials)}
    finally:
        timer.cancel()
    assert results.keys() == {t.key for t in trials}
    statuses = sorted(r.status for r in results.values())
    # the trial it was running failed; the one queued behind it never started and ran on another worker
    assert statuses == ["done", "done", "done", "failed"], [r.error for r in results.values()]
    failed = next(r for r in results.values() if r.status == "failed")
    assert "worker process died" in failed.error and "-9" in failed.error
    assert victim not in pool.pids and len(pool.pids) == 2
    short = plan(load_spec(SHORT))[:2]
    assert [r.status for r in pool.run(short)] == ["done", "done"], "the replacement worker runs trials"


def test_die_with_parent_exits_an_orphan_at_once():
    pid = os.fork()
    if pid == 0:  # child: pretend its parent is a pid that is not its parent → exits at once
        die_with_parent(os.getppid() + 10_000_000, kernel=False)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1


def test_pool_keeps_a_group_that_fits_one_stack_on_one_worker(tmp_path, pool):
    """Two groups of 10 trials that batch: the first ("none"), with more work behind it, is one stack on one
    worker; the last is shared out between the workers with room."""
    spec = {**SHORT, "name": "groups", "defenses": ["none", "noise:0.01"]}
    sweep = Sweep(spec, tmp_path / "groups.db", runner=pool)
    assert sweep.run().complete
    rows = [r for r in sweep.store.rows() if r["defense"] == "none"]
    sweep.store.close()
    assert len(rows) == 10 and len({r["worker"] for r in rows}) == 1, "the first group ran as one stack"
    assert {r["timings"]["stacked"] for r in rows} == {10.0}
