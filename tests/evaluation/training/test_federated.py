"""Training as an axis: FedAvg runs (exact against plain SGD, resumable, content-addressed), their layout, the
federated spec and plan, and the attack's power deciding which verdicts a round may give."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.evaluation.training import federated
from leakbench.evaluation.training.federated import Run, checkpoint, client_batch, diverged, layout, run_key
from leakbench.evaluation.trials.plan import plan, split_round
from leakbench.evaluation.verdicts.rounds import round_table, sentence
from leakbench.evaluation.sweep_spec.model import load_spec
from leakbench.evaluation.verdicts.rules import privacy_utility, verdicts
from leakbench.evaluation.verdicts.strongest import strongest
from leakbench.evaluation.verdicts.utility import utility_table

CONFIG = {"clients": 3, "partition": "iid", "alpha": 0.5, "local_epochs": 1, "batch_size": 8, "lr": 0.1,
          "client_samples": None, "test_fraction": 0.2, "public": 12}


@pytest.fixture(scope="module")
def data():
    return lb.load("digits", limit=240)


@pytest.fixture(autouse=True)
def _fresh_memory():
    federated._MEMORY.clear()
    yield
    federated._MEMORY.clear()


def small_model(data, seed=0):
    return lb.build("mlp:16", input_shape=data.shape, classes=data.num_classes, seed=seed)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_layout_keeps_test_public_and_clients_disjoint_and_is_seeded(data, partition):
    config = {**CONFIG, "partition": partition, "alpha": 0.3}
    lay = layout(data, config, 0)
    parts = [set(lay.test.tolist()), set(lay.public.tolist()), *(set(c.tolist()) for c in lay.clients)]
    assert sum(len(p) for p in parts) == len(data) == len(set().union(*parts))  # a partition of the dataset
    assert len(lay.public) == 12 and all(len(c) > 0 for c in lay.clients)
    again = layout(data, config, 0)
    assert all(np.array_equal(a, b) for a, b in zip(lay.clients, again.clients))
    other = layout(data, config, 1)
    assert not all(np.array_equal(a, b) for a, b in zip(lay.clients, other.clients))
    if partition == "iid":
        sizes = [len(c) for c in lay.clients]
        assert max(sizes) - min(sizes) <= 1


def test_dirichlet_skews_labels_more_at_small_alpha(data):
    def spread(alpha):  # mean over clients of the largest class share
        lay = layout(data, {**CONFIG, "partition": "dirichlet", "alpha": alpha}, 0)
        labels = data.labels.numpy()
        return np.mean([np.bincount(labels[c], minlength=10).max() / len(c) for c in lay.clients])
    assert spread(0.05) > 2 * spread(100.0)


def test_client_batches_come_from_their_owner_and_stay_the_same_at_every_round(data):
    lay = layout(data, CONFIG, 0)
    for batch in range(4):
        idx = client_batch(data, CONFIG, 0, batch, 4)
        assert set(idx.tolist()) <= set(lay.clients[batch % 3].tolist()) and len(set(idx.tolist())) == 4
        assert np.array_equal(idx, client_batch(data, CONFIG, 0, batch, 4))
    pub = client_batch(data, CONFIG, 0, 0, 4, public=True)
    assert set(pub.tolist()) <= set(lay.public.tolist())
    with pytest.raises(ConfigError, match="public set's samples"):
        client_batch(data, CONFIG, 0, 0, 13, public=True)


# ----------------------------------------------------------------------------- the run


def test_one_client_full_batch_round_is_plain_gradient_descent(data):
    """FedAvg with one client, one local epoch and a minibatch holding all its samples is θ − η∇L(θ)."""
    config = {**CONFIG, "clients": 1, "batch_size": 10_000, "public": 0}
    model = small_model(data)
    run = Run(model, data, "none", config, 0)
    state, info = checkpoint(run, 1, "exact", None)
    idx = torch.as_tensor(run.layout.clients[0])
    reference = small_model(data)
    loss = nn.functional.cross_entropy(reference(data.images[idx]), data.labels[idx])
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    for (name, p), g in zip(reference.named_parameters(), grads):
        torch.testing.assert_close(state[name], p.detach() - 0.1 * g, rtol=1e-5, atol=1e-6)
    assert info["round"] == 1 and info["update_norm"] > 0 and 0 <= info["test_accuracy"] <= 1


def _bn_model(data):
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(data.shape)), 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, data.num_classes))


def test_the_global_running_statistics_are_the_clients_weighted_average_in_any_order(data):
    """FedAvg averages a BN model's running statistics like its weights — Σ_k n_k/n · stats_k, each client's after
    its own local training from the global values — so a round does not depend on which client trains last."""
    config = {**CONFIG, "batch_size": 10_000, "local_epochs": 2}   # full-batch steps: no shuffle to reproduce

    def after_round(clients=None):
        run = Run(_bn_model(data), data, "none", config, 0)
        if clients is not None:
            run.layout = dataclasses.replace(run.layout, clients=clients)
        model = _bn_model(data)
        run.step(model, 1)
        return run, {n: b.detach().clone() for n, b in model.named_buffers()}

    run, together = after_round()
    owned = run.layout.clients
    alone = [after_round([c])[1] for c in owned]
    total = sum(len(c) for c in owned)
    for name in ("2.running_mean", "2.running_var"):
        expected = sum(len(c) / total * b[name] for c, b in zip(owned, alone))
        torch.testing.assert_close(together[name], expected)
        assert not torch.allclose(together[name], alone[-1][name])   # not the last client's
    assert int(together["2.num_batches_tracked"]) == 2
    _, reordered = after_round(list(reversed(owned)))
    for name, value in together.items():
        torch.testing.assert_close(reordered[name], value)


def test_a_killed_run_resumes_without_retraining_and_equals_the_uninterrupted_one(data, tmp_path, monkeypatch):
    steps: list[int] = []
    real = Run.step

    def counting(self, model, round_):
        steps.append(round_)
        if round_ == 3 and getattr(self, "kill", False):
            raise KeyboardInterrupt  # the process dies in round 3
        return real(self, model, round_)

    monkeypatch.setattr(Run, "step", counting)
    key = run_key({"test": "resume"})
    killed = Run(small_model(data), data, "noise:0.01", CONFIG, 0)
    killed.kill = True
    with pytest.raises(KeyboardInterrupt):
        checkpoint(killed, 4, key, tmp_path)
    assert steps == [1, 2, 3]
    steps.clear()
    resumed, info = checkpoint(Run(small_model(data), data, "noise:0.01", CONFIG, 0), 4, key, tmp_path)
    assert steps == [3, 4], "rounds 1 and 2 were kept on disk"
    steps.clear()
    federated._MEMORY.clear()  # the same key is the same run: memory would serve it
    fresh, fresh_info = checkpoint(Run(small_model(data), data, "noise:0.01", CONFIG, 0), 4, key, tmp_path / "b")
    assert steps == [1, 2, 3, 4]
    for name in fresh:
        assert torch.equal(resumed[name], fresh[name])
    assert info["test_accuracy"] == fresh_info["test_accuracy"]
    steps.clear()
    federated._MEMORY.clear()
    again, _ = checkpoint(Run(small_model(data), data, "noise:0.01", CONFIG, 0), 4, key, tmp_path)
    earlier, _ = checkpoint(Run(small_model(data), data, "noise:0.01", CONFIG, 0), 2, key, tmp_path)
    assert steps == [1, 2], "round 4 read from its file; round 2 (never stored) retrained from the start"
    assert all(torch.equal(again[n], resumed[n]) for n in again)
    assert any(not torch.equal(earlier[n], again[n]) for n in again)


def test_a_damaged_checkpoint_is_retrained_not_trusted(data, tmp_path):
    key = run_key({"test": "damaged"})
    state, _ = checkpoint(Run(small_model(data), data, "none", CONFIG, 0), 1, key, tmp_path)
    (tmp_path / "federated" / key / "round-1.pt").write_bytes(b"not a checkpoint")
    federated._MEMORY.clear()
    again, _ = checkpoint(Run(small_model(data), data, "none", CONFIG, 0), 1, key, tmp_path)
    assert all(torch.equal(state[n], again[n]) for n in state)


def test_the_defense_acts_in_every_round_of_the_run(data):
    clean, _ = checkpoint(Run(small_model(data), data, "none", CONFIG, 0), 2, "a", None)
    noisy, _ = checkpoint(Run(small_model(data), data, "noise:0.5", CONFIG, 0), 2, "b", None)
    assert any(not torch.allclose(clean[n], noisy[n]) for n in clean)


def test_a_precode_run_trains_its_bottleneck_and_its_state_loads_into_the_extended_model(data):
    from leakbench.defenses.precode import find_head

    model = small_model(data)
    state, info = checkpoint(Run(model, data, "precode:4", CONFIG, 0), 1, "p", None)
    assert find_head(model) is not None and any("bottleneck.encoder" in n for n in state)
    model.load_state_dict(state)  # the trial's model, extended in place by the run, takes the round's weights
    assert math.isfinite(info["test_loss"])


def test_rounds_kept_on_the_way_are_read_not_retrained_and_change_nothing(data, tmp_path, monkeypatch):
    steps: list[int] = []
    real = Run.step

    def counting(self, model, round_):
        steps.append(round_)
        return real(self, model, round_)

    monkeypatch.setattr(Run, "step", counting)
    key = run_key({"test": "keep"})
    end, end_info = checkpoint(Run(small_model(data), data, "none", CONFIG, 0), 3, key, tmp_path, keep=[1, 2])
    federated._MEMORY.clear()
    kept, kept_info = checkpoint(Run(small_model(data), data, "none", CONFIG, 0), 2, key, tmp_path)
    assert steps == [1, 2, 3], "round 2 was stored on the way to round 3"
    plain, plain_info = checkpoint(Run(small_model(data), data, "none", CONFIG, 0), 3, key, tmp_path / "b")
    direct, direct_info = checkpoint(Run(small_model(data), data, "none", CONFIG, 0), 2, key, tmp_path / "c")
    assert all(torch.equal(end[n], plain[n]) and torch.equal(kept[n], direct[n]) for n in end)
    assert end_info["test_accuracy"] == plain_info["test_accuracy"]
    assert kept_info["train_loss"] == direct_info["train_loss"] and kept_info["round"] == 2


def test_an_early_round_at_the_untrained_loss_is_training_unless_the_run_ends_there(monkeypatch):
    """FedAvg's first round may sit a little above the untrained model's loss: diverged only if the run is still
    above it at its last attacked round (judged from that checkpoint); never the checkpoint's own start."""
    from leakbench.evaluation.trials import kinds
    from leakbench.evaluation.trials.trial import Clock

    (spec,) = [t for t in plan(load_spec(with_fed(rounds=[1, 5]))) if t.kind == "utility" and t.defense == "none"
               and t.training["round"] == 1]
    assert spec.training["rounds"] == [1, 5]
    losses = {1: 2.34}

    def fake(spec, data, model, cache_dir, *, round_=None):
        r = spec.training["round"] if round_ is None else round_
        return {}, {"train_loss": losses[r], "untrained_loss": 2.30, "test_accuracy": 0.1, "round": r}

    monkeypatch.setattr(kinds, "federated_checkpoint", fake)
    losses[5] = 0.4
    metrics = kinds.federated_utility(spec, Clock(None), None).metrics
    assert "diverged" not in metrics and "still training" in metrics["above_untrained"]
    losses[5] = 2.5
    metrics = kinds.federated_utility(spec, Clock(None), None).metrics
    assert "round 1" in metrics["diverged"] and "round 5" in metrics["diverged"]
    last = dataclasses.replace(spec, training={**spec.training, "round": 5})
    assert "above the untrained" in kinds.federated_utility(last, Clock(None), None).metrics["diverged"]


def test_diverged_is_measured_against_the_untrained_model_not_the_start():
    assert diverged({"train_loss": 0.30, "untrained_loss": 2.3}) is None  # above a checkpoint's 0.29: healthy
    assert "above the untrained" in diverged({"train_loss": 2.5, "untrained_loss": 2.3})
    assert diverged({"train_loss": math.nan, "untrained_loss": 2.3}) == "non-finite training loss"


# ----------------------------------------------------------------------------- spec and plan

FED = {"clients": 3, "rounds": [2, 0], "public": 8, "lr": 0.1}
SPEC = {"name": "fed", "datasets": [{"name": "digits", "options": {"limit": 240}}],
        "models": [{"spec": "mlp:16", "federated": FED}],
        "batch_sizes": [2], "images": 4, "seeds": [0],
        "attacks": [{"name": "inverting-gradients", "options": {"iterations": 4}, "label": "ig"}],
        "defenses": ["none", "noise:0.1"]}


def with_fed(**change):
    return {**SPEC, "models": [{"spec": "mlp:16", "federated": {**FED, **change}}]}


def test_plan_has_utility_clients_and_public_trials_per_round():
    trials = plan(load_spec(SPEC))
    utility = [t for t in trials if t.kind == "utility"]
    attacks = [t for t in trials if t.kind == "attack"]
    assert len(utility) == 2 * 2  # rounds × defenses × seeds
    assert len(attacks) == 2 * 2 * 2 * 2  # rounds × defenses × batches × (client, public)
    assert {split_round(t.model_key) for t in trials} == {("mlp:16", 0), ("mlp:16", 2)}
    assert sum(t.client == "public" for t in attacks) == len(attacks) // 2
    assert len({t.key for t in trials}) == len(trials)
    only = plan(load_spec({**SPEC, "include": [{"round": 2}]}))
    assert {t.training["round"] for t in only} == {2}
    labelled = {**SPEC, "models": [{"spec": "mlp:16", "label": "fl", "federated": FED}]}
    kept = plan(load_spec({**labelled, "exclude": [{"model": "fl", "defense": "noise"}]}))  # the label, any round
    assert kept and {t.defense for t in kept} == {"none"}


@pytest.mark.parametrize("change, field", [
    ({"models": [{"spec": "mlp:16", "training": {"epochs": 2}, "federated": FED}]}, "training.epochs"),
    (with_fed(rounds=[-1]), "rounds"),
    (with_fed(partition="skewed"), "partition"),
    (with_fed(rounds=[100_000], clients=10_000, local_epochs=1_000), r"10\^8"),
    (with_fed(client=3), "client"),
])
def test_a_bad_federated_spec_is_one_line_naming_the_fix(change, field):
    with pytest.raises(ConfigError, match=field) as err:
        load_spec({**SPEC, **change})
    assert "\n" not in str(err.value)


def test_the_public_client_must_hold_every_batch_attacked_on_the_federated_model():
    """federated.public bounds the batch sizes attacked on that model, after the include/exclude rules: a batch
    size planned only for another model is fine."""
    with pytest.raises(ConfigError, match=r"models\[0\]\.federated\.public.*B = 16") as err:
        plan(load_spec({**SPEC, "batch_sizes": [2, 16]}))
    assert "\n" not in str(err.value)
    other = {**SPEC, "models": [*SPEC["models"], {"spec": "mlp:8", "label": "wide"}], "batch_sizes": [2, 16],
             "exclude": [{"model": "mlp:16", "batch_size": 16}]}
    trials = plan(load_spec(other))
    assert {t.batch_size for t in trials if t.kind == "attack" and t.model_key == "wide"} == {2, 16}
    assert {t.batch_size for t in trials if t.kind == "attack" and t.model_key != "wide"} == {2}


def test_utility_applies_to_the_other_models_and_a_local_defense_sets_the_clients_training(data):
    spec = load_spec({**SPEC, "models": [*SPEC["models"], "mlp:8"], "utility": {"epochs": 1, "seeds": [0]},
                      "defenses": ["none", "local:2,0.05"]})
    utility = [t for t in plan(spec) if t.kind == "utility"]
    assert {t.model_key for t in utility if "federated" not in t.training} == {"mlp:8"}
    assert {split_round(t.model_key) for t in utility if "federated" in t.training} == {("mlp:16", 0),
                                                                                       ("mlp:16", 2)}
    run = Run(small_model(data), data, "local:2,0.05", CONFIG, 0)
    assert run.local == {}  # the defense's local aggregation is the clients' round
    state, _ = checkpoint(run, 1, "local", None)
    assert any(not torch.equal(state[n], p) for n, p in small_model(data).state_dict().items())


def test_a_federated_sweep_reports_leakage_and_accuracy_per_round_and_resumes(tmp_path):
    db = tmp_path / "r.db"
    first = lb.evaluate(SPEC, db)
    assert first.complete and not first.failed
    assert lb.evaluate(SPEC, db).ran == 0  # nothing retrained or re-attacked
    from leakbench.evaluation import Store

    with Store(db) as store:
        rows = store.rows()
    found = round_table(rows)
    assert {(r.defense, r.round) for r in found} == {(d, k) for d in ("none", "noise:0.1") for k in (0, 2)}
    for r in found:
        assert r.power is not None and r.power.n == 2 and r.accuracy.n == 1 and r.status in (
            "leaks", "holds", "undetermined", "open")
        assert f"round {r.round}" in sentence(r)
    accuracy = {r.round: r.accuracy.mean for r in found if r.defense == "none"}
    assert accuracy[2] > accuracy[0]  # the run trains
    assert all((row.get("metrics") or {}).get("update_norm", 1) > 0 for row in rows if row["kind"] == "attack")
    report = lb.evaluation.store  # noqa: F841 (the report below reads the same store)
    from leakbench.report.html import write_report

    files = write_report(db, tmp_path / "report")
    html = files.index.read_text()
    assert 'id="rounds"' in html and "Leakage along training" in html and "power" in html


# ----------------------------------------------------------------------------- power decides the verdict


def _rows(defense, values, *, public=False, chance=0.3, norm=1.0, model="cnn · round 5"):
    out = []
    for i, v in enumerate(values):
        out.append({"kind": "attack", "dataset": "digits", "model": model, "attack": "ig", "defense": defense,
                    "batch_size": 4, "status": "done", "rmse": v, "psnr": -20 * math.log10(v), "seed": 0,
                    "batch": i, "spec": {"attack": "inverting-gradients", "client": "public" if public else ""},
                    "metrics": {"chance_rmse": chance, "update_norm": norm},
                    "per_sample": {"rmse": [v] * 4, "chance_rmse": [chance] * 4}})
    return out


def _noisy(mean, n=6, seed=0):
    return list(np.random.default_rng(seed).normal(mean, 0.005, n))


def test_a_defense_holds_only_where_the_attack_can_see_on_public_images():
    sees = [*_rows("noise:1", _noisy(0.31)), *_rows("noise:1", _noisy(0.05), public=True)]
    blind = [*_rows("noise:1", _noisy(0.31)), *_rows("noise:1", _noisy(0.31), public=True)]
    (s,) = strongest(sees)
    assert s.stops and s.power.sees and s.n == 6  # public rows never enter S_D
    (b,) = strongest(blind)
    assert not b.stops and "cannot see at this checkpoint" in b.undetermined
    (v,) = [v for v in verdicts(privacy_utility([b], utility_table([])), (math.inf,))]
    assert v.status == "undetermined" and "cannot see" in v.undetermined


def test_a_vanishing_update_is_never_credited_as_stopping_the_attack():
    (s,) = strongest(_rows("none", _noisy(0.31), norm=6e-10, model="cnn"))
    assert not s.stops and "too small to carry anything" in s.undetermined
    (fine,) = strongest(_rows("none", _noisy(0.31), norm=0.5, model="cnn"))
    assert fine.stops and fine.undetermined is None


def test_a_rounds_utility_is_never_stacked_with_other_training():
    from leakbench.evaluation.running.chunks import batch_group

    utility = next(t for t in plan(load_spec(SPEC)) if t.kind == "utility")
    assert batch_group(dataclasses.replace(utility, device="cuda")) is None  # it reads its run: nothing to train


def test_dry_run_refuses_a_layout_no_client_can_fill():
    from leakbench.evaluation.running.preflight import preflight

    assert preflight(load_spec(SPEC)).trials > 0
    crowded = {**SPEC, "datasets": [{"name": "digits", "options": {"limit": 60}}], "batch_sizes": [4],
               "models": [{"spec": "mlp:16", "federated": {**FED, "clients": 20}}]}
    with pytest.raises(ConfigError, match=r"models\[0\]\.federated .*seed 0: expected a batch size of at most"):
        preflight(load_spec(crowded))
