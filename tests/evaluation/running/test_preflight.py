"""preflight: the trial count agrees with the plan, the size limit, what a dry run checks."""
from __future__ import annotations

import pytest

from leakbench.errors import ConfigError
from leakbench.evaluation import load_spec, plan
from leakbench.evaluation.running.preflight import check_size, count_trials, preflight
from leakbench.evaluation.sweep_spec.check import MAX_TRIALS

BASE = {"datasets": ["digits", {"name": "digits", "options": {"size": 16}}], "models": ["mlp:8", "cnn:3-4-2-1"],
        "batch_sizes": [1, 2, 4], "images": 5, "attacks": ["dlg", {"name": "fc-inversion", "preset": "quick"}],
        "defenses": ["none", {"prune": [0.5, 0.9]}, "noise:0.01"], "seeds": [0, 1]}


@pytest.mark.parametrize("extra", [
    {},
    {"exclude": [{"attack": "dlg", "batch_size": 4}, {"defense": "prune", "seed": 1}]},
    {"include": [{"model": "mlp:8"}, {"defense": "noise:0.01", "batch_size": [2, 4]}]},
    {"utility": {"epochs": 1}, "bounds": {"cramer_rao": True}, "exclude": [{"attack": "fc-inversion"}]},
    {"images": 1, "batch_sizes": [3]},
])
def test_count_agrees_with_the_plan(extra):
    spec = load_spec({**BASE, **extra})
    trials = plan(spec)
    counts = count_trials(spec)
    assert counts == {k: sum(1 for t in trials if t.kind == k) for k in {t.kind for t in trials}}
    assert check_size(spec) == len(trials)


def test_size_limit_and_its_overrides():
    spec = load_spec({**BASE, "images": 2000})  # 2 × 2 × 4 × (2000 + 1000 + 500) × 2 × 2 = 224 000 trials
    with pytest.raises(ConfigError, match=f"224,000 trials, more than the limit of {MAX_TRIALS:,}"):
        check_size(spec)
    assert check_size(spec, yes=True) == 224_000
    assert check_size(load_spec({**BASE, "images": 2000, "max_trials": 300_000})) == 224_000


def test_preflight_reports_what_it_checked():
    report = preflight(load_spec(BASE))
    assert report.trials == len(plan(load_spec(BASE))) and report.models == 4
    assert report.datasets == {"digits": ((1, 8, 8), 1797, 10), "digits(size=16)": ((1, 16, 16), 1797, 10)}
    assert "checked 2 dataset(s)" in report.summary()


def test_preflight_names_the_model_and_the_dataset_it_fails_on():
    spec = load_spec({**BASE, "models": ["mlp:8", "cnn:12-4-1-0"]})  # a 12×12 kernel fits 16×16, not 8×8
    with pytest.raises(ConfigError, match=r"models\[1\] \(cnn:12-4-1-0\) on datasets\[0\] \(digits, shape 1×8×8\)"):
        preflight(spec)
