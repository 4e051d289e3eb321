"""Every threat model in a sweep: the server's move, published weights, membership, honest tables."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from leakbench.errors import ConfigError
from leakbench.evaluation import Sweep, load_spec, plan, run_trial
from leakbench.evaluation.trials.trial import TrialSpec
from leakbench.evaluation.trials.inputs import apply_server, batch_for, dataset_for, model_for
from leakbench.evaluation.trials.controls import public_sample
from leakbench.models.malicious import ImprintBlock, RandomFeatureHead, find_module

pytestmark = pytest.mark.usefixtures("one_thread")

DIGITS = {"name": "digits", "options": {"size": 8}}
SERVER = {
    "datasets": [DIGITS],
    "models": [{"spec": "mlp:32", "act": "relu", "label": "honest"},
               {"spec": "mlp:32", "act": "relu", "label": "imprint", "server": {"imprint": {"bins": 32}}},
               {"spec": "cnn:3-4-2-1", "act": "relu", "label": "head",
                "server": {"random_head": {"width": 300}, "public": 64}}],
    "batch_sizes": [8],
    "images": 8,
    "attacks": ["robbing-the-fed", "fc-inversion"],
    "seeds": [0, 1],
}


def _trial(spec: dict, **match) -> TrialSpec:
    return next(t for t in plan(load_spec(spec)) if all(getattr(t, k) == v for k, v in match.items()))


def test_each_server_form_builds_the_modified_model():
    for label, block in (("imprint", ImprintBlock), ("head", RandomFeatureHead)):
        trial = _trial(SERVER, model_key=label, attack="robbing-the-fed")
        assert trial.threat_model == "malicious-server" and trial.server["move"] in ("imprint", "random_head")
        data = dataset_for(trial)
        honest = model_for(trial, data, torch.device("cpu"))
        shipped = apply_server(trial, honest, data)
        assert find_module(shipped, block) is not None and find_module(honest, block) is None
    honest_trial = _trial(SERVER, model_key="honest", attack="robbing-the-fed")
    assert honest_trial.threat_model == "eavesdropper" and not honest_trial.server


def test_server_options_are_validated_like_every_field():
    bad = {**SERVER, "models": [{"spec": "mlp:32", "server": {"imprint": {"bins": 8, "binz": 3}}}]}
    with pytest.raises(ConfigError, match=r"models\[0\]\.server\.imprint\.binz.*accepted options: bins"):
        load_spec(bad)
    both = {**SERVER, "models": [{"spec": "mlp:32", "server": {"imprint": {"bins": 8}, "random_head": {}}}]}
    with pytest.raises(ConfigError, match="exactly one server move"):
        load_spec(both)


def test_the_public_sample_never_holds_an_attacked_image():
    trial = _trial(SERVER, model_key="imprint", attack="robbing-the-fed")
    data = dataset_for(trial)
    x, _ = batch_for(trial, data)
    public = public_sample(data, x, 300, seed=0)
    assert public.shape[0] == 300
    same = (public.reshape(300, 1, -1) == x.reshape(1, x.shape[0], -1)).all(-1)
    assert not same.any()
    # asking for the whole dataset leaves exactly the attacked images out
    assert public_sample(data, x, len(data), seed=0).shape[0] == len(data) - len(torch.unique(x.reshape(8, -1), dim=0))


def _lone_samples(shipped, x: torch.Tensor) -> torch.Tensor:
    """Which samples sit alone between two consecutive imprint bin edges (independent of the attack)."""
    block = find_module(shipped, ImprintBlock)
    scores = x.reshape(x.shape[0], -1).double() @ block.query.double()
    edges = block.thresholds.double() if hasattr(block, "thresholds") else -block.linear0.bias.double()
    bins = (scores[:, None] > edges[None, :]).sum(1)
    return torch.tensor([int((bins == b).sum()) == 1 for b in bins])


def test_robbing_the_fed_in_a_sweep_recovers_exactly_the_lone_samples(tmp_path):
    sweep = Sweep(load_spec({**SERVER, "include": [{"model": "imprint", "attack": "robbing-the-fed"}]}),
                  tmp_path / "r.db", workers=1)
    sweep.run(progress=False)
    rows = [r for r in sweep.store.rows(kind="attack")]
    assert len(rows) == 2 and all(r["status"] == "done" and r["threat_model"] == "malicious-server" for r in rows)
    exact_total = 0
    for r in rows:
        trial = sweep.by_key[r["key"]]
        data = dataset_for(trial)
        x, _ = batch_for(trial, data)
        lone = _lone_samples(apply_server(trial, model_for(trial, data, torch.device("cpu")), data), x)
        per = torch.tensor(r["per_sample"]["mse"])
        assert bool((per[lone] < 1e-10).all()), (per, lone)
        assert bool((per[~lone] > 1e-6).all()), (per, lone)  # a blend of two samples is not either of them
        exact_total += int(lone.sum())
        assert r["metrics"]["chance_rmse"] > 0.1  # the flat-grey control is far from exact
        assert r["metrics"]["matching"] == "confident-first"  # RtF flags its lone samples; scored with the flags
    assert exact_total >= 4
    sweep.store.close()


TARGET = {"dataset": {"name": "digits", "options": {"size": 8, "binary": "odd-even"}}, "per_class": 6,
          "options": {"model": "mlp:100", "steps": 1500, "lr": 0.5, "loss_tol": 1e-6, "init_scale": 0.3}}


def test_a_weights_trial_stores_counts_with_their_control(tmp_path):
    spec = {**SERVER, "attacks": [], "weights": [{"target": TARGET, "attacks": [
        {"name": "kkt", "options": {"runs": 2, "iterations": 300, "candidates": 24, "lr": 3e-3, "lambda_lr": 1e-4,
                                    "init_scale": 0.01, "alpha": 100.0, "lambda_min": 0.05}},
        {"name": "univariate"}]}]}
    trials = [t for t in plan(load_spec(spec)) if t.kind == "weights"]
    assert [t.threat_model for t in trials] == ["published-weights"] * 2
    kkt, univariate = (run_trial(t, cache_dir=tmp_path) for t in trials)
    assert univariate.status == "n/a" and "univariate" in univariate.error
    assert kkt.status == "done", kkt.error
    m = kkt.metrics
    assert m["n_train"] == 12 and m["n_nonmembers"] == 12
    assert m["candidates"] + m["diverged"] == 48
    for name in ("members_nn", "nonmembers_nn", "members_ssim_0.4", "members_ssim_0.6", "control_ssim_0.4",
                 "control_ssim_0.6"):
        assert 0 <= m[name] <= 12, name
    assert m["members_nn"] + m["nonmembers_nn"] >= 1
    assert m["kkt_residual"] is not None and 0 <= m["kkt_residual"] <= 1
    # the target is cached on disk and reused: a second trial of the same target trains nothing
    assert list((tmp_path / "targets").glob("*.pt"))


def test_weights_scores_count_members_against_non_members():
    from leakbench.evaluation.membership.published import weights_scores

    gen = torch.Generator().manual_seed(0)
    members, nonmembers = torch.rand(6, 1, 8, 8, generator=gen), torch.rand(6, 1, 8, 8, generator=gen)
    control = torch.rand(12, 1, 8, 8, generator=gen)
    exact = weights_scores(members.clone(), members, nonmembers, control)
    assert exact["members_nn"] == 6 and exact["nonmembers_nn"] == 0 and exact["members_ssim_0.6"] == 6
    assert exact["control_ssim_0.6"] < 6
    decoys = weights_scores(nonmembers.clone(), members, nonmembers, control)
    assert decoys["members_nn"] == 0 and decoys["nonmembers_nn"] == 6


def test_a_membership_trial_stores_auc_and_tpr_per_setting(tmp_path):
    spec = {**SERVER, "attacks": [], "membership": [{"target": {
        "dataset": {"name": "sphere", "options": {"n": 200, "d": 200}}, "per_class": 10,
        "options": {"model": "twolayer:500", "steps": 800, "lr": 0.5, "loss_tol": 0, "center": False}}}]}
    trials = [t for t in plan(load_spec(spec)) if t.kind == "membership"]
    assert sorted(t.membership["setting"] for t in trials) == ["bounded", "known", "leaked"]
    for t in trials:
        result = run_trial(t, cache_dir=tmp_path)
        assert result.status == "done", result.error
        m = result.metrics
        assert m["members"] == 20 and m["nonmembers"] == 20
        assert 0.9 <= m["auc"] <= 1.0, m  # nearly orthogonal data, d ≫ n: members sit on the margin (Thm. 4.2)
        assert 0 <= m["tpr_at_fpr_0.001"] <= m["tpr_at_fpr_0.01"] <= 1
        assert result.arrays["scores"].shape == (40,) and result.arrays["is_member"].sum() == 20
    assert t.threat_model == "membership"


def test_membership_attack_names_are_checked():
    spec = {**SERVER, "attacks": [], "membership": [{"target": TARGET, "attacks": ["membership-margn"]}]}
    with pytest.raises(ConfigError, match=r"membership\[0\]\.attacks\[0\]\.name.*membership-margin"):
        load_spec(spec)
    with pytest.raises(ConfigError, match="settings among known, leaked, bounded"):
        load_spec({**SERVER, "membership": [{"target": TARGET, "settings": ["guessed"]}]})
    # the reference-model attacks run in entries with model: and dataset: (tests/evaluation/membership/test_reference_trial.py)
    with pytest.raises(ConfigError, match=r"membership\[0\]\.attacks\[0\]\.name.*needs reference models"):
        load_spec({**SERVER, "attacks": [], "membership": [{"target": TARGET, "attacks": ["membership-lira"]}]})


def test_a_nan_reconstruction_is_a_failed_trial(monkeypatch):
    from leakbench.attacks.gradient import fc_inversion

    trial = _trial(SERVER, model_key="honest", attack="fc-inversion")
    original = fc_inversion.FCInversion.run

    def nan_run(self, obs, **kwargs):
        rec = original(self, obs, **kwargs)
        rec.images = torch.full_like(rec.images, float("nan"))
        return rec

    monkeypatch.setattr(fc_inversion.FCInversion, "run", nan_run)
    result = run_trial(trial)
    assert result.status == "failed" and ("non-finite" in result.error or "NaN" in result.error), result.error


@pytest.mark.slow  # ~7 s of training: `make test-slow` (the demo's plan is checked in test_presets.py)
def test_utility_is_measured_at_each_attack_batch_size():
    spec = {**SERVER, "models": [SERVER["models"][0]], "batch_sizes": [1, 8], "utility": {"epochs": 1, "seeds": [0]},
            "defenses": ["none", "dpsgd:1,1"]}
    trials = [t for t in plan(load_spec(spec)) if t.kind == "utility"]
    assert sorted((t.defense, t.batch_size) for t in trials) == [("dpsgd:1,1", 1), ("dpsgd:1,1", 8),
                                                                  ("none", 1), ("none", 8)]
    results = {(t.defense, t.batch_size): run_trial(t).metrics for t in trials}
    for m in results.values():
        assert m["samples_seen"] == results[("none", 1)]["samples_seen"]
    # B = 1 takes 8× the steps of B = 8, and DP-SGD's ε grows with the number of steps at B/N
    assert results[("none", 1)]["steps"] > 7 * results[("none", 8)]["steps"]
    assert results[("dpsgd:1,1", 1)]["epsilon"] != results[("dpsgd:1,1", 8)]["epsilon"]
    assert results[("none", 1)]["train_loss"] != results[("none", 8)]["train_loss"]


def test_attack_threat_overrides_name_the_informed_eavesdropper():
    spec = {**SERVER, "models": [SERVER["models"][0]],
            "attacks": ["fc-inversion", {"name": "inverting-gradients", "preset": "quick",
                                         "threat": {"labels_known": True}}]}
    by_attack = {t.attack: t for t in plan(load_spec(spec))}
    assert by_attack["fc-inversion"].threat_model == "eavesdropper"
    assert by_attack["inverting-gradients"].threat_model == "informed-eavesdropper"
    assert by_attack["inverting-gradients"].threat["labels_known"] is True


def test_old_trial_keys_are_unchanged_by_the_new_fields():
    trial = _trial(SERVER, model_key="honest", attack="fc-inversion")
    assert not trial.server and "server" not in trial.identity()
    assert TrialSpec.from_dict({k: v for k, v in trial.to_dict().items()
                                if k not in ("server", "target", "membership")}).key == trial.key


def test_chance_scores_are_those_of_a_flat_grey_image():
    from leakbench.evaluation.trials.controls import chance_scores

    trial = _trial(SERVER, model_key="honest", attack="fc-inversion")
    data = dataset_for(trial)
    x, _ = batch_for(trial, data)
    scores = chance_scores(x, data)
    grey = torch.full_like(x, float(data.images.mean()))
    assert math.isclose(scores["chance_rmse"], float((x - grey).pow(2).mean().sqrt()), rel_tol=1e-5)
    assert np.isclose(scores["chance_psnr"], -20 * np.log10(scores["chance_rmse"]), rtol=1e-5)


def test_preflight_ships_the_server_model_and_checks_published_data():
    from leakbench.evaluation.running.preflight import preflight

    too_many_bins = {**SERVER, "models": [{"spec": "mlp:32", "server": {"imprint": {"bins": 5000}}}]}
    with pytest.raises(ConfigError, match=r"models\[0\]\.server\.imprint.*N ≥ 5000"):
        preflight(load_spec(too_many_bins))
    no_nonmembers = {**SERVER, "weights": [{"target": {**TARGET, "per_class": 891}, "attacks": ["kkt"]}]}
    with pytest.raises(ConfigError, match=r"weights\[0\]\.target\.per_class.*no non-member"):
        preflight(load_spec(no_nonmembers))
    checked = preflight(load_spec({**SERVER, "weights": [{"target": TARGET, "attacks": ["kkt"]}]}))
    assert checked.kinds["weights"] == 1 and checked.kinds["attack"] == 2 * 3 * 2  # 2 attacks, 3 models, 2 seeds


def test_trap_weights_and_fishing_in_a_sweep_with_the_client_check(tmp_path):
    """The moves ship through the sweep (rate 1/(B·L) by default), the attacks read them, and every trial says
    whether the client's check would have refused the shipped model."""
    spec = {"datasets": [DIGITS],
            "models": [{"spec": "mlp:200", "act": "relu", "label": "trap", "server": {"trap_weights": {}}},
                       {"spec": "mlp:200", "act": "relu", "label": "fish", "server": {"fishing": {"target": 1}}}],
            "batch_sizes": [8], "images": 8, "seeds": [0], "attacks": ["trap-weights", "fishing"],
            "defenses": ["none", "secagg:2"],
            "include": [{"model": "trap", "attack": "trap-weights"}, {"model": "fish", "attack": "fishing",
                                                                     "defense": "none"}]}
    trials = plan(load_spec(spec))
    secagg = next(t for t in trials if t.defense == "secagg:2")
    data = dataset_for(secagg)
    shipped = apply_server(secagg, model_for(secagg, data, torch.device("cpu")), data)
    assert shipped.trap_rate == pytest.approx(1 / 16)
    sweep = Sweep(load_spec(spec), tmp_path / "r.db", workers=1)
    sweep.run(progress=False)
    rows = sweep.store.rows(kind="attack")
    assert len(rows) == 3 and all(r["status"] == "done" and r["threat_model"] == "malicious-server" for r in rows)
    assert all(r["metrics"]["client_check"] == 1.0 for r in rows)
    plain = next(r for r in rows if r["attack"] == "trap-weights" and r["defense"] == "none")
    assert min(plain["per_sample"]["mse"]) < 1e-10  # some digit read exactly
    # fishing claims the fished samples only: the trial is scored on them, the batch's scores kept beside
    # fishing claims only its fished samples: a trial counts them (none provably alone in this batch, so the
    # batch's scores stand; the CNN test below scores a claimed slot)
    fished = next(r for r in rows if r["attack"] == "fishing")["metrics"]
    assert fished["targets"] == 0 and "batch_rmse" not in fished
    sweep.store.close()


def test_fishing_on_a_cnn_in_a_sweep_inverts_the_fished_gradient(tmp_path):
    """On a model without a first FC layer the sweep's fishing trials run the B = 1 gradient-matching read-out,
    under secure aggregation and FedAvg minibatch epochs as well, for class and feature fishing (whose threshold
    the server places on labelled public digits)."""
    spec = {"datasets": [DIGITS],
            "models": [{"spec": "cnn:3-6-1-0,4-3-2-0", "act": "tanh", "label": "fishcnn",
                        "server": {"fishing": {"target": 1}}},
                       {"spec": "cnn:3-6-1-0,4-3-2-0", "act": "tanh", "label": "featurecnn",
                        "server": {"fishing": {"target": 1, "quantile": 0.5}}}],
            "batch_sizes": [4], "images": 4, "seeds": [0],
            "attacks": [{"name": "fishing", "preset": "quick", "options": {"iterations": 5}}],
            "defenses": ["none", "secagg:2", "local:1,0.05,2"]}
    sweep = Sweep(load_spec(spec), tmp_path / "r.db", workers=1)
    sweep.run(progress=False)
    rows = sweep.store.rows(kind="attack")
    assert len(rows) == 6 and all(r["status"] == "done" and r["metrics"]["client_check"] == 1.0 for r in rows)
    # slot 0 is claimed: each trial is scored on it, the batch's score kept beside, chance on the nearest original
    for r in rows:
        m = r["metrics"]
        assert m["targets"] == 1 and m["scored"].startswith("targets") and "batch_rmse" in m
        assert m["chance_rmse"] == pytest.approx(min(r["per_sample"]["chance_rmse"]))
    sweep.store.close()


def test_fishing_rounds_in_a_sweep_queries_the_client_again(tmp_path):
    """A malicious-server trial hands the attack its client (``obs.extras["query"]``): ``fishing-rounds`` re-queries
    it at thresholds of its choosing and reads single digits exactly; under secure aggregation it refuses (n/a)."""
    spec = {"datasets": [DIGITS],
            "models": [{"spec": "mlp:200", "act": "relu", "label": "rounds",
                        "server": {"fishing": {"target": 1, "quantile": 0.5}}}],
            "batch_sizes": [16], "images": 16, "seeds": [0], "attacks": ["fishing-rounds"],
            "defenses": ["none", "secagg:2"]}
    sweep = Sweep(load_spec(spec), tmp_path / "r.db", workers=1)
    sweep.run(progress=False)
    rows = {r["defense"]: r for r in sweep.store.rows(kind="attack")}
    done = rows["none"]
    assert done["status"] == "done" and done["metrics"]["client_check"] == 1.0
    assert done["metrics"]["targets"] >= 8   # the claimed slots are what the trial scores
    assert sum(m < 1e-10 for m in done["per_sample"]["mse"]) >= 8                   # read exactly
    assert rows["secagg:2"]["status"] == "n/a" and "secure aggregation" in rows["secagg:2"]["error"]
    sweep.store.close()


def test_loki_in_a_sweep_sends_each_secagg_client_its_own_model(tmp_path):
    """``loki: {bins: K}`` takes L from ``secagg:L``; under the secure sum the target's digits are read exactly."""
    from leakbench.models.loki import LokiBlock

    spec = {"datasets": [DIGITS],
            "models": [{"spec": "mlp:64", "act": "relu", "label": "loki", "server": {"loki": {"bins": 64}}}],
            "batch_sizes": [8], "images": 8, "seeds": [0], "attacks": ["loki"], "defenses": ["none", "secagg:3"]}
    trials = plan(load_spec(spec))
    secagg = next(t for t in trials if t.defense == "secagg:3")
    data = dataset_for(secagg)
    shipped = apply_server(secagg, model_for(secagg, data, torch.device("cpu")), data)
    assert find_module(shipped, LokiBlock).clients == 3
    sweep = Sweep(load_spec(spec), tmp_path / "r.db", workers=1)
    sweep.run(progress=False)
    rows = sweep.store.rows(kind="attack")
    assert len(rows) == 2 and all(r["status"] == "done" and r["threat_model"] == "malicious-server" for r in rows)
    assert all(r["metrics"]["client_check"] == 1.0 for r in rows)
    under = next(r for r in rows if r["defense"] == "secagg:3")
    assert sum(m < 1e-10 for m in under["per_sample"]["mse"]) >= 4  # target digits read exactly from the sum
    sweep.store.close()
