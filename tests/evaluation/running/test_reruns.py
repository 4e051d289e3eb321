"""A trial is a pure function of its spec: every attack's trial, run in two fresh processes, gives the same bits.

Issue 32 §5: two runs of ``leakbench demo`` differed on liu2024 / tensor-features trials on the random head.
The cause was ``torch.linalg.lstsq``'s default CPU driver ``gelsy``, whose solutions differ between processes
(MKL); the attacks now solve with ``gelsd`` (:mod:`leakbench.attacks.solvers.linalg`).  Each process has its own hash
seed (``PYTHONHASHSEED`` unset) and its own cache directory; metrics are compared exactly (every attack here
runs on the CPU, where no kernel is documented nondeterministic; the CUDA rerun lives in tests/test_cuda.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import leakbench as lb

DIGITS = {"name": "digits", "options": {"size": 8}}
HEAD = {"spec": "cnn:3-4-2-1", "act": "relu", "label": "head", "server": {"random_head": {"width": 300}, "public": 64}}
LIU = {"name": "liu2024", "options": {"generator": False, "distance": "cosine", "iterations": 10, "lr": 0.1}}
TENSOR = {"name": "tensor-features", "preset": "quick", "options": {"inversion_iterations": 10}}
#: the demo's failing cells (liu2024 / tensor-features on the random head, clip:1) beside IG and fc-inversion
SPEC = {
    "name": "reruns",
    "datasets": [DIGITS],
    "models": [{"spec": "mlp:32", "act": "relu", "label": "mlp"}, HEAD],
    "batch_sizes": [8],
    "images": 8,
    "seeds": [0],
    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 10}}, {"name": "fc-inversion"}, LIU, TENSOR],
    "defenses": ["none", "clip:1"],
    "include": [{"model": "mlp", "attack": ["inverting-gradients", "fc-inversion"], "defense": "none"},
                {"model": "head", "attack": ["liu2024", "tensor-features"]}],
}
#: every attack: each gradient attack on the model it is built for, and the trained-weights and membership kinds
EVERY = {
    "name": "reruns-every",
    "datasets": [DIGITS],
    "models": [{"spec": "mlp:32", "act": "relu", "label": "mlp"},
               {"spec": "cnn:3-4-2-1", "act": "relu", "label": "cnn"},
               {"spec": "mlp:32", "act": "relu", "label": "imprint", "server": {"imprint": {"bins": 16}, "public": 64}},
               {"spec": "mlp:64", "act": "relu", "label": "trap", "server": {"trap_weights": {}, "public": 64}},
               HEAD],
    "batch_sizes": [1, 4],
    "images": 4,
    "seeds": [0],
    "attacks": [
        {"name": "dlg", "options": {"iterations": 3}},
        {"name": "inverting-gradients", "options": {"iterations": 10}},
        {"name": "fc-inversion"},
        {"name": "rgap"},
        {"name": "hybrid", "preset": "quick", "options": {"iters_1": 5, "iters_2": 5, "iters_rest": 5}},
        {"name": "exclusivity", "preset": "quick"},
        {"name": "spear", "preset": "quick"},
        {"name": "cocktail-party", "preset": "quick"},
        {"name": "robbing-the-fed"},
        {"name": "trap-weights"},
        LIU,
        TENSOR,
    ],
    "defenses": ["none", "clip:1"],
    "include": [
        {"model": "mlp", "attack": ["dlg", "fc-inversion", "exclusivity", "spear", "cocktail-party"],
         "batch_size": 4, "defense": "none"},
        {"model": "mlp", "attack": ["rgap", "hybrid"], "batch_size": 1, "defense": "none"},
        {"model": "cnn", "attack": "inverting-gradients", "batch_size": 4, "defense": "none"},
        {"model": "imprint", "attack": "robbing-the-fed", "batch_size": 4, "defense": "none"},
        {"model": "trap", "attack": "trap-weights", "batch_size": 4, "defense": "none"},
        {"model": "head", "attack": ["liu2024", "tensor-features"], "batch_size": 4},
    ],
    "weights": [{"target": {"dataset": {"name": "sphere", "options": {"n": 20, "d": 10}}, "per_class": 4,
                            "options": {"model": "twolayer:50", "lr": 0.5, "steps": 200, "loss_tol": 0,
                                        "center": False}},
                 "attacks": [{"name": "kkt", "options": {"runs": 1, "iterations": 20, "candidates": 8}},
                             {"name": "model-inversion", "options": {"iterations": 20}}, "univariate"]}],
    "membership": [{"target": {"dataset": {"name": "sphere", "options": {"n": 20, "d": 10}}, "per_class": 4,
                               "options": {"model": "twolayer:50", "lr": 0.5, "steps": 200, "loss_tol": 0,
                                           "center": False}}}],
}

RUN = """
import json, sys
from leakbench.evaluation import load_spec, plan
from leakbench.evaluation.running.run import run_trial
out = {}
for trial in plan(load_spec(json.loads(sys.argv[1]))):
    r = run_trial(trial, cache_dir=sys.argv[2])
    key = f"{trial.attack} {trial.defense}" + (f" {trial.membership['setting']}" if trial.membership else "")
    out[key] = [r.status, r.error, r.metrics]
print(json.dumps(out))
"""


def _run(spec: dict, cache) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(spec), str(cache)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _same_bits(spec: dict, tmp_path) -> dict:
    first, second = _run(spec, tmp_path / "a"), _run(spec, tmp_path / "b")
    for key, (status, error, _metrics) in first.items():
        assert status in ("done", "n/a"), (key, error)
    different = {key: (first[key], second[key]) for key in first if first[key] != second[key]}
    assert not different, f"results differ between two runs of one spec: {different}"
    return first


@pytest.mark.slow  # two fresh processes: `make test-slow`
def test_the_random_head_trials_give_the_same_bits_in_two_fresh_processes(tmp_path):
    results = _same_bits(SPEC, tmp_path)
    assert sorted(results) == ["fc-inversion none", "inverting-gradients none", "liu2024 clip:1", "liu2024 none",
                               "tensor-features clip:1", "tensor-features none"]
    assert all(status == "done" for status, _, _ in results.values())


@pytest.mark.slow
def test_every_attack_gives_the_same_bits_in_two_fresh_processes(tmp_path):
    from leakbench.attacks.membership import MEMBERSHIP_ATTACKS

    results = _same_bits(EVERY, tmp_path)
    assert {key.split()[0] for key in results} == set(lb.ATTACKS.names()) | set(MEMBERSHIP_ATTACKS.names())
