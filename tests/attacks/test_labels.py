"""Label recovery from the last layer's gradient: iDLG (batch of one) and label counts (batches)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.attacks import idlg, label_counts, recover_labels
from leakbench.attacks.labels import last_linear
from leakbench.errors import UnsupportedThreatModel


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    return {"digits": lb.load("digits"), "digits16": lb.load("digits", size=16)}


# id → (spec, build options, dataset, train mode)
NETS = {
    "mlp-relu": ("mlp:32", {}, "digits", False),
    "mlp-relu-nobias": ("mlp:32", {"bias": {"linear": False}}, "digits", False),
    "mlp-sigmoid-nobias": ("mlp:32", {"act": "sigmoid", "bias": False}, "digits", False),
    "lenet-sigmoid": ("lenet", {}, "digits", False),
    "lenet-nobias": ("lenet", {"bias": {"linear": False}}, "digits", False),
    "cnn-tanh": ("cnn:3-4-1-0,3-4-2-1", {"act": "tanh"}, "digits", False),
    "cnn-tanh-nobias": ("cnn:3-4-1-0,3-4-2-1", {"act": "tanh", "bias": {"linear": False}}, "digits", False),
    "convnet4": ("convnet-4", {}, "digits16", False),
    "convnet4-train": ("convnet-4", {}, "digits16", True),
    "convnet4-nobias-train": ("convnet-4", {"bias": {"linear": False}}, "digits16", True),
}


def _net(key, data, seed):
    spec, opts, which, train = NETS[key]
    d = data[which]
    return lb.build(spec, input_shape=d.shape, classes=10, seed=seed, **opts), d, train


def _truth(y, k=10):
    return torch.bincount(y, minlength=k)


# --------------------------------------------------------------------------- iDLG, batch of one


@pytest.mark.parametrize("key", list(NETS))
def test_idlg_exact_for_every_class_and_seed(key, data):
    """iDLG reads the label off the sign pattern of the last layer: exact on every class, every init."""
    for seed in range(3):
        model, d, train = _net(key, data, seed)
        for c in range(10):
            x, y = d.batch(classes=[c], seed=seed + 10 * c)
            obs = lb.observe(model, x, y, train=train)
            got = idlg(obs)
            assert got.dtype == torch.long and got.shape == (1,)
            assert int(got) == c, (key, seed, c)


def test_idlg_bias_rule_is_the_only_negative_entry(data):
    """With a bias, ∇b = p − e_c: exactly one negative entry, at the label (the fact iDLG uses)."""
    model, d, _ = _net("mlp-relu", data, 0)
    for c in range(10):
        x, y = d.batch(classes=[c], seed=c)
        obs = lb.observe(model, x, y)
        _, _, b = last_linear(obs)
        gb = obs.shared[b]
        assert (gb < 0).nonzero().flatten().tolist() == [c]
        assert torch.allclose(gb.sum(), torch.zeros(()), atol=1e-6)


def test_idlg_from_a_local_update(data):
    """After one local step the update is −lr·∇: the label is read the same way."""
    model, d, _ = _net("lenet-sigmoid", data, 0)
    for c in (0, 3, 9):
        x, y = d.batch(classes=[c], seed=c)
        assert int(idlg(lb.observe(model, x, y, local_steps=1, local_lr=0.1))) == c


@pytest.mark.parametrize("loss", ["logistic", "exponential"])
@pytest.mark.parametrize("bias", [True, False])
def test_idlg_single_sample_binary_losses(loss, bias):
    """Scalar output, ±1 labels: ∂ℓ/∂f has the sign of −y, so the bias (or feature-weighted) gradient does too."""
    sphere = lb.load("sphere", n=40, d=10, seed=1)
    hits = 0
    for seed in range(3):
        model = lb.build("mlp:16", input_shape=sphere.shape, classes=1, seed=seed, bias=bias)
        for i in range(len(sphere)):
            x, y = sphere.batch(indices=[i])
            obs = lb.observe(model, x, y, loss=loss)
            assert int(idlg(obs)) == int(y), (seed, i)
            assert torch.equal(recover_labels(obs), y)
            hits += 1
    assert hits == 120 and set(sphere.labels.tolist()) == {0, 1}


def test_binary_losses_have_no_batch_counting():
    sphere = lb.load("sphere")
    model = lb.build("mlp:8", input_shape=sphere.shape, classes=1, seed=0)
    x, y = sphere.batch(4, seed=0)
    obs = lb.observe(model, x, y, loss="logistic")
    with pytest.raises(UnsupportedThreatModel, match="needs loss 'ce' or 'mse'.*labels_known=True"):
        label_counts(obs)
    with pytest.raises(UnsupportedThreatModel):
        recover_labels(obs)
    granted = lb.observe(model, x, y, loss="logistic", labels_known=True)
    assert torch.equal(recover_labels(granted), y)


# --------------------------------------------------------------------------- counts, batches


def _batches(seed, sizes=(2, 3, 4, 5, 6, 8)):
    """(distinct labels, repeated labels from three classes, one class only) per size."""
    g = torch.Generator().manual_seed(seed)
    for b in sizes:
        yield torch.randperm(10, generator=g)[:b].tolist()
        yield torch.randint(0, 3, (b,), generator=g).tolist()
    yield [int(torch.randint(0, 10, (1,), generator=g))] * 5


# The regime where counting is exact: CE, a bias on the last layer, untrained nets,
# B ≤ 8 — for BN nets in eval mode and in training mode.
EXACT = ["mlp-relu", "lenet-sigmoid", "lenet-nobias", "cnn-tanh", "convnet4", "convnet4-train"]


@pytest.mark.parametrize("key", EXACT)
def test_label_counts_exact_on_small_batches(key, data):
    for seed in range(2):
        model, d, train = _net(key, data, seed)
        for classes in _batches(seed):
            x, y = d.batch(classes=classes, seed=seed)
            obs = lb.observe(model, x, y, train=train)
            counts = label_counts(obs)
            assert counts.dtype == torch.long and counts.shape == (10,)
            assert torch.equal(counts, _truth(y)), (key, seed, classes, counts.tolist())
            # recover_labels lists them sorted by class
            assert torch.equal(recover_labels(obs), torch.sort(y).values)


def test_train_mode_counts_use_the_clients_batch_statistics(data):
    """Regression: the mean prediction must be estimated in the client's mode.  In eval mode the
    ConvNet's untouched running statistics (0, 1) give outputs on another scale, and the counts of a
    training-mode observation were wrong from B = 4 on."""
    model, d, _ = _net("convnet4", data, 0)
    x, y = d.batch(classes=[1, 4, 4, 7, 2, 2, 2, 9], seed=0)
    obs = lb.observe(model, x, y, train=True)
    before = {k: v.clone() for k, v in obs.model.state_dict().items()}
    assert torch.equal(label_counts(obs), _truth(y))
    # and the estimate leaves the attacker's model as it was (BN running statistics, mode)
    for k, v in obs.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert obs.model.training


def test_label_counts_are_deterministic_and_leave_the_model_alone(data):
    model, d, _ = _net("mlp-relu", data, 0)
    x, y = d.batch(6, seed=0)
    obs = lb.observe(model, x, y)
    assert torch.equal(label_counts(obs, seed=3), label_counts(obs, seed=3))
    assert not obs.model.training
    assert all(not m._forward_hooks for m in obs.model.modules())


# Regimes where the estimate of the batch's mean prediction (or mean feature sum) is off by more
# than 1/(2B): large batches, a last layer without bias whose per-sample feature sums differ, BN in
# training mode with B ≥ 16.  Counts need not be exact there, but these always hold.
ALWAYS = [("mlp-relu", (2, 8, 16, 32)), ("mlp-relu-nobias", (8, 16, 32)), ("mlp-sigmoid-nobias", (16, 32)),
          ("lenet-sigmoid", (32,)), ("convnet4-train", (16, 32)), ("convnet4-nobias-train", (4, 16, 32))]


@pytest.mark.parametrize("key,sizes", ALWAYS, ids=[a[0] for a in ALWAYS])
def test_label_counts_properties_that_always_hold(key, sizes, data):
    for seed in range(2):
        model, d, train = _net(key, data, seed)
        for classes in _batches(seed, sizes):
            x, y = d.batch(classes=classes, seed=seed)
            obs = lb.observe(model, x, y, train=train)
            counts = label_counts(obs)
            assert int(counts.sum()) == len(classes)
            assert bool((counts >= 0).all())
            layer, w, b = last_linear(obs)
            # ∇b (or, with features ≥ 0, the row sums of ∇W) is negative only for classes in the batch
            signal = obs.shared[b] if b is not None else obs.shared[w].sum(1)
            negative = signal < 0
            assert bool((_truth(y)[negative] >= 1).all())
            assert bool((counts[negative] >= 1).all()), (key, classes, counts.tolist(), negative.tolist())


def _constant_output_obs(logits_at_data, weights, x, y):
    """A linear model on 1-d inputs; its prediction on the data differs from that on the data box."""
    model = nn.Sequential(nn.Linear(1, len(logits_at_data)))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor(weights).reshape(-1, 1))
        model[0].bias.copy_(torch.tensor(logits_at_data))
    return lb.observe(model, x, y)


def test_negative_bias_gradient_keeps_its_count_when_the_estimate_is_poor():
    """Regression: when rounding gave more than B samples, the surplus was taken from a class whose
    ∇b < 0 (which proves it is in the batch) — here the answer [1, 1, 0] became [0, 1, 1]."""
    x, y = torch.zeros(2, 1), torch.tensor([0, 1])
    # at x = 0 p ≈ (0.45, 0.45, 0.1); on the box [0, 1] the model mostly predicts class 2
    obs = _constant_output_obs([math.log(4.5), math.log(4.5), 0.0], [0.0, 0.0, 20.0], x, y)
    assert (obs.shared[1] < 0).tolist() == [True, True, False]
    assert label_counts(obs).tolist() == [1, 1, 0]
    assert recover_labels(obs).tolist() == [0, 1]


def test_more_negative_classes_than_samples_still_sum_to_b():
    """A noisy (defended) gradient can show more negative entries than samples: the sum wins."""
    model = lb.build("mlp:8", input_shape=(1, 8, 8), classes=5, seed=0)
    x, y = lb.load("digits").batch(classes=[0, 1], seed=0)
    obs = lb.observe(model, x, y)
    _, _, b = last_linear(obs)
    obs.shared[b] = torch.tensor([-0.1, -0.2, -0.3, -0.05, 0.65])
    counts = label_counts(obs)
    assert int(counts.sum()) == 2 and bool((counts >= 0).all())


# --------------------------------------------------------------------------- granted labels, errors


def test_recover_labels_returns_the_granted_labels(data):
    model, d, _ = _net("mlp-relu", data, 0)
    x, y = d.batch(classes=[7, 2, 7, 0], seed=0)
    obs = lb.observe(model, x, y, labels_known=True)
    got = recover_labels(obs)
    assert torch.equal(got, y)  # in the batch's own order, not sorted
    got[0] = 5
    assert torch.equal(obs.labels, y)  # a copy
    # a single sample: the granted label even if iDLG would say otherwise
    x1, y1 = d.batch(classes=[3], seed=0)
    obs1 = lb.observe(model, x1, y1, labels_known=True)
    obs1.labels = torch.tensor([8])
    assert recover_labels(obs1).tolist() == [8]
    assert idlg(obs1).tolist() == [3]


def test_single_sample_recover_labels_uses_idlg(data):
    model, d, _ = _net("lenet-sigmoid", data, 0)
    x, y = d.batch(classes=[6], seed=0)
    obs = lb.observe(model, x, y)
    assert torch.equal(recover_labels(obs), y)
    assert torch.equal(label_counts(obs), _truth(y))


def test_label_recovery_needs_a_final_linear_layer(data):
    d = data["digits"]
    x, y = d.batch(2, seed=0)
    pooled = nn.Sequential(nn.Flatten(), nn.Linear(64, 20), nn.Unflatten(1, (1, 20)), nn.AvgPool1d(2), nn.Flatten())
    obs = lb.observe(pooled, x, y)
    assert obs.num_classes == 10
    with pytest.raises(UnsupportedThreatModel, match="final nn.Linear layer with one output per class"):
        idlg(obs)
    frozen = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    frozen[3].weight.requires_grad_(False)
    with pytest.raises(UnsupportedThreatModel, match="weight is not among the shared parameters"):
        label_counts(lb.observe(frozen, x, y))
