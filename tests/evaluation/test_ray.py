"""The Ray executor on a local Ray cluster gives the same results as the in-process one."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'leakbench[ray]')")

from leakbench.evaluation import Store, Sweep, evaluate  # noqa: E402
from leakbench.evaluation.runners import RayRunner  # noqa: E402

TINY = {
    "name": "tiny-ray",
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "cnn:3-4-2-1", "act": "tanh"}],
    "batch_sizes": [1, 2],
    "images": 2,
    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 5}}],
    "defenses": ["noise:0.01"],
}


def test_ray_matches_local(tmp_path):
    local = evaluate(TINY, tmp_path / "local.db")
    runner = RayRunner("local", num_cpus=2)
    try:
        sweep = Sweep(TINY, tmp_path / "ray.db", runner=runner)
        summary = sweep.run()
        assert runner.state_dict()["submitted"] == 3
        sweep.store.close()
    finally:
        runner.close()
    assert local.complete and summary.complete and summary.ran == 3
    with Store(tmp_path / "local.db") as a, Store(tmp_path / "ray.db") as b:
        ra = {r["key"]: r for r in a.rows()}
        rb = {r["key"]: r for r in b.rows()}
    assert ra.keys() == rb.keys() and len(ra) == 3
    for key in ra:
        assert rb[key]["status"] == "done"
        assert ra[key]["metrics"] == rb[key]["metrics"]
        assert ra[key]["per_sample"] == rb[key]["per_sample"]
    assert all(r["npz"] for r in rb.values())
