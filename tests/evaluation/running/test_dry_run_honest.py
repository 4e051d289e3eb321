"""``evaluate --dry-run`` never says valid for a spec whose every trial would fail: each training run passes the
check it makes at run time, floats are finite, canaries make a guess (docs/evaluation.md's promise)."""
from __future__ import annotations

import pytest

from leakbench.errors import ConfigError
from leakbench.evaluation import load_spec
from leakbench.evaluation.running.preflight import preflight
from leakbench.evaluation.membership.audit import check_canaries, min_canaries

pytestmark = pytest.mark.usefixtures("one_thread")

ENTRY = {"dataset": {"name": "digits"}, "model": {"spec": "mlp:8", "act": "relu"},
         "training": {"epochs": 1, "batch_size": 16, "lr": 0.1}, "pool": 40, "reference_models": 1,
         "defenses": ["none", "dpsgd:1,1"]}
SPEC = {"name": "dry", "datasets": [{"name": "digits", "options": {"size": 8}}], "models": ["mlp:8"],
        "batch_sizes": [1], "membership": [ENTRY]}


def _check(spec):
    return preflight(load_spec(spec))


def test_a_sound_membership_spec_passes():
    assert _check(SPEC).trials > 0


@pytest.mark.parametrize("change, match", [
    ({"training": {"epochs": 1, "batch_size": 16, "lr": float("inf")}}, r"membership\.0\.training\.lr|lr"),
    ({"training": {"epochs": 1, "batch_size": 16, "lr": float("nan")}}, r"lr"),
    ({"training": {"epochs": 1, "batch_size": 21, "lr": 0.1}}, r"batch_size ≤ 20 .*membership\[0\]\.training"),
    ({"pool": 10, "training": {"epochs": 1, "batch_size": 6, "lr": 0.1}}, r"batch_size ≤ 5"),
    ({"canaries": 1}, r"canaries ≥ 5 .*membership\[0\]\.canaries"),
    ({"canaries": 4}, r"canaries ≥ 5"),
    ({"training": {"epochs": 1, "batch_size": 16, "lr": 0.1, "loss": "hinge"}}, r"loss"),
])
def test_a_membership_recipe_that_fails_every_trial_is_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        _check({**SPEC, "membership": [{**ENTRY, **change}]})


def test_the_utility_recipe_the_entry_falls_back_to_is_checked_too():
    entry = {k: v for k, v in ENTRY.items() if k != "training"}
    with pytest.raises(ConfigError, match=r"batch_size ≤ 20 .*field utility"):
        _check({**SPEC, "utility": {"epochs": 1, "batch_size": 64, "lr": 0.1, "per_batch_size": False},
                "membership": [entry]})


@pytest.mark.parametrize("section", [
    {"threat": {"local_steps": 1, "local_lr": float("inf")}},
    {"utility": {"epochs": 1, "lr": float("inf")}},
    {"models": [{"spec": "mlp:8", "training": {"epochs": 1, "lr": float("nan")}}]},
])
def test_no_float_field_of_a_spec_takes_nan_or_inf(section):
    with pytest.raises(ConfigError, match="finite|inf|nan"):
        load_spec({**SPEC, "membership": [], **section})


def test_a_model_training_batch_larger_than_the_dataset_is_refused():
    with pytest.raises(ConfigError, match=r"batch_size ≤ \d+ .*models\[0\]\.training"):
        _check({**SPEC, "membership": [], "attacks": ["dlg"],
                "models": [{"spec": "mlp:8", "training": {"epochs": 1, "batch_size": 100_000}}]})


def test_canaries_count_from_the_audit_grid():
    assert min_canaries() == 5
    assert check_canaries(5) == 5
    for bad in (0, 1, 4, True, 2.5):
        with pytest.raises(ConfigError, match="canaries ≥ 5"):
            check_canaries(bad)
