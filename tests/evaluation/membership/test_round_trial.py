"""Membership on a federated run's rounds (evaluation.membership.round_trial): the same checkpoints the
reconstruction trials attack, members from the clients, non-members from the test split, round 0 as chance."""
from __future__ import annotations

import re

import numpy as np
import pytest

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.evaluation import Store, load_spec
from leakbench.evaluation.membership.round_trial import run_points
from leakbench.evaluation.membership.verdict import membership_defenses
from leakbench.evaluation.training import federated
from leakbench.evaluation.trials.inputs import dataset_for
from leakbench.evaluation.trials.plan import plan, split_round

FED = {"clients": 2, "rounds": [0, 3], "public": 8, "lr": 0.5, "local_epochs": 3, "batch_size": 8}
SPEC = {"name": "fed-mia", "datasets": [{"name": "digits", "options": {"limit": 300}}],
        "models": [{"spec": "mlp:64", "label": "fl", "federated": FED}],
        "batch_sizes": [2], "images": 2, "seeds": [0],
        "attacks": [{"name": "inverting-gradients", "options": {"iterations": 2}, "label": "ig"}],
        "defenses": ["none", "noise:0.5"],
        "membership": [{"run": "fl", "pool": 120}]}


def test_the_plan_attacks_every_round_defense_and_seed_of_the_run_with_the_attack_trials_checkpoints():
    trials = plan(load_spec(SPEC))
    mia = [t for t in trials if t.kind == "membership"]
    assert {(split_round(t.model_key), t.defense) for t in mia} == {
        (("fl", r), d) for r in (0, 3) for d in ("none", "noise:0.5")}
    attack = next(t for t in trials if t.kind == "attack" and t.training["round"] == 3 and t.defense == "none")
    twin = next(t for t in mia if t.training["round"] == 3 and t.defense == "none")
    # the same run: everything that decides it is equal, so the checkpoint is shared, never retrained
    assert twin.training == attack.training and twin.model_options == attack.model_options
    assert twin.threat.get("loss") == attack.threat.get("loss") and twin.attack == "membership-loss"
    only = plan(load_spec({**SPEC, "membership": [{"run": "fl", "rounds": [3], "client": 1}]}))
    assert {t.training["round"] for t in only if t.kind == "membership"} == {3}


def test_points_are_members_of_the_clients_and_nonmembers_of_the_test_split_the_same_at_every_round():
    trials = [t for t in plan(load_spec({**SPEC, "membership": [{"run": "fl", "pool": 60, "client": 1}]}))
              if t.kind == "membership"]
    data = dataset_for(trials[0])
    lay = federated.layout(data, trials[0].training["federated"], 0)
    index, member = run_points(data, trials[0])
    assert member.sum() == (~member).sum() == 30
    assert set(index[member]) <= set(lay.clients[1]) and set(index[~member]) <= set(lay.test)
    for t in trials[1:]:
        again, flags = run_points(data, t)
        assert np.array_equal(again, index) and np.array_equal(flags, member)


@pytest.mark.parametrize("entry, field", [
    ({"run": "nope"}, r"membership\[0\]\.run: 'nope' names no model entry with a federated: section"),
    ({"run": "fl", "rounds": [5]}, r"membership\[0\]\.rounds: round 5 is not attacked"),
    ({"run": "fl", "client": 2}, r"membership\[0\]\.client: run 'fl' has 2 clients"),
    ({"run": "fl", "attacks": ["membership-lira"]}, r"'membership-lira' needs reference models"),
    ({"run": "fl", "seeds": [1]}, "do\\(es\\) not apply"),
    ({"run": "fl", "dataset": "digits", "model": "mlp:4"}, "expected one form"),
    ({"dataset": "digits", "model": "mlp:4", "rounds": [0]}, "belong to the run: form"),
])
def test_a_bad_run_entry_is_one_line_naming_the_field(entry, field):
    with pytest.raises(ConfigError, match=field) as err:
        load_spec({**SPEC, "membership": [entry]})
    assert "\n" not in str(err.value)


def test_a_sweep_scores_membership_per_round_with_round_zero_at_chance_and_resumes(tmp_path):
    db = tmp_path / "r.db"
    spec = {**SPEC, "attacks": [], "membership": [{"run": "fl", "pool": 200}]}
    first = lb.evaluate(spec, db)
    assert first.complete and not first.failed
    assert lb.evaluate(spec, db).ran == 0
    with Store(db) as store:
        rows = [r for r in store.rows(kind="membership")]
    assert len(rows) == 4 and all(r["status"] == "done" for r in rows)
    by = {(split_round(r["model"])[1], r["defense"]): r["metrics"] for r in rows}
    for (round_, _), m in by.items():
        # pool/2 = 100 asked; the test split (20 % of 300 = 60) holds the non-members and bounds both
        assert m["members"] == m["nonmembers"] == 60 and m["round"] == round_
        assert m["auc_low"] <= m["auc"] <= m["auc_high"]
    # round 0 is the untrained model: no sample has touched it, so its AUC interval holds 0.5
    assert all(by[(0, d)]["auc_low"] <= 0.5 <= by[(0, d)]["auc_high"] for d in ("none", "noise:0.5"))
    assert by[(3, "none")]["test_accuracy"] > by[(0, "none")]["test_accuracy"]
    found = membership_defenses(rows)
    assert {(d.model, d.defense) for d in found} == {(f"fl · round {r}", d) for r in (0, 3)
                                                     for d in ("none", "noise:0.5")}
    from leakbench.report.html import write_report

    html = write_report(db, tmp_path / "report").index.read_text()
    assert "fl · round 3" in html and "Membership along training" in html
    along = html[html.index("Membership along training"):]
    assert "round 0" in along and "round 3" in along and re.search(r"accuracy 0\.\d\d", along)
    assert "Membership attacks on a federated run's rounds" in html  # no reference-model entry in this sweep


def test_weights_attacks_run_on_the_rounds_of_a_run_with_their_nonmember_control(tmp_path):
    spec = {**SPEC, "attacks": [], "membership": [],
            "weights": [{"run": "fl", "rounds": [3], "members": 40,
                         "attacks": [{"name": "model-inversion", "options": {"iterations": 20, "candidates": 8}}]}]}
    trials = [t for t in plan(load_spec(spec)) if t.kind == "weights"]
    assert {(t.training["round"], t.defense) for t in trials} == {(3, "none"), (3, "noise:0.5")}
    db = tmp_path / "w.db"
    assert lb.evaluate(spec, db).complete
    with Store(db) as store:
        rows = store.rows(kind="weights")
    for r in rows:
        m = r["metrics"]
        assert r["status"] == "done" and m["n_train"] == m["n_nonmembers"] == 40 and m["round"] == 3
        # the nearest-neighbour chance: candidates pick members and non-members of the same pool
        assert 0 <= m["members_nn"] <= 40 and 0 <= m["nonmembers_nn"] <= 40 and m["candidates"] > 0
    from leakbench.report.html import write_report

    assert "fl · round 3" in write_report(db, tmp_path / "report").index.read_text()
    with pytest.raises(ConfigError, match=r"weights\[0\]: expected either target: .* got both"):
        load_spec({**spec, "weights": [{"run": "fl", "attacks": ["kkt"], "target": {
            "dataset": {"name": "digits"}, "per_class": 2}}]})
    with pytest.raises(ConfigError, match=r"weights\[0\]\.run: 'cnn' names no model entry"):
        load_spec({**spec, "weights": [{"run": "cnn", "attacks": ["kkt"]}]})
