"""The bundled sweeps: the demo holds every threat model on real photos; liu2024 is the paper's setting."""
from __future__ import annotations

import numpy as np
import pytest

from leakbench.data import load
from leakbench.errors import ConfigError
from leakbench.evaluation import load_spec, plan, run_trial
from leakbench.evaluation.sweep_spec.bundled import preset_names, preset_path
from leakbench.evaluation.trials.trial import THREAT_MODELS

pytestmark = pytest.mark.usefixtures("one_thread")

#: the defense families of Liu et al.'s evaluation (Sec. 5.1) plus DP-SGD, secure aggregation, dropout, quantize.
FAMILIES = {"prune", "clip", "noise", "graddrop", "local", "dpsgd", "secagg", "dropout", "quantize"}


def test_presets_are_listed_and_unknown_names_are_refused():
    assert {"demo", "liu2024"} <= set(preset_names())
    with pytest.raises(ConfigError, match="unknown preset 'lui2024'.*liu2024"):
        preset_path("lui2024")


def test_the_demo_is_a_real_evaluation():
    spec = load_spec(preset_path("demo"))
    assert [(d.name, d.options.get("size")) for d in spec.datasets] == [("photos", 32)]
    # trained models, not untrained toys: one epoch, or FedAvg rounds attacked along training
    assert all(m.training.epochs >= 1 or (m.federated and max(m.federated.rounds) >= 5) for m in spec.models)
    assert spec.batch_sizes == [1, 4, 8, 64]
    assert FAMILIES <= {d.split(":")[0] for d in spec.defense_specs()}
    assert {"inverting-gradients", "liu2024", "robbing-the-fed", "cocktail-party"} <= {a.name for a in spec.attacks}
    trials = plan(spec)
    assert {t.threat_model for t in trials} == set(THREAT_MODELS)
    # DP-SGD at a setting that guarantees something: single-digit ε after the demo's one epoch
    assert all(float(d.split(":")[1].split(",")[1]) >= 1.0 for d in spec.defense_specs() if d.startswith("dpsgd"))
    utility = {(t.model_key, t.batch_size) for t in trials if t.kind == "utility" and "federated" not in t.training}
    assert {b for _, b in utility} == {1, 4, 8, 64}
    # B = 64 is the large-batch cell's alone: SPEAR on an MLP wide enough (≥ 2B neurons), priced at that B
    large = [t for t in trials if t.batch_size == 64]
    assert {t.model_key for t in large} == {"mlp-wide"} and {t.attack for t in large if t.kind == "attack"} >= {"spear"}
    assert {b for k, b in utility if k == "mlp-wide"} == {64}
    # membership with reference models against the demo CNN, on enough points to measure TPR at 1 % FPR
    cnn = next(m for m in spec.models if m.key == "cnn")
    ref = next(e for e in spec.membership if e.reference)
    assert ref.model.spec == cnn.spec and ref.pool // 2 >= 1000 and 2 <= ref.reference_models <= 4
    assert {"none", "dropout", "dpsgd"} <= {d.split(":")[0] for d in ref.defense_specs(spec.defense_specs())}
    assert len(load("photos", **ref.dataset.options)) >= ref.pool


def test_the_liu2024_preset_validates_and_plans_the_papers_grid():
    spec = load_spec(preset_path("liu2024"))
    assert spec.batch_sizes == [2, 4, 8] and spec.threat.bn_stats
    assert {"prune:0.3", "prune:0.99", "clip:2", "clip:8", "noise:0.001", "noise:0.1", "graddrop:0.9",
            "local:5,0.01"} <= set(spec.defense_specs())
    trials = plan(spec)
    attack = [t for t in trials if t.kind == "attack"]
    # 4 attacks, each on its model, × 18 defense settings (none + 5 + 3 + 3 + 4 + 2)
    # × (24 + 12 + 6 batches of 2, 4, 8 from 48 images)
    assert len(attack) == 4 * 18 * (24 + 12 + 6)
    assert {t.threat_model for t in attack} == {"informed-eavesdropper", "malicious-server"}


@pytest.mark.slow  # 15 s: the suite is near its 10-minute bound; `make test-slow` runs it
def test_a_one_trial_slice_of_the_liu2024_preset_runs_here(tmp_path):
    # CIFAR-10 is not on a fresh machine: the same trial on a small CIFAR-shaped npz (32×32×3, 10 classes)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cifar-like.npz", x=rng.integers(0, 256, (200, 32, 32, 3), dtype=np.uint8),
             y=np.repeat(np.arange(10), 20))
    spec = load_spec(preset_path("liu2024")).model_dump()
    spec["datasets"] = [{"name": "npz", "options": {"path": str(tmp_path / "cifar-like.npz")}, "label": "cifar10"}]
    spec["models"][1]["server"]["public"] = 160
    spec["models"][1]["training"]["batch_size"] = 16
    spec["images"] = 8
    spec["utility"] = None
    spec["include"] = [{"model": "resnet18+imprint", "attack": "robbing-the-fed", "defense": "none", "batch_size": 2}]
    trials = plan(load_spec(spec))
    assert len(trials) == 4  # 8 images in batches of 2
    result = run_trial(trials[0], cache_dir=tmp_path)
    assert result.status == "done", result.error
    assert result.metrics["rmse"] < result.metrics["chance_rmse"]


def test_the_learned_prior_preset_attacks_digits_its_prior_never_saw():
    from leakbench.models.prior import PUBLIC_DIGITS

    spec = load_spec(preset_path("learned-prior"))
    (data,) = spec.datasets
    assert data.name == "digits" and data.options["offset"] >= PUBLIC_DIGITS.stop   # the prior trains on 0–999
    assert {a.name for a in spec.attacks} == {"inverting-gradients", "gias", "gifd", "ggl"}
    trials = plan(spec)
    attack = [t for t in trials if t.kind == "attack"]
    assert {t.model_key for t in attack} == {"convnet", "convnet-fl · round 1", "convnet-fl · round 5"}
    assert all(t.threat.get("labels_known") for t in attack)


def test_a_generative_attack_runs_as_a_sweep_trial(tmp_path, monkeypatch):
    """One gias, gifd and ggl trial each of the learned-prior preset, at test budgets: all finish with scores."""
    monkeypatch.setenv("LEAKBENCH_CACHE", str(tmp_path))   # the generator is trained and cached here
    spec = load_spec(preset_path("learned-prior")).model_dump()
    spec["datasets"][0]["options"]["size"] = 8
    spec["models"] = [{"spec": "cnn:3-8-1-1,3-8-2-1", "act": "tanh", "label": "cnn", "training": {"epochs": 1}}]
    spec["attacks"] = [{"name": "gias", "preset": "quick", "options": {"latent_steps": 20, "generator_steps": 5}},
                       {"name": "gifd", "preset": "quick", "options": {"latent_steps": 20, "feature_steps": 5}},
                       {"name": "ggl", "preset": "quick", "options": {"evaluations": 40}}]
    spec["include"], spec["utility"], spec["defenses"], spec["batch_sizes"], spec["images"] = [], None, ["none"], [4], 4
    trials = plan(load_spec(spec))
    assert sorted(t.attack for t in trials) == ["ggl", "gias", "gifd"]
    for trial in trials:
        result = run_trial(trial, cache_dir=tmp_path)
        assert result.status == "done", result.error
        assert np.isfinite(result.metrics["rmse"]) and np.isfinite(result.metrics["chance_rmse"])


def _sweep_text_cli(args: list[str]):
    from typer.testing import CliRunner

    from leakbench.cli import app

    return CliRunner().invoke(app, ["evaluate", *args])


def test_the_sweep_text_preset_is_the_documented_text_sweep():
    spec = load_spec(preset_path("sweep-text"))
    assert [d.name for d in spec.datasets] == ["text"] and spec.models[0].spec.startswith("gpt:")
    assert spec.batch_sizes == [1, 4] and spec.seeds == [0, 1]
    assert [a.name for a in spec.attacks] == ["dager", "tag"]
    assert {d.split(":")[0] for d in spec.defense_specs()} == {"none", "noise", "dpsgd"}
    trials = plan(spec)
    # per defense and attack: 4 batches of 1 and one of 4 per seed; utility: 3 defenses × 2 seeds
    assert sum(t.kind == "attack" for t in trials) == 3 * 2 * 2 * (4 + 1)
    assert sum(t.kind == "utility" for t in trials) == 3 * 2


def test_a_tiny_slice_of_the_sweep_text_preset_runs_end_to_end_with_its_report(tmp_path):
    import yaml

    spec = load_spec(preset_path("sweep-text")).model_dump(mode="json")
    spec.update(seeds=[0], batch_sizes=[1], images=1)
    spec["datasets"][0]["options"]["limit"] = 80
    spec["attacks"] = spec["attacks"][:1]  # DAGER (TAG's optimisation runs in the slow test below)
    spec["utility"] = {**spec["utility"], "seeds": [0]}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    result = _sweep_text_cli([str(path), "--db", str(tmp_path / "t.db"), "--report", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert "S_D (token error = 1 − token acc.)" in result.output
    page = (tmp_path / "report" / "index.html").read_text(encoding="utf-8")
    assert "Text reconstruction scores" in page and "Original and recovered sentences" in page


@pytest.mark.slow
def test_the_sweep_text_preset_runs_as_documented(tmp_path):
    import time

    from leakbench.evaluation.store import Store
    from leakbench.evaluation.verdicts.strongest import strongest

    start = time.perf_counter()
    result = _sweep_text_cli(["--preset", "sweep-text", "--db", str(tmp_path / "t.db"), "--report",
                              str(tmp_path / "report")])
    seconds = time.perf_counter() - start
    assert result.exit_code == 0, result.output
    assert seconds < 300
    rows = Store(tmp_path / "t.db", readonly=True).rows()
    assert {r["status"] for r in rows} == {"done"}
    best = {(s.defense, s.batch_size): s for s in strongest(rows)}
    # undefended: DAGER exact at B = 1 and 4 (token accuracy 1 on every batch), far above the unigram chance
    for b in (1, 4):
        s = best[("none", b)]
        assert s.attack == "dager" and s.sd.mean == 0.0 and s.chance_rmse > 0.9
    # DP-SGD (C = 1, σ = 0.5) stops both attacks at B = 1: nothing significantly above chance on n = 8 batches
    assert best[("dpsgd:1,0.5", 1)].stops


def test_the_malicious_preset_plans_every_server_move_under_each_defense():
    spec = load_spec(preset_path("malicious"))
    assert {m.server.move[0] for m in spec.models} == {"trap_weights", "fishing", "imprint", "loki"}
    trials = [t for t in plan(spec) if t.kind == "attack"]
    # 8 (model, attack) pairs × 3 defenses × 3 batches of 64
    assert len(trials) == 8 * 3 * 3 and {t.threat_model for t in trials} == {"malicious-server"}
    assert {t.defense for t in trials} == {"none", "secagg:4", "local:1,0.05,16"}
