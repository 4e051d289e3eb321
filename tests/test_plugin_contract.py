"""The public contract a plug-in is written against (docs/plugins.md): the base classes, what
``apply_gradients``/``configure`` and ``run``/``run_batch`` receive and return, and what a metric is.

A change that breaks one of these tests breaks plug-ins written against the documented contract: change the
docs, and say so in the release notes, before changing the test.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import pytest
import torch

import leakbench as lb
from leakbench.attacks import ATTACKS, Attack, Reconstruction
from leakbench.attacks import register as register_attack
from leakbench.defenses import DEFENSES, STAGES, ClientPlan, Defense, parse
from leakbench.defenses import register as register_defense
from leakbench.errors import UnsupportedThreatModel
from leakbench.metrics import METRICS
from leakbench.metrics import register as register_metric
from leakbench.threat import Observation


def _params(fn) -> list[tuple[str, str]]:
    """(name, kind) of each parameter, ``self`` left out."""
    return [(p.name, p.kind.name) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


# --------------------------------------------------------------------------- signatures


def test_defense_contract_signatures():
    assert _params(Defense.apply_gradients) == [("grads", "POSITIONAL_OR_KEYWORD"), ("generator", "KEYWORD_ONLY")]
    assert _params(Defense.configure) == [("plan", "POSITIONAL_OR_KEYWORD")]
    assert _params(Defense.describe) == []
    assert _params(register_defense) == [("name", "POSITIONAL_OR_KEYWORD"), ("help", "KEYWORD_ONLY")]
    assert Defense.stage == "shared" and STAGES == ("shared", "model", "step", "round", "aggregate")
    fields = {f.name for f in dataclasses.fields(ClientPlan)}
    assert {"gradient", "wrappers", "local_steps", "local_lr", "local_batch", "local_shuffle", "clients", "reduce",
            "population", "before", "after", "info"} <= fields


def test_attack_contract_signatures():
    assert _params(Attack.__init__) == [("preset", "KEYWORD_ONLY"), ("options", "VAR_KEYWORD")]
    assert _params(Attack.run) == [("obs", "POSITIONAL_OR_KEYWORD"), ("seed", "KEYWORD_ONLY"),
                                   ("callback", "KEYWORD_ONLY"), ("progress", "KEYWORD_ONLY")]
    assert _params(Attack.run_batch) == [("observations", "POSITIONAL_OR_KEYWORD"), ("seeds", "POSITIONAL_OR_KEYWORD"),
                                         ("progress", "KEYWORD_ONLY")]
    assert _params(Attack.requirements) == [("obs", "POSITIONAL_OR_KEYWORD")]
    assert _params(register_attack) == [("cls", "POSITIONAL_OR_KEYWORD")]
    for attr in ("name", "Options", "presets", "preset_revisions", "matching", "modality"):
        assert hasattr(Attack, attr)
    assert [f.name for f in dataclasses.fields(Reconstruction)] == ["images", "labels", "confidence", "trace",
                                                                     "attack", "options"]
    seen = {f.name for f in dataclasses.fields(Observation)}
    assert {"kind", "model", "shared", "param_names", "loss", "batch_size", "input_shape", "num_classes", "labels",
            "defense", "extras"} <= seen


def test_metric_contract_signature():
    assert _params(register_metric) == [("name", "POSITIONAL_OR_KEYWORD"), ("higher_is_better", "KEYWORD_ONLY"),
                                        ("label", "KEYWORD_ONLY"), ("fmt", "KEYWORD_ONLY"), ("help", "KEYWORD_ONLY")]


# --------------------------------------------------------------------------- behaviour


@pytest.fixture
def registered():
    """Names registered by a test, removed afterwards."""
    names: list[tuple] = []
    yield names
    for registry, name in names:
        registry.unregister(name)
        lb.metrics.SCORES.pop(name, None) if registry is METRICS else None


@pytest.fixture(scope="module")
def setting():
    data = lb.load("digits", limit=16)
    model = lb.build("cnn:3-4-2-1", input_shape=data.shape, classes=data.num_classes, act="tanh", seed=0)
    x, y = data.batch(2, seed=0)
    return model, x, y


def test_a_shared_stage_defense_receives_the_tensors_in_parameter_order_and_a_generator(registered, setting):
    model, x, y = setting
    seen = {}

    @register_defense("contract-scale", help="scale every tensor")
    class Scale(Defense):
        def __init__(self, factor: float = 2.0, per_layer: bool = False) -> None:
            self.factor, self.per_layer = factor, per_layer

        def apply_gradients(self, grads, *, generator):
            seen.update(grads=grads, generator=generator)
            return [self.factor * g for g in grads]

    registered.append((DEFENSES, "contract-scale"))
    d = parse("contract-scale:3")
    assert (d.name, d.spec, d.factor, d.per_layer) == ("contract-scale", "contract-scale:3", 3.0, False)
    assert parse("contract-scale:3,true").per_layer is True
    plain = lb.observe(model, x, y)
    obs = lb.observe(model, x, y, defense="contract-scale:3")
    assert isinstance(seen["generator"], torch.Generator)
    assert [tuple(g.shape) for g in seen["grads"]] == [tuple(p.shape) for p in model.parameters()]
    for a, b in zip(obs.shared, plain.shared):
        torch.testing.assert_close(a, 3 * b)
    assert obs.defense == "contract-scale:3"


def test_a_client_defense_fills_its_slots_of_the_plan(registered, setting):
    model, x, y = setting

    @register_defense("contract-local", help="two local steps")
    class TwoSteps(Defense):
        stage = "round"

        def configure(self, plan):
            assert isinstance(plan, ClientPlan)
            plan.local_steps, plan.local_lr = 2, 0.1

    registered.append((DEFENSES, "contract-local"))
    obs = lb.observe(model, x, y, defense="contract-local")
    assert obs.kind == "update" and obs.local_steps == 2 and obs.local_lr == pytest.approx(0.1)


def test_an_attack_gets_options_presets_requirements_and_a_default_run_batch(registered, setting):
    model, x, y = setting
    calls = []

    @register_attack
    class Mean(Attack):
        """the batch mean guess"""
        name = "contract-mean"
        presets = {"quick": {"level": 0.25}}

        @dataclass
        class Options:
            level: float = 0.5

        def requirements(self, obs):
            return [] if obs.kind == "gradient" else ["needs a gradient"]

        def run(self, obs, *, seed=0, callback=None, progress=None):
            calls.append(seed)
            images = torch.full((obs.batch_size, *obs.input_shape), self.options.level)
            images[0, 0, 0, 0] = 1.0
            return Reconstruction(images=images, labels=torch.zeros(obs.batch_size, dtype=torch.long))

    registered.append((ATTACKS, "contract-mean"))
    obs = lb.observe(model, x, y)
    rec = lb.attack("contract-mean", obs, preset="quick", seed=3)
    assert rec.attack == "contract-mean" and rec.options == {"preset": "quick", "level": 0.25}
    assert "seconds" in rec.trace and rec.images.shape == x.shape and calls == [3]
    assert lb.attack("contract-mean", obs, level="0.75").options["level"] == 0.75  # coerced to the field's type
    out = ATTACKS.get("contract-mean")().run_batch([obs, obs], [1, 2])
    assert [type(r) for r in out] == [Reconstruction, Reconstruction] and calls[-2:] == [1, 2]
    update = lb.observe(model, x, y, local_steps=2, local_lr=0.1)
    with pytest.raises(UnsupportedThreatModel, match="needs a gradient"):
        lb.attack("contract-mean", update)
    scores = lb.compare(rec, x, y)
    assert {"mse", "psnr", "ssim", "label_acc"} <= set(scores)


def test_a_metric_is_a_per_sample_function_of_matched_pairs(registered, setting):
    _, x, _ = setting
    got = {}

    @register_metric("contract-max", higher_is_better=False, label="max error")
    def max_error(reconstruction, original):
        got.update(shapes=(tuple(reconstruction.shape), tuple(original.shape)))
        return (reconstruction - original).abs().flatten(1).amax(1)

    registered.append((METRICS, "contract-max"))
    scores = lb.compare(x.flip(0), x)  # matched back to the originals first
    assert got["shapes"] == (tuple(x.shape), tuple(x.shape))
    assert scores["contract-max"] == 0.0 and scores["per_sample"]["contract-max"] == [0.0, 0.0]
    assert METRICS.info("contract-max").label == "max error"
