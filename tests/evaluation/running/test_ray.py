"""The Ray executor on a local Ray cluster (2 CPUs): actors give the in-process results, in chunks, sized by the spec."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'leakbench[ray]')")

from leakbench.evaluation import Store, Sweep, evaluate  # noqa: E402
from leakbench.evaluation.running.ray_runner import RayRunner  # noqa: E402
from leakbench.evaluation.trials.trial import TrialSpec  # noqa: E402
from leakbench.evaluation.running.workers import ray_device  # noqa: E402

TINY = {
    "name": "tiny-ray",
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "cnn:3-4-2-1", "act": "tanh"}],
    "batch_sizes": [1, 2],
    "images": 2,
    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 5}}],
    "defenses": ["noise:0.01"],
}
SHORT = {**TINY, "name": "short-ray", "batch_sizes": [1], "images": 10, "defenses": ["none"]}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """One local cluster for the module; each runner joins it and kills only its own actors on close."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _same(a_db, b_db, n: int) -> None:
    with Store(a_db) as a, Store(b_db) as b:
        ra = {r["key"]: r for r in a.rows()}
        rb = {r["key"]: r for r in b.rows()}
    assert ra.keys() == rb.keys() and len(ra) == n
    for key in ra:
        assert rb[key]["status"] == "done" and rb[key]["attempts"] == 1
        assert ra[key]["metrics"] == rb[key]["metrics"]
        assert ra[key]["per_sample"] == rb[key]["per_sample"]
    assert all(r["npz"] for r in rb.values())


def _run(spec, db, runner):
    try:
        sweep = Sweep(spec, db, runner=runner)
        summary = sweep.run()
        sweep.store.close()
        return summary
    finally:
        runner.close()


def test_ray_actors_match_local_one_at_a_time_and_in_chunks(tmp_path):
    evaluate(TINY, tmp_path / "tiny-local.db")
    evaluate(SHORT, tmp_path / "short-local.db")
    runner = RayRunner("local", num_cpus=2, chunk_seconds=5.0)  # joins the module's cluster
    try:
        first = Sweep(TINY, tmp_path / "tiny-ray.db", runner=runner).run()
        assert runner.state_dict()["submitted"] == 3
        actors = runner.state_dict()["actors"]
        second = Sweep(SHORT, tmp_path / "short-ray.db", runner=runner).run()  # the same warm actors, chunked
        state = runner.state_dict()
    finally:
        runner.close()
    assert first.complete and first.ran == 3 and second.complete and second.ran == 10
    assert 1 <= actors == state["actors"] <= 2, state
    assert state["chunk"] > 1, "once its first trials are timed, the short sweep travels in chunks"
    assert runner.state_dict()["actors"] == 0 and ray.is_initialized(), "close() kills only the runner's actors"
    _same(tmp_path / "tiny-local.db", tmp_path / "tiny-ray.db", 3)
    _same(tmp_path / "short-local.db", tmp_path / "short-ray.db", 10)


@pytest.mark.slow  # a Ray start, ~7 s: `make test-slow` (test_ray_actors_match_local_one_at_a_time_and_in_chunks stays)
def test_ray_asks_for_the_spec_threads_and_gpus(tmp_path):
    spec = {**TINY, "threads": 2}
    runner = RayRunner("auto")
    summary = _run(spec, tmp_path / "ray.db", runner)
    assert summary.complete
    assert runner._limits == {(2, 0): 1}, "a 2-CPU cluster fits one actor of 2 threads"
    cuda = TrialSpec(kind="attack", dataset="digits", model="cnn:3-4-2-1", device="cuda:1", threads=3)
    assert RayRunner.resources(cuda) == (3, 1)
    assert ray_device(cuda).device == "cuda" and ray_device(cuda).key == cuda.key


@pytest.mark.slow
def test_trials_of_two_shapes_run_one_shape_at_a_time_and_none_is_lost():
    from dataclasses import replace

    from leakbench.evaluation import load_spec, plan

    trials = plan(load_spec(SHORT))[:6]
    mixed = [replace(t, threads=2) if i in (2, 3) else t for i, t in enumerate(trials)]  # 1, 1, 2, 2, 1, 1
    runner = RayRunner("auto", chunk_seconds=5.0)
    try:
        results = list(runner.run(mixed))
    finally:
        runner.close()
    assert sorted(r.key for r in results) == sorted(t.key for t in trials)
    assert all(r.status == "done" for r in results)
