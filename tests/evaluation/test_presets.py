"""The bundled sweeps: the demo holds every threat model on real photos; liu2024 is the paper's setting."""
from __future__ import annotations

import numpy as np
import pytest

from leakbench.data import load
from leakbench.errors import ConfigError
from leakbench.evaluation import load_spec, plan, run_trial
from leakbench.evaluation.bundled import preset_names, preset_path
from leakbench.evaluation.trial import THREAT_MODELS

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
    assert all(m.training.epochs >= 1 for m in spec.models)  # trained models, not untrained toys
    assert spec.batch_sizes == [1, 4, 8]
    assert FAMILIES <= {d.split(":")[0] for d in spec.defense_specs()}
    assert {"inverting-gradients", "liu2024", "robbing-the-fed", "cocktail-party"} <= {a.name for a in spec.attacks}
    trials = plan(spec)
    assert {t.threat_model for t in trials} == set(THREAT_MODELS)
    # DP-SGD at a setting that guarantees something: single-digit ε after the demo's one epoch
    assert all(float(d.split(":")[1].split(",")[1]) >= 1.0 for d in spec.defense_specs() if d.startswith("dpsgd"))
    utility = {(t.model_key, t.batch_size) for t in trials if t.kind == "utility"}
    assert {b for _, b in utility} == {1, 4, 8}
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
