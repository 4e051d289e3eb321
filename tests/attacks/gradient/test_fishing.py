"""Class fishing (Wen et al. 2022): only the target class reaches the body; its samples are read exactly from a
first FC layer, or inverted by gradient matching at B = 1 on a model without one."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError, NothingRecovered, UnsupportedThreatModel
from leakbench.models.active import fishing

CNN = "cnn:3-6-1-0,4-3-2-0"  # a small untrained ConvNet (no first FC layer) on 8×8 digits


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")


def test_the_head_keeps_the_target_row_and_silences_the_others(digits):
    model = lb.build("mlp:64", input_shape=digits.shape, classes=10, seed=0)
    shipped = fishing(model, target=3, calibration=digits.images[-256:])
    w, b = shipped.fc.weight.detach(), shipped.fc.bias.detach()
    assert torch.equal(w[3], model.fc.weight[3].detach()) and float(b[3]) == float(model.fc.bias[3].detach())
    assert bool((w[torch.arange(10) != 3] == 0).all()) and len(set(b[torch.arange(10) != 3].tolist())) == 1
    assert shipped.fishing_target == 3 and torch.equal(model.fc.weight, lb.build("mlp:64", input_shape=digits.shape,
                                                                                    classes=10, seed=0).fc.weight)
    # every public image: the target class is (almost) never predicted
    probs = torch.softmax(shipped(digits.images[:200]), 1)[:, 3]
    assert float(probs.max()) < 1e-6


def test_the_fished_samples_are_read_exactly_and_no_other(digits):
    model = lb.build("mlp:1000", input_shape=digits.shape, classes=10, seed=0)
    shipped = fishing(model, target=3, calibration=digits.images[-256:])
    x, y = digits.images[:64], digits.labels[:64]
    rec = lb.attack("fishing", lb.observe(shipped, x, y))
    r = rec.images.reshape(64, -1).double()
    err = (r[None] - x.reshape(64, -1).double()[:, None]).abs().amax(-1).min(1).values
    exact = err < 1e-3
    target = y == 3
    assert int(exact[target].sum()) >= int(target.sum()) - 2 and not bool(exact[~target].any())
    assert rec.trace["fished_class"] == 3 and rec.trace["lone"] == int(exact[target].sum())


def test_fishing_needs_its_head_and_the_row_read_out_a_first_fc_layer(digits):
    x, y = digits.batch(4, seed=0)
    honest = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    with pytest.raises(UnsupportedThreatModel, match="fishing"):
        lb.attack("fishing", lb.observe(honest, x, y))
    cnn = fishing(lb.build("cnn:3-4-1-1", input_shape=digits.shape, classes=10, seed=0), target=1)
    with pytest.raises(UnsupportedThreatModel, match="readout='matching'"):
        lb.attack("fishing", lb.observe(cnn, x, y), readout="rows")
    with pytest.raises(ConfigError, match="target"):
        fishing(honest, target=10)


def _one_target_batch(digits, target: int, size: int, start: int = 0):
    """``size`` digits: the first class-``target`` digit from ``start`` in slot 0, then digits of other classes."""
    idx = [i for i in range(start, start + 200) if int(digits.labels[i]) == target][:1]
    idx += [i for i in range(start, start + 200) if int(digits.labels[i]) != target][:size - 1]
    return digits.batch(indices=idx)


@pytest.mark.parametrize("margin", [8.0, 20.0])
def test_the_fished_body_gradient_is_the_target_samples_alone(digits, margin):
    """B·∇(mean loss of the batch) below the head = ∇ℓ(target sample) up to e^(−margin) (plain autograd)."""
    model = lb.build(CNN, input_shape=digits.shape, classes=10, act="tanh", seed=0).double()
    shipped = fishing(model, target=2, margin=margin, calibration=digits.images[-256:].double())
    x, y = _one_target_batch(digits, 2, 4)
    x = x.double()
    body = [p for n, p in shipped.named_parameters() if not n.startswith(shipped.fishing_head + ".")]
    batch = torch.autograd.grad(torch.nn.functional.cross_entropy(shipped(x), y), body)
    alone = torch.autograd.grad(torch.nn.functional.cross_entropy(shipped(x[:1]), y[:1]), body)
    flat = lambda gs: torch.cat([g.reshape(-1) for g in gs])  # noqa: E731
    rel = float((4 * flat(batch) - flat(alone)).norm() / flat(alone).norm())
    assert 0 < rel <= 4 * 2 * torch.exp(torch.tensor(-margin)).item()


def test_the_matching_read_out_recovers_the_fished_sample_above_grey(digits):
    model = lb.build(CNN, input_shape=digits.shape, classes=10, act="tanh", seed=0)
    shipped = fishing(model, target=2, calibration=digits.images[-256:])
    x, y = _one_target_batch(digits, 2, 4)
    rec = lb.attack("fishing", lb.observe(shipped, x, y), preset="quick", iterations=100)
    assert rec.trace["readout"] == "matching" and rec.trace["fished_class"] == 2
    assert abs(rec.trace["fished_count_estimate"] - 1) < 1e-3 and "fished_count_granted" not in rec.trace
    assert rec.confidence.tolist() == [1.0, 0.0, 0.0, 0.0]
    got = float(lb.metrics.psnr(rec.images[:1], x[:1]).mean())
    grey = float(lb.metrics.psnr(torch.full_like(x[:1], float(x[0].mean())), x[:1]).mean())
    assert got > grey + 3, (got, grey)


def test_the_stacked_read_out_equals_one_at_a_time(digits):
    model = lb.build(CNN, input_shape=digits.shape, classes=10, act="tanh", seed=0)
    shipped = fishing(model, target=2, calibration=digits.images[-256:])
    observations = [lb.observe(shipped, *_one_target_batch(digits, 2, 4, start)) for start in (0, 300)]
    stacked = lb.attacks.attack_batch("fishing", observations, seeds=[0, 1], preset="quick", iterations=10)
    for obs, seed, rec in zip(observations, (0, 1), stacked):
        alone = lb.attack("fishing", obs, seed=seed, preset="quick", iterations=10)
        assert torch.allclose(rec.images, alone.images, atol=1e-4)


@pytest.mark.parametrize("options,field", [({"engine": "nope"}, "engine"), ({"readout": "both"}, "readout"),
                                           ({"iterations": 0}, "iterations")])
def test_bad_options_name_their_field(digits, options, field):
    with pytest.raises(ConfigError, match=f"option {field}"):
        lb.attacks.create("fishing", **options)


def test_a_final_layer_without_bias_is_refused(digits):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10, bias=False))
    with pytest.raises(ConfigError, match="bias"):
        fishing(model, target=1, input_shape=(1, 8, 8))


PUBLIC = slice(1000, 1400)  # the server's labelled public digits (never attacked here)


def test_feature_fishing_passes_only_target_samples_below_the_threshold(digits):
    """p_target = σ(m(φ_j − τ)) exactly, and per-sample body gradients (autograd): a target sample far below τ
    sends one, a target sample far above τ and another class's sample far below τ send ≈ none."""
    model = lb.build(CNN, input_shape=digits.shape, classes=10, act="tanh", seed=0).double()
    public = (digits.images[PUBLIC].double(), digits.labels[PUBLIC])
    shipped = fishing(model, target=2, quantile=0.5, calibration=public)
    j, tau = shipped.fishing_feature, shipped.fishing_threshold
    x, y = digits.images[:300].double(), digits.labels[:300]
    seen = []
    handle = shipped.fc.register_forward_hook(lambda m, i, o: seen.append(i[0][:, j].detach()))
    p = torch.softmax(shipped(x), 1)[:, 2].detach()
    handle.remove()
    phi, m = seen[0], float(shipped.fc.weight[2, j])
    assert torch.allclose(p, torch.sigmoid(m * (phi - tau)), rtol=1e-9, atol=1e-12)
    body = [q for n, q in shipped.named_parameters() if not n.startswith("fc.")]

    def norm(i):
        g = torch.autograd.grad(torch.nn.functional.cross_entropy(shipped(x[i:i + 1]), y[i:i + 1]), body)
        return float(torch.cat([v.reshape(-1) for v in g]).norm())

    far = 20 / m  # σ_j: a sample one spread from τ is damped by e^(−20)
    below = [i for i in range(300) if y[i] == 2 and phi[i] < tau - far]
    above = [i for i in range(300) if y[i] == 2 and phi[i] > tau + far]
    other = [i for i in range(300) if y[i] != 2 and phi[i] < tau - far]
    assert below and above and other
    strong = min(norm(i) for i in below[:3])
    assert strong > 0 and max(norm(i) for i in above[:3] + other[:3]) < 1e-6 * strong


def test_feature_fishing_is_read_out_on_a_cnn(digits):
    model = lb.build(CNN, input_shape=digits.shape, classes=10, act="tanh", seed=0)
    shipped = fishing(model, target=2, quantile=0.5, calibration=(digits.images[PUBLIC], digits.labels[PUBLIC]))
    x, y = _one_target_batch(digits, 2, 4)
    rec = lb.attack("fishing", lb.observe(shipped, x, y), preset="quick", iterations=5)
    assert rec.trace["readout"] == "matching" and rec.trace["fished_feature"] == shipped.fishing_feature
    assert "feature fishing" in rec.trace["fished_count_note"]


@pytest.mark.parametrize("options,field", [({"quantile": 0.5, "feature": 10_000}, "feature"),
                                           ({"quantile": 1.0}, "quantile"), ({"quantile": 0.0}, "quantile"),
                                           ({"feature": 3}, "quantile")])
def test_feature_fishing_bad_options_name_their_argument(digits, options, field):
    model = lb.build(CNN, input_shape=digits.shape, classes=10, act="tanh", seed=0)
    with pytest.raises(ConfigError, match=f"argument {field}"):
        fishing(model, target=2, calibration=(digits.images[PUBLIC], digits.labels[PUBLIC]), **options)


def test_feature_fishing_needs_labelled_public_samples_and_a_bias(digits):
    model = lb.build(CNN, input_shape=digits.shape, classes=10, act="tanh", seed=0)
    with pytest.raises(ConfigError, match="labelled public samples"):
        fishing(model, target=2, quantile=0.5, calibration=digits.images[PUBLIC])
    no_bias = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10, bias=False))
    with pytest.raises(ConfigError, match="bias"):
        fishing(no_bias, target=1, quantile=0.5, input_shape=(1, 8, 8),
                calibration=(digits.images[PUBLIC], digits.labels[PUBLIC]))


def test_the_matching_read_out_of_a_full_batch_fedavg_update(digits):
    """k full-batch local steps of lr on the mean over B: simulated as the fished sample's own steps of lr/B."""
    model = lb.build(CNN, input_shape=digits.shape, classes=10, act="tanh", seed=0)
    shipped = fishing(model, target=2, calibration=digits.images[-256:])
    x, y = _one_target_batch(digits, 2, 4)
    obs = lb.observe(shipped, x, y, defense="local:2,0.05")
    assert obs.kind == "update" and obs.local_steps == 2
    rec = lb.attack("fishing", obs, preset="quick", iterations=100)
    assert rec.trace["match"].startswith("exact")
    got = float(lb.metrics.psnr(rec.images[:1], x[:1]).mean())
    grey = float(lb.metrics.psnr(torch.full_like(x[:1], float(x[0].mean())), x[:1]).mean())
    assert got > grey + 3, (got, grey)


def test_a_batch_without_the_target_class_recovers_nothing_and_says_so(digits):
    model = lb.build(CNN, input_shape=digits.shape, classes=10, act="tanh", seed=0).double()
    shipped = fishing(model, target=2, margin=800.0, calibration=digits.images[-256:].double())  # e^(−800) = 0
    idx = [i for i in range(100) if int(digits.labels[i]) != 2][:4]
    x, y = digits.batch(indices=idx)
    with pytest.raises(NothingRecovered, match="no sample of the batch passed"):
        lb.attack("fishing", lb.observe(shipped, x.double(), y), preset="quick", iterations=5)
