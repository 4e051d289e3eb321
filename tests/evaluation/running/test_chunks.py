"""Chunks of trials in batched calls: each trial's result equals its result alone; failures stay per trial."""
from __future__ import annotations

import dataclasses

import pytest

from leakbench.evaluation.running import chunks
from leakbench.evaluation import load_spec, plan
from leakbench.evaluation.running.chunks import batch_group, batched_order, run_chunk
from leakbench.evaluation.running.run import run_trial

SPEC = {
    "name": "chunks",
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "cnn:3-4-2-1", "act": "tanh"}],
    "batch_sizes": [1],
    "images": 4,
    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 8}}],
    "defenses": ["none"],
}


def _same(a, b) -> None:
    assert a.key == b.key and a.status == b.status == "done"
    assert a.metrics.keys() == b.metrics.keys()
    for name, value in a.metrics.items():
        if isinstance(value, float):
            assert value == pytest.approx(b.metrics[name], rel=1e-5, abs=1e-7), name
        else:
            assert value == b.metrics[name], name


def test_a_chunk_of_attack_trials_equals_each_trial_alone():
    trials = plan(load_spec(SPEC))
    assert len({batch_group(t) for t in trials}) == 1
    stacked = list(run_chunk(trials))
    for trial, result in zip(trials, stacked):
        assert result.timings["stacked"] == len(trials)
        _same(result, run_trial(trial))


def test_a_nan_trial_fails_alone_and_its_chunk_mates_are_untouched(monkeypatch):
    trials = plan(load_spec(SPEC))
    victim = trials[1].key
    observe = chunks.observation_for

    def poisoned(spec, cache_dir):  # a client whose gradient holds a NaN (a diverged client, a broken channel)
        obs = observe(spec, cache_dir)
        if spec.key == victim:
            obs.shared[0] = obs.shared[0] * float("nan")
        return obs

    monkeypatch.setattr(chunks, "observation_for", poisoned)
    results = {r.key: r for r in run_chunk(trials)}
    assert results[victim].status == "failed" and "non-finite" in results[victim].error
    for trial in trials:
        if trial.key != victim:
            _same(results[trial.key], run_trial(trial))


def test_a_batched_call_past_its_summed_budget_times_out_each_trial():
    spec = {**SPEC, "attacks": [{"name": "inverting-gradients", "options": {"iterations": 5000}}],
            "budget": {"trial_seconds": 0.05}}
    results = list(run_chunk(plan(load_spec(spec))))
    assert len(results) == 4 and all(r.status == "timed out" for r in results)
    assert all("batched call of 4 trials" in r.error for r in results)


@pytest.mark.slow  # trains 2 × 3 seeds: `make test-slow`
def test_utility_seeds_train_together_and_equal_each_seed_alone(tmp_path):
    spec = {**SPEC, "defenses": ["dpsgd:1,0.5"], "utility": {"epochs": 1, "batch_size": 16, "lr": 0.05},
            "attacks": [], "images": 0}
    base = [t for t in plan(load_spec({**spec, "attacks": SPEC["attacks"], "images": 1})) if t.kind == "utility"]
    trials = [dataclasses.replace(base[0], utility={**base[0].utility, "seed": s}) for s in (0, 1, 2)]
    assert len({t.key for t in trials}) == 3
    assert {batch_group(t) for t in trials} == {None}, "on a CPU seeds train one after the other (measured faster)"
    on_cuda = [dataclasses.replace(t, device="cuda") for t in trials]  # grouped there (tests/test_cuda.py runs it)
    assert len({batch_group(t) for t in on_cuda}) == 1 and None not in {batch_group(t) for t in on_cuda}
    prepared = chunks._utility_group(trials, None)  # the stacked call a CUDA chunk makes, here on the CPU
    stacked = [run_trial(t, prepared=prepared[t.key]) for t in trials]
    for trial, result in zip(trials, stacked):
        _same(result, run_trial(trial))
    assert len({r.metrics["train_loss"] for r in stacked}) == 3, "three seeds, three runs"


def test_batched_order_puts_each_group_together():
    spec = {**SPEC, "attacks": [{"name": "inverting-gradients", "options": {"iterations": 8}},
                                {"name": "dlg", "options": {"iterations": 2}}]}
    trials = plan(load_spec(spec))
    assert [t.attack for t in trials][:2] == ["inverting-gradients", "dlg"], "the plan alternates attacks"
    ordered = batched_order(trials)
    assert sorted(t.key for t in ordered) == sorted(t.key for t in trials)
    assert [t.attack for t in ordered] == ["inverting-gradients"] * 4 + ["dlg"] * 4
    assert batch_group(ordered[-1]) is None, "DLG's L-BFGS runs alone"


def test_the_spec_stack_bounds_a_chunk_and_one_runs_every_trial_alone():
    from leakbench.evaluation.running.chunks import CPU_STACK, stack_size

    default, two, alone = (plan(load_spec({**SPEC, **extra})) for extra in ({}, {"stack": 2}, {"stack": 1}))
    assert [t.key for t in default] == [t.key for t in two] == [t.key for t in alone], "stack is no part of a key"
    assert stack_size(default[0]) == CPU_STACK and stack_size(two[0]) == 2 and stack_size(alone[0]) == 1
    assert batch_group(alone[0]) is None and batch_group(two[0]) is not None
    results = list(run_chunk(alone))
    assert all("stacked" not in r.timings for r in results), "stack 1: no batched call"
    for result, stacked in zip(results, run_chunk(default)):
        _same(result, stacked)


def test_a_stack_out_of_bounds_is_refused_with_the_field_named():
    from leakbench.errors import ConfigError

    for bad in (0, 10**6):
        with pytest.raises(ConfigError, match="stack"):
            load_spec({**SPEC, "stack": bad})
