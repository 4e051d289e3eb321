"""The seed-set stability benchmark builds valid, disjoint specs from the demo's eavesdropper part."""
from __future__ import annotations

from benchmarks import bench_verdicts
from leakbench.evaluation import load_spec, plan


def test_seed_sets_are_disjoint_valid_eavesdropper_specs():
    specs = [load_spec(bench_verdicts.eavesdropper_spec(s, u, quick=True))
             for s, u in zip(bench_verdicts.SEED_SETS, bench_verdicts.UTILITY_SEEDS)]
    keys = [{t.key for t in plan(s) if t.kind == "attack"} for s in specs]
    assert not (keys[0] & keys[1]) and not (keys[1] & keys[2])
    for s in specs:
        assert {m.key for m in s.models} == {"cnn"} and not s.weights and not s.membership
        assert {t.threat_model for t in plan(s) if t.kind == "attack"} == {"eavesdropper", "informed-eavesdropper"}
