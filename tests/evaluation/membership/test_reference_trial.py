"""Reference-model membership in sweep specs: the entry's two forms, the trials' keys, the store round trip, resume."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.evaluation import Sweep, load_spec, plan, run_trial
from leakbench.evaluation.membership.reference import Recipe, cached_target, target_mask
from leakbench.evaluation.membership.reference_trial import pool_for

pytestmark = pytest.mark.usefixtures("one_thread")

ENTRY = {"dataset": {"name": "digits"}, "model": {"spec": "mlp:16", "act": "relu"},
         "training": {"epochs": 3, "batch_size": 32, "lr": 0.2}, "pool": 240, "reference_models": 2,
         "defenses": ["none", "dpsgd:1,1"]}
SPEC = {"name": "ref", "datasets": [{"name": "digits"}], "models": ["mlp:8"], "batch_sizes": [1],
        "membership": [ENTRY]}


def _spec(**entry) -> dict:
    return {**SPEC, "membership": [{**ENTRY, **entry}]}


def test_an_entry_is_either_a_margin_target_or_a_model_with_reference_models():
    with pytest.raises(ConfigError, match=r"membership\[0\].*expected target: .*both model: and dataset: .*or run:"):
        load_spec({**SPEC, "membership": [{"model": "mlp:8"}]})
    target = {"dataset": {"name": "sphere", "options": {"n": 40, "d": 20}}, "per_class": 5}
    with pytest.raises(ConfigError, match="got target: and model:/dataset:"):
        load_spec({**SPEC, "membership": [{**ENTRY, "target": target}]})
    with pytest.raises(ConfigError, match=r"membership\[0\]\.attacks\[0\]\.name.*membership-lira"):
        load_spec(_spec(attacks=["membership-lirra"]))
    with pytest.raises(ConfigError, match=r"membership\[0\]\.defenses\[0\]"):
        load_spec(_spec(defenses=["dpsgd:1"]))
    with pytest.raises(ConfigError, match=r"membership\[0\]\.reference_models"):
        load_spec(_spec(reference_models=100_000))
    with pytest.raises(ConfigError, match=r"membership\[0\]\.model\.training.*entry's training"):
        load_spec(_spec(model={"spec": "mlp:16", "training": {"epochs": 3}}))
    with pytest.raises(ConfigError, match="listed twice"):
        load_spec(_spec(attacks=["membership-lira", "membership-lira"]))


def test_trials_are_keyed_by_everything_that_changes_the_result():
    trials = plan(load_spec(SPEC))
    # loss, LiRA online and offline, RMIA (the default attacks) × two defenses, attack-major
    assert [(t.attack_key, t.defense) for t in trials[:3]] == [("loss", "none"), ("loss", "dpsgd:1,1"),
                                                                ("lira-online", "none")]
    assert len(trials) == 8 and len({t.key for t in trials}) == 8
    assert all(t.kind == "membership" and t.threat_model == "membership" for t in trials)
    base = trials[0]
    for change in ({"pool": 300}, {"reference_models": 4}, {"training": {**ENTRY["training"], "epochs": 4}},
                   {"model": {"spec": "mlp:16", "act": "tanh"}}, {"seeds": [1]}):
        other = plan(load_spec(_spec(**change)))[0]
        assert other.key != base.key, change
    assert plan(load_spec(_spec()))[0].key == base.key
    # without training: the sweep's utility recipe (the one utility trials use)
    spec = {**SPEC, "utility": {"epochs": 2, "lr": 0.02, "batch_size": 16},
            "membership": [{k: v for k, v in ENTRY.items() if k != "training"}]}
    assert plan(load_spec(spec))[-1].membership["recipe"] == {"epochs": 2, "batch_size": 16, "lr": 0.02,
                                                               "loss": "ce"}
    # rules name the entry's defenses and attacks
    kept = plan(load_spec({**SPEC, "exclude": [{"defense": "dpsgd", "attack": "lira-offline"}]}))
    assert len(kept) == 7


def test_the_target_is_trained_on_its_half_of_the_pool_and_cached(tmp_path):
    pool = pool_for(lb.load("digits"), 120, seed=0)
    recipe = Recipe("mlp:8", epochs=2, batch_size=16, lr=0.1)
    first = cached_target(recipe, pool, seed=3, cache_dir=tmp_path)
    again = cached_target(recipe, pool, seed=3, cache_dir=tmp_path)
    assert not first.cached and again.cached
    assert torch.equal(first.in_mask, target_mask(120, 3)) and int(first.in_mask.sum()) == 60
    for a, b in zip(first.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
    assert again.train_loss == first.train_loss
    with pytest.raises(ConfigError, match="membership.pool"):
        pool_for(lb.load("digits"), 5000, seed=0)


def test_a_sweep_commits_each_trial_and_resumes_without_training_again(tmp_path):
    spec = load_spec(_spec(attacks=["membership-loss", {"name": "membership-rmia", "label": "rmia"},
                                    "membership-margin"]))
    sweep = Sweep(spec, tmp_path / "r.db", workers=1)
    summary = sweep.run(progress=False)
    assert summary.ran == 6
    rows = sweep.store.rows()
    done = [r for r in rows if r["status"] == "done"]
    assert len(done) == 4, [(r["attack"], r["status"], r["error"]) for r in rows]
    # the margin attack needs a one-output binary net: n/a with the reason, never a score
    na = [r for r in rows if r["status"] == "n/a"]
    assert {r["attack"] for r in na} == {"membership-margin"} and all("binary" in r["error"] for r in na)
    for r in done:
        m = r["metrics"]
        assert 0 <= m["auc_low"] <= m["auc"] <= m["auc_high"] <= 1
        assert m["members"] == m["nonmembers"] == 120
        # 120 non-members measure neither 1 % (needs 1 000) nor 0.1 % FPR
        assert m["tpr_at_fpr_0.01"] is None and m["tpr_at_fpr_0.001"] is None
        assert 0 <= m["tpr_at_fpr_0"] <= 1
        assert len(m["train_losses"]) == 3  # the target and two reference models
        assert len(r["per_sample"]["score"]) == 240 and sum(r["per_sample"]["member"]) == 120
        if r["defense"].startswith("dpsgd"):
            assert m["epsilon"] > 0 and m["audit_epsilon"] <= m["epsilon"] and not m["audit_violated"]
    cached = list((tmp_path / "r-cache" / "reference").glob("*.pt"))
    assert len(cached) == 4  # a target and its reference models per defense, trained once for all attacks
    stamps = {p: p.stat().st_mtime_ns for p in cached}
    sweep.store.close()
    again = Sweep(spec, tmp_path / "r.db", workers=1)
    assert again.run(progress=False).ran == 0
    again.store.close()
    # a lost row is run again from the cached models (no training)
    trial = next(t for t in plan(spec) if t.attack == "membership-loss" and t.defense == "none")
    result = run_trial(trial, cache_dir=tmp_path / "r-cache")
    assert result.status == "done" and result.metrics["auc"] == next(
        r["metrics"]["auc"] for r in done if r["attack"] == "membership-loss" and r["defense"] == "none")
    assert {p: p.stat().st_mtime_ns for p in cached} == stamps


def test_the_cli_and_lb_evaluate_run_a_membership_spec_and_print_its_verdict(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from leakbench.cli import app

    entry = {**ENTRY, "pool": 120, "reference_models": 1, "defenses": ["none"],
             "attacks": ["membership-loss", {"name": "membership-rmia", "label": "rmia"}]}
    path = tmp_path / "membership.yaml"
    path.write_text(yaml.safe_dump({**SPEC, "membership": [entry]}))
    result = CliRunner().invoke(app, ["evaluate", str(path), "--db", str(tmp_path / "r.db"),
                                      "--report", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert "membership · digits · mlp:16" in result.output and "n = 120 points" in result.output
    assert "Reference-model attacks" in (tmp_path / "report" / "index.html").read_text()
    summary = lb.evaluate(path, tmp_path / "r.db")  # resumed: nothing left to run
    assert summary.ran == 0 and summary.complete


def test_a_users_model_file_is_the_start_of_the_target_and_of_every_reference_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = lb.load("digits")
    start = lb.build("mlp:16", input_shape=data.shape, classes=data.num_classes, act="relu", seed=9)
    torch.save(start.state_dict(), tmp_path / "mine.pt")
    entry = {**ENTRY, "model": {"spec": "mlp:16", "act": "relu", "file": "mine.pt"}, "pool": 120,
             "reference_models": 1, "defenses": ["none"], "attacks": ["membership-loss"]}
    trial = plan(load_spec({**SPEC, "membership": [entry]}))[0]
    assert trial.model_options["file_digest"] and trial.key != plan(load_spec(_spec(**{
        k: v for k, v in entry.items() if k != "model"})))[0].key
    seen = []
    from leakbench.evaluation.membership import reference

    original = reference.Recipe.build

    def build(self, data, seed, device="cpu"):
        model = original(self, data, seed, device)
        seen.append(all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                          start.state_dict().values())))
        return model

    monkeypatch.setattr(reference.Recipe, "build", build)
    result = run_trial(trial)
    assert result.status == "done", result.error
    assert len(seen) >= 2 and all(seen)  # the target and the reference model both start from the file


def test_a_pool_larger_than_the_dataset_or_unbounded_training_is_refused_before_any_trial(tmp_path):
    with pytest.raises(ConfigError, match=r"field membership\[0\]\.pool: expected a pool of at most 1797"):
        Sweep(load_spec(_spec(pool=5000)), tmp_path / "r.db", workers=1)
    huge = _spec(pool=1000, reference_models=256, training={"epochs": 10_000, "batch_size": 32, "lr": 0.1})
    with pytest.raises(ConfigError, match=r"field membership\[0\]\.reference_models: .*1,285,000,000 samples"):
        Sweep(load_spec(huge), tmp_path / "r.db", workers=1)
