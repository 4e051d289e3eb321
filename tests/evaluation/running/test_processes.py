"""Sweeps across processes: kill and resume, two processes on one store, a process pool agrees with in-process."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml

from leakbench.evaluation import Store, evaluate, load_spec, plan

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
N_TRIALS = 2 * (2 + 1) * 2


def finished(db) -> dict[str, tuple]:
    with sqlite3.connect(db) as c:
        return {k: (s, a, f) for k, s, a, f in c.execute("SELECT key, status, attempts, finished FROM trials")}


def _cli(spec_path, db, *extra):
    code = "import sys; from leakbench.cli import app; sys.argv = ['leakbench'] + sys.argv[1:]; app()"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, "evaluate", str(spec_path), "--db", str(db), "--quiet",
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_kill_and_resume_loses_nothing(tmp_path):
    spec_path = tmp_path / "spec.yaml"
    spec = {**TINY, "attacks": [{"name": "inverting-gradients", "options": {"iterations": 60}}]}
    spec_path.write_text(yaml.safe_dump(spec))
    db = tmp_path / "r.db"
    proc = _cli(spec_path, db)
    deadline = time.time() + 240
    done = {}
    while time.time() < deadline and proc.poll() is None:
        if db.exists():
            try:
                done = {k: v for k, v in finished(db).items() if v[0] == "done"}
            except sqlite3.OperationalError:  # schema not created yet
                pass
        if len(done) >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 2 <= len(done) < 6, proc.stderr.read().decode()[-2000:]
    before = {k: v for k, v in finished(db).items() if v[0] == "done"}
    summary = evaluate(spec, db)
    after = finished(db)
    assert summary.complete and len(after) == 6
    assert all(after[k] == v for k, v in before.items()), "trials finished before the kill must not run again"
    assert all(s == "done" for s, _, _ in after.values())


@pytest.mark.slow
def test_two_processes_share_one_store(tmp_path):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(TINY))
    db = tmp_path / "r.db"
    Store(db).close()
    procs = [_cli(spec_path, db) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read().decode()[-2000:]
    rows = finished(db)
    assert len(rows) == N_TRIALS
    assert all(s == "done" and a == 1 for s, a, _ in rows.values()), "a trial ran twice or was lost"


@pytest.mark.slow  # a cold pool, ~12 s: `make test-slow` (tests/evaluation/running/test_runners.py checks a warm pool against local)
def test_process_pool_matches_in_process(tmp_path):
    local = evaluate(TINY, tmp_path / "a.db")
    pooled = evaluate(TINY, tmp_path / "b.db", workers=2)
    assert local.complete and pooled.complete
    with Store(tmp_path / "a.db") as a, Store(tmp_path / "b.db") as b:
        ra = {r["key"]: r for r in a.rows()}
        rb = {r["key"]: r for r in b.rows()}
    assert ra.keys() == rb.keys() == {t.key for t in plan(load_spec(TINY))}
    for key in ra:
        assert ra[key]["metrics"] == rb[key]["metrics"]
        assert ra[key]["per_sample"] == rb[key]["per_sample"]
    local_workers = {r["worker"] for r in ra.values()}
    pool_workers = {r["worker"] for r in rb.values()}
    assert all(pool_workers) and pool_workers.isdisjoint(local_workers), "the pool's processes ran the trials"


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc to find the worker processes")
@pytest.mark.slow  # test_kill_and_resume_loses_nothing stays in `make test`
def test_kill_parent_leaves_no_worker_and_resume_commits_each_trial_once(tmp_path):
    # 80 short trials: the pool sends them in chunks, results still come back and commit one by one
    spec = {**TINY, "batch_sizes": [1], "images": 80, "defenses": ["none"],
            "attacks": [{"name": "inverting-gradients", "options": {"iterations": 10}}]}
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    db = tmp_path / "r.db"
    proc = _cli(spec_path, db, "--workers", "2")
    deadline = time.time() + 240
    done, workers = {}, set()
    while time.time() < deadline and proc.poll() is None:
        workers |= set(_children(proc.pid))
        if db.exists():
            try:
                done = {k: v for k, v in finished(db).items() if v[0] == "done"}
            except sqlite3.OperationalError:  # schema not created yet
                pass
        if len(done) >= 4:
            break
        time.sleep(0.02)
    workers |= set(_children(proc.pid))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 4 <= len(done) < 80, proc.stderr.read().decode()[-2000:]
    assert len(workers) >= 2, "expected the pool's 2 worker processes"
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)], "worker processes outlived their parent"
    before = {k: v for k, v in finished(db).items() if v[0] == "done"}
    summary = evaluate(spec, db)
    after = finished(db)
    assert summary.complete and len(after) == 80 and all(s == "done" for s, _, _ in after.values())
    assert all(after[k] == v for k, v in before.items()), "trials finished before the kill must not run again"
    with Store(db) as store:
        assert len(store.rows(status="done")) == 80


@pytest.mark.slow  # two sweeps with workers; test_kill_and_resume_loses_nothing stays fast: `make test-slow`
def test_kill_during_a_batched_chunk_and_resume_equals_an_uninterrupted_run(tmp_path):
    """In-process chunks of 32 stacked Inverting Gradients trials: a kill -9 while the second chunk is being solved
    loses only that chunk, the resumed sweep runs each lost trial once, and every result equals an uninterrupted
    sweep's (the same chunks stacked)."""
    from leakbench.evaluation.running.chunks import CPU_STACK

    spec = {**TINY, "batch_sizes": [1], "images": 3 * CPU_STACK, "defenses": ["none"],
            "attacks": [{"name": "inverting-gradients", "options": {"iterations": 60}}]}
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    db = tmp_path / "r.db"
    proc = _cli(spec_path, db)
    deadline = time.time() + 240
    done = {}
    while time.time() < deadline and proc.poll() is None:
        if db.exists():
            try:
                done = {k: v for k, v in finished(db).items() if v[0] == "done"}
            except sqlite3.OperationalError:  # schema not created yet
                pass
        if len(done) >= CPU_STACK:  # the first chunk is in: the second is being observed or solved
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(done) == CPU_STACK, proc.stderr.read().decode()[-2000:]
    running = [k for k, v in finished(db).items() if v[0] == "running"]
    assert len(running) <= CPU_STACK, "no trial is claimed beyond the chunk in flight"
    before = {k: v for k, v in finished(db).items() if v[0] == "done"}
    summary = evaluate(spec, db)
    after = finished(db)
    assert summary.complete and summary.ran == 2 * CPU_STACK and len(after) == 3 * CPU_STACK
    assert all(s == "done" for s, _, _ in after.values())
    assert all(after[k] == v for k, v in before.items()), "trials finished before the kill must not run again"
    whole = evaluate(spec, tmp_path / "whole.db")
    assert whole.complete
    with Store(db) as a, Store(tmp_path / "whole.db") as b:
        resumed = {r["key"]: r for r in a.rows()}
        uninterrupted = {r["key"]: r for r in b.rows()}
    assert resumed.keys() == uninterrupted.keys()
    for key, row in resumed.items():
        assert row["metrics"] == uninterrupted[key]["metrics"]
        assert row["per_sample"] == uninterrupted[key]["per_sample"]
