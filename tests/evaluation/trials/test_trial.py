"""Trials: a pure function of their spec (same spec → same result), n/a and failures recorded, never raised."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from leakbench.evaluation import load_spec, plan, run_trial
from leakbench.evaluation.trials.trial import TrialSpec

TINY = {
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "cnn:3-4-2-1", "act": "tanh"}, {"spec": "mlp:20", "act": "relu"}],
    "batch_sizes": [2],
    "images": 2,
    "attacks": [{"name": "inverting-gradients", "preset": "quick", "options": {"iterations": 8}},
                {"name": "fc-inversion", "preset": "quick"}],
    "defenses": ["noise:0.01"],
}


@pytest.fixture(scope="module")
def trials():
    return {(t.model, t.attack): t for t in plan(load_spec(TINY))}


def test_same_spec_same_result(trials):
    trial = trials[("cnn:3-4-2-1", "inverting-gradients")]
    torch.manual_seed(123)
    before = torch.rand(3)
    first = run_trial(trial)
    second = run_trial(TrialSpec.from_dict(trial.to_dict()))  # a copy rebuilt from its stored form
    assert first.status == second.status == "done", first.error
    assert first.metrics == second.metrics
    assert first.per_sample == second.per_sample
    for name in ("x", "y", "reconstruction", "labels", "order"):
        np.testing.assert_array_equal(first.arrays[name], second.arrays[name])
    assert first.arrays["x"].shape == (2, 1, 8, 8)
    assert set(first.per_sample["rmse"]) and len(first.per_sample["rmse"]) == 2
    assert np.isclose(first.metrics["rmse"], np.sqrt(np.mean(first.per_sample["mse"])))
    assert first.timings["total"] >= first.timings["attack"] > 0
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), before), "a trial must not disturb the caller's global RNG"


def test_key_depends_on_what_changes_the_result(trials):
    trial = trials[("cnn:3-4-2-1", "inverting-gradients")]
    data = trial.to_dict()
    relabelled = TrialSpec.from_dict({**data, "attack_key": "renamed", "threads": 2, "device": "cpu"})
    assert relabelled.key == trial.key
    for change in ({"seed": 1}, {"defense": "noise:0.02"}, {"options": {"iterations": 9}}, {"batch": 1}):
        assert TrialSpec.from_dict({**data, **change}).key != trial.key


def test_a_revised_preset_is_a_new_trial_and_an_unrevised_one_keeps_its_key(trials):
    import hashlib
    import json

    from leakbench.evaluation.trials.trial import NOT_IDENTITY

    quick = trials[("cnn:3-4-2-1", "inverting-gradients")]
    assert quick.preset_revision == 0
    legacy = {k: v for k, v in quick.to_dict().items()  # the identity as stores wrote it before revisions
              if k not in NOT_IDENTITY and k not in ("server", "target", "membership", "indices", "preset_revision",
                                                                "client", "plugins")}
    assert quick.key == hashlib.sha256(json.dumps(legacy, sort_keys=True, default=str).encode()).hexdigest()[:20]
    spec = {**TINY, "attacks": [{"name": "inverting-gradients", "preset": "fast", "options": {"iterations": 8}}]}
    fast = next(t for t in plan(load_spec(spec)) if t.model == "cnn:3-4-2-1")
    assert fast.preset_revision >= 2, "the fast preset changed after it shipped (tv_growth)"
    before = TrialSpec.from_dict({**fast.to_dict(), "preset_revision": 0})  # what an older store holds
    assert before.key != fast.key
    assert TrialSpec.from_dict(fast.to_dict()).key == fast.key  # round trip through the stored form


def test_batches_cover_the_same_images_for_every_batch_size(trials):
    from leakbench.evaluation.trials.inputs import batch_for, dataset_for

    trial = trials[("cnn:3-4-2-1", "inverting-gradients")]
    data = dataset_for(trial)
    x2, _ = batch_for(trial, data)
    ones = [batch_for(TrialSpec.from_dict({**trial.to_dict(), "batch_size": 1, "batch": b}), data)[0]
            for b in range(2)]
    assert torch.equal(torch.cat(ones), x2)


def test_unsupported_attack_is_not_applicable_with_reason(trials):
    result = run_trial(trials[("cnn:3-4-2-1", "fc-inversion")])
    assert result.status == "n/a"
    assert "fully connected" in result.error and result.traceback is None
    assert run_trial(trials[("mlp:20", "fc-inversion")]).status == "done"


def test_failure_is_recorded_not_raised(trials):
    bad = TrialSpec.from_dict({**trials[("mlp:20", "fc-inversion")].to_dict(), "data_options": {"size": 0}})
    result = run_trial(bad)
    assert result.status == "failed"
    assert result.error.startswith("ConfigError:") and "size" in result.error
    assert "Traceback" in result.traceback


def test_trial_budget_stops_a_long_attack(trials):
    slow = TrialSpec.from_dict({**trials[("cnn:3-4-2-1", "inverting-gradients")].to_dict(),
                                "options": {"iterations": 100000}, "trial_seconds": 0.5})
    result = run_trial(slow)
    assert result.status == "timed out" and "trial_seconds=0.5" in result.error, result.error
    assert result.error.startswith("ran ") and " of 100000 steps" in result.error
    assert result.timings["total"] < 30
    # the guard counts the attack alone: loading and observing come before it and are not charged
    before = sum(result.timings.get(k, 0.0) for k in ("load", "model", "observe"))
    assert result.timings["total"] - before < 0.5 + 5


def test_a_timed_out_trial_shows_in_the_strongest_attack_table(trials):
    from leakbench.cli.evaluate import strongest_tables
    from leakbench.evaluation import strongest

    rows = [{"kind": "attack", "dataset": "d", "model": "m", "defense": "none", "batch_size": 1, "attack": a,
             "status": status, "rmse": rmse, "psnr": 10.0, "ssim": 0.5, "error": error}
            for a, status, rmse, error in (("ig", "done", 0.2, None),
                                           ("dlg", "timed out", None, "ran 40 of 300 steps: the attack exceeded"))]
    (best,) = strongest(rows)
    assert best.attack == "ig" and {a.attack: a.timed_out for a in best.scores} == {"ig": 0, "dlg": 1}
    assert any("timed out: ran 40 of 300" in r for a in best.scores for r in a.reasons)
    table = strongest_tables([best])[0]
    assert list(table.columns[-1].cells) == ["1/2 (1 timed out)"]


def test_trained_model_state_is_part_of_the_trial(tmp_path):
    spec = {**TINY, "models": [{"spec": "mlp:20", "act": "relu", "training": {"epochs": 1, "batch_size": 64}}],
            "attacks": [{"name": "fc-inversion", "preset": "quick"}], "defenses": ["none"], "batch_sizes": [1]}
    trained = plan(load_spec(spec))[0]
    untrained = TrialSpec.from_dict({**trained.to_dict(), "training": {**trained.training, "epochs": 0}})
    assert trained.key != untrained.key and trained.model_key.endswith("@1ep")
    a = run_trial(trained, cache_dir=tmp_path)
    b = run_trial(untrained, cache_dir=tmp_path)
    assert a.status == b.status == "done", (a.error, b.error)
    assert len(list((tmp_path / "models").glob("*.pt"))) == 1  # the trained weights are cached once
    again = run_trial(trained, cache_dir=tmp_path)  # from the cache: same result
    assert again.metrics == a.metrics


@pytest.mark.parametrize("defense", ["noise:0.01+clip:1,layer", "noise:0.01+prune:0.5,layer"])
def test_bound_trial_refuses_per_layer_scopes_it_does_not_model(trials, defense):
    base = trials[("mlp:20", "fc-inversion")].to_dict()
    bound = TrialSpec.from_dict({**base, "kind": "bound", "attack": "", "defense": defense})
    result = run_trial(bound)
    assert result.status == "n/a" and "global" in result.error and "layer" in result.error


def test_per_image_chance_averages_to_the_batch_chance():
    import math

    import leakbench as lb
    from leakbench.evaluation.trials.controls import chance_per_sample, chance_scores, constant_output

    data = lb.load("digits", size=8)
    x, _ = data.batch(5, seed=1)
    each = chance_per_sample(x, data)
    assert len(each) == 5 and math.isclose(math.sqrt(np.mean(np.square(each))), chance_scores(x, data)["chance_rmse"])
    assert constant_output(torch.full((2, 1, 4, 4), 0.5)) and not constant_output(x)


def test_an_attack_that_determines_nothing_fails_with_the_reason_and_keeps_per_image_chance():
    spec = TrialSpec(kind="attack", dataset="digits", model="mlp:32", data_options={"size": 8},
                     model_options={"act": "relu"}, defense="noise:1", batch_size=4, images=4,
                     attack="exclusivity", attack_key="exclusivity")
    result = run_trial(spec)
    assert result.status == "failed" and "determined nothing" in result.error
    ok = run_trial(TrialSpec(**{**spec.to_dict(), "defense": "none", "attack": "fc-inversion",
                                "attack_key": "fc-inversion", "batch_size": 1}))
    assert ok.status == "done" and len(ok.per_sample["chance_rmse"]) == 1


def test_a_utility_run_that_ends_above_its_untrained_loss_is_diverged_not_failed():
    spec = TrialSpec(kind="utility", dataset="digits", model="mlp:32", data_options={"size": 8},
                     model_options={"act": "relu"}, defense="none", batch_size=8,
                     utility={"epochs": 1, "batch_size": 8, "lr": 50.0, "test_fraction": 0.2, "seed": 0})
    result = run_trial(spec)
    assert result.status == "done" and result.metrics["diverged"]
    assert result.metrics["train_loss"] is None or result.metrics["train_loss"] > result.metrics["initial_loss"]


def test_an_attack_trial_stores_iip_and_registered_psnr_beside_their_chance(trials):
    from leakbench.evaluation.trials.controls import IIP_POOL, identification_pool
    from leakbench.evaluation.trials.inputs import dataset_for

    spec = TrialSpec(**{**trials[("mlp:20", "fc-inversion")].to_dict(), "defense": "none", "batch_size": 1})
    result = run_trial(spec)
    assert result.status == "done", result.error
    m = result.metrics
    assert m["iip_pixel"] == 1.0 and 0.0 <= m["chance_iip_pixel"] <= 1.0  # one exact image: its own neighbour
    assert m["iip_features"] == 1.0 and 0.0 <= m["chance_iip_features"] <= 1.0  # the MLP's hidden features
    assert m["psnr_registered"] >= m["psnr"] > m["chance_psnr_registered"]
    data = dataset_for(spec)
    x = data.images[:3]
    pool = identification_pool(x, data, seed=5)
    assert pool.shape[0] == min(IIP_POOL, len(data.images)) and torch.equal(pool[:3], x)
    assert torch.equal(pool, identification_pool(x, data, seed=5))
    others = pool[3:].flatten(1)
    assert not (others[:, None, :] == x.flatten(1)[None]).all(-1).any()  # the originals only once, first
