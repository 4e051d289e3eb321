"""observe() and Observation: what the server sees, against independent computations."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leakbench as lb
from leakbench.defenses import DEFENSES, Defense
from leakbench.errors import ConfigError
from leakbench.threat import Observation, observe


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")


@pytest.fixture(scope="module")
def digits16():
    return lb.load("digits", size=16)


# spec, build options, which dataset
MODELS = [
    ("mlp:16", {}, "digits"),
    ("cnn:3-4-1-0,3-4-2-1", {"act": "tanh"}, "digits"),
    ("lenet", {}, "digits"),
    ("convnet-4", {}, "digits16"),
]


def _hand_loss(name, out, y):
    if name == "ce":
        return F.cross_entropy(out, y)
    return ((out - F.one_hot(y, out.shape[-1]).to(out.dtype)) ** 2).sum(1).mean()


def _hand_grad(model, x, y, loss="ce", train=False):
    m = copy.deepcopy(model).train(train)
    params = [p for p in m.parameters() if p.requires_grad]
    return list(torch.autograd.grad(_hand_loss(loss, m(x), y), params))


def _close(a, b, dtype=torch.float32):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-13)
    return len(a) == len(b) and all(torch.allclose(u, v, **tol) for u, v in zip(a, b))


@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("spec,opts,which", MODELS, ids=[m[0] for m in MODELS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_gradient_equals_autograd_of_mean_loss(spec, opts, which, loss, dtype, digits, digits16):
    data = digits if which == "digits" else digits16
    model = lb.build(spec, input_shape=data.shape, classes=10, seed=1, dtype=dtype, **opts)
    x, y = data.batch(3, seed=2)
    x = x.to(dtype)
    obs = observe(model, x, y, loss=loss)
    expected = _hand_grad(model, x, y, loss)
    assert obs.kind == "gradient" and obs.dtype == dtype
    assert [tuple(s.shape) for s in obs.shared] == [tuple(p.shape) for p in model.parameters()]
    assert _close(obs.shared, expected, dtype)
    assert obs.gradients is obs.shared
    assert any(float(g.abs().max()) > 0 for g in obs.shared)


def test_train_mode_gradient_uses_batch_statistics(digits16):
    model = lb.build("convnet-4", input_shape=digits16.shape, classes=10, seed=0)
    x, y = digits16.batch(4, seed=0)
    train = observe(model, x, y, train=True)
    evalg = observe(model, x, y, train=False)
    assert _close(train.shared, _hand_grad(model, x, y, train=True))
    assert not _close(train.shared, evalg.shared)  # the flag matters for a BN net
    assert train.train_mode and not evalg.train_mode
    assert train.model.training and not evalg.model.training


def test_metadata_of_a_gradient_observation(digits):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits.batch(5, seed=0)
    obs = observe(model, x, y)
    assert obs.kind == "gradient" and obs.loss == "ce"
    assert obs.batch_size == 5 and obs.input_shape == (1, 8, 8) and obs.num_classes == 10
    assert obs.param_names == [n for n, _ in model.named_parameters()]
    assert obs.labels is None and not obs.labels_known and obs.bn_stats is None
    assert obs.local_steps == 1 and obs.local_lr == 0.0 and obs.defense == "none"
    assert obs.data_range == (0.0, 1.0) and obs.device == torch.device("cpu")
    assert set(obs.params()) == set(obs.param_names)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("initially_training", [False, True])
def test_user_model_is_not_modified(train, initially_training, digits16):
    model = lb.build("convnet-4", input_shape=digits16.shape, classes=10, seed=0)
    # non-trivial running statistics, so a reset would be visible too
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    model.train(initially_training)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = digits16.batch(4, seed=1)
    for kwargs in ({}, {"local_steps": 3, "local_lr": 0.5}, {"bn_stats": train} if train else {"loss": "mse"}):
        obs = observe(model, x, y, train=train, **kwargs)
        after = model.state_dict()
        for k, v in before.items():
            assert torch.equal(after[k], v), k
        assert model.training == initially_training
        assert all(m.training == initially_training for m in model.modules())
        assert all(not m._forward_hooks for m in model.modules())
        assert all(p.grad is None and p.requires_grad for p in model.parameters())
        # the attacker's copy starts from the same parameters and buffers, in the client's mode
        assert obs.model is not model and obs.model.training == train
        for k, v in before.items():
            assert torch.equal(obs.model.state_dict()[k], v), k


def _sgd_by_hand(model, x, y, *, steps, lr, train, loss="ce"):
    m = copy.deepcopy(model).train(train)
    start = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        _hand_loss(loss, m(x), y).backward()
        grads.append([p.grad.detach().clone() for p in m.parameters()])
        opt.step()
    update = [p.detach() - s for p, s in zip(m.parameters(), start)]
    return update, grads


@pytest.mark.parametrize("spec,which,train", [("mlp:16", "digits", False), ("lenet", "digits", False),
                                              ("convnet-4", "digits16", True)])
@pytest.mark.parametrize("steps", [1, 3])
def test_local_steps_update_equals_hand_sgd(spec, which, train, steps, digits, digits16):
    data = digits if which == "digits" else digits16
    model = lb.build(spec, input_shape=data.shape, classes=10, seed=3)
    x, y = data.batch(4, seed=3)
    lr = 0.05
    obs = observe(model, x, y, local_steps=steps, local_lr=lr, train=train)
    update, grads = _sgd_by_hand(model, x, y, steps=steps, lr=lr, train=train)
    assert obs.kind == "update" and obs.local_steps == steps and obs.local_lr == lr
    assert _close(obs.shared, update)
    # obs.gradients is the update ÷ (−lr·k): the mean gradient along the client's trajectory
    mean_grad = [sum(g[i] for g in grads) / steps for i in range(len(update))]
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(obs.gradients, mean_grad))
    assert all(torch.allclose(a, -u / (lr * steps)) for a, u in zip(obs.gradients, obs.shared))
    # the attacker's model holds θ_0, not θ_k
    for p, q in zip(obs.model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_one_local_step_gradients_equal_the_shared_gradient(digits):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits.batch(4, seed=0)
    grad = observe(model, x, y)
    upd = observe(model, x, y, local_steps=1, local_lr=0.3)
    assert _close(upd.gradients, grad.shared)
    with pytest.raises(ConfigError, match="kind 'weights' holds no gradient"):
        _ = dataclasses.replace(grad, kind="weights").gradients


def test_labels_known_grants_a_copy_of_the_labels(digits):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits.batch(4, seed=0)
    obs = observe(model, x, y, labels_known=True)
    assert obs.labels_known and torch.equal(obs.labels, y)
    y[0] = (y[0] + 1) % 10
    assert not torch.equal(obs.labels, y)  # a copy, not the caller's tensor
    assert observe(model, x, y).labels is None


def _bn_inputs_by_hand(model, x):
    """Walk the Sequential ConvNet in training mode and take the batch statistics at every BN input."""
    m = copy.deepcopy(model).train()
    stats, h = [], x
    with torch.no_grad():
        for layer in m:
            if isinstance(layer, nn.BatchNorm2d):
                mean = h.mean(dim=(0, 2, 3))
                var = ((h - mean[None, :, None, None]) ** 2).mean(dim=(0, 2, 3))
                stats.append((mean, var))
            h = layer(h)
    return stats


@pytest.mark.parametrize("steps", [0, 2])
def test_bn_stats_equal_batch_statistics(steps, digits16):
    model = lb.build("convnet-4", input_shape=digits16.shape, classes=10, seed=0)
    x, y = digits16.batch(6, seed=0)
    obs = observe(model, x, y, train=True, bn_stats=True, local_steps=steps)
    expected = _bn_inputs_by_hand(model, x)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert len(expected) == n_bn == 8
    assert obs.bn_stats is not None and len(obs.bn_stats) == n_bn  # one pair per BN layer, at θ_0
    for (m, v), (me, ve) in zip(obs.bn_stats, expected):
        assert m.shape == me.shape and v.shape == ve.shape
        assert torch.allclose(m, me, rtol=1e-5, atol=1e-6) and torch.allclose(v, ve, rtol=1e-5, atol=1e-6)
        assert not m.requires_grad and not v.requires_grad
    # the first layer's statistics agree with the running-statistics update of BatchNorm itself
    first = copy.deepcopy(model).train()
    first.bn0.momentum = 1.0
    with torch.no_grad():
        first(x)
    n = x.shape[0] * x.shape[2] * x.shape[3]
    assert torch.allclose(obs.bn_stats[0][0], first.bn0.running_mean, atol=1e-6)
    assert torch.allclose(obs.bn_stats[0][1], first.bn0.running_var * (n - 1) / n, rtol=1e-5, atol=1e-6)


def test_bn_stats_need_train(digits16):
    model = lb.build("convnet-4", input_shape=digits16.shape, classes=10, seed=0)
    x, y = digits16.batch(2, seed=0)
    with pytest.raises(ConfigError, match="bn_stats=True needs train=True"):
        observe(model, x, y, bn_stats=True)
    assert observe(model, x, y, train=True).bn_stats is None  # not granted unless asked


def test_input_shape_mismatch_names_both_shapes(digits, digits16):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits16.batch(2, seed=0)
    with pytest.raises(ConfigError) as info:
        observe(model, x, y)
    msg = str(info.value)
    assert "(1, 8, 8)" in msg and "(1, 16, 16)" in msg and "argument x" in msg


def test_label_count_mismatch(digits):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits.batch(4, seed=0)
    with pytest.raises(ConfigError, match=r"one label per sample \(4\), got \(3,\) \(argument y\)"):
        observe(model, x, y[:3])
    with pytest.raises(ConfigError, match="got list"):
        observe(model, x, [0, 1, 2, 3])


@pytest.mark.parametrize("kwargs,match", [
    ({"loss": "hinge"}, "unknown loss 'hinge'"),
    ({"local_steps": -1}, "expected local_steps ≥ 0"),
    ({"local_steps": 1.5}, "expected local_steps ≥ 0"),
    ({"local_steps": 2, "local_lr": 0.0}, "expected local_lr > 0"),
])
def test_bad_options(kwargs, match, digits):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits.batch(2, seed=0)
    with pytest.raises(ConfigError, match=match):
        observe(model, x, y, **kwargs)


def test_bad_x(digits):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    with pytest.raises(ConfigError, match="expected x as a batch tensor"):
        observe(model, torch.zeros(64), torch.zeros(64, dtype=torch.long))
    with pytest.raises(ConfigError, match="expected x as a batch tensor"):
        observe(model, [[0.0]], torch.zeros(1, dtype=torch.long))


def test_plain_module_without_input_shape(digits):
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    x, y = digits.batch(3, seed=0)
    y = y % 3
    obs = observe(model, x, y)
    assert obs.num_classes == 3 and _close(obs.shared, _hand_grad(model, x, y))


def test_observation_to_cpu_round_trip(digits16):
    model = lb.build("convnet-4", input_shape=digits16.shape, classes=10, seed=0)
    x, y = digits16.batch(3, seed=0)
    obs = observe(model, x, y, train=True, bn_stats=True, labels_known=True, local_steps=2)
    moved = obs.to("cpu")
    assert isinstance(moved, Observation) and moved is not obs and moved.model is not obs.model
    assert all(torch.equal(a, b) for a, b in zip(moved.shared, obs.shared))
    assert torch.equal(moved.labels, obs.labels)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(moved.bn_stats, obs.bn_stats))
    for k, v in obs.model.state_dict().items():
        assert torch.equal(moved.model.state_dict()[k], v)
    for f in ("kind", "param_names", "loss", "batch_size", "input_shape", "num_classes", "local_steps",
              "local_lr", "train_mode", "defense", "data_range"):
        assert getattr(moved, f) == getattr(obs, f), f
    assert moved.model.training == obs.model.training
    assert all(torch.allclose(a, b) for a, b in zip(moved.gradients, obs.gradients))
    # a copy without labels or BN statistics stays without them
    plain = observe(model, x, y).to(torch.device("cpu"))
    assert plain.labels is None and plain.bn_stats is None


@pytest.mark.parametrize("defense", [None, "none", " none "])
def test_no_defense_leaves_the_gradient_unchanged(defense, digits):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits.batch(3, seed=0)
    obs = observe(model, x, y, defense=defense)
    assert obs.defense == "none"
    assert all(torch.equal(a, b) for a, b in zip(obs.shared, observe(model, x, y).shared))
    assert _close(obs.shared, _hand_grad(model, x, y))


class _Noise(Defense):
    """test-only: add N(0, σ²) drawn from the generator observe() seeds."""

    spec = "_test_noise"

    def __init__(self, sigma: float = 0.1) -> None:
        self.sigma = sigma

    def apply_gradients(self, grads, *, generator):
        return [g + self.sigma * torch.randn(g.shape, generator=generator).to(g) for g in grads]


def test_defense_is_applied_to_what_is_shared_and_seeded(digits):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits.batch(3, seed=0)
    clean = observe(model, x, y).shared
    a = observe(model, x, y, defense=_Noise(0.5), seed=7)
    b = observe(model, x, y, defense=_Noise(0.5), seed=7)
    c = observe(model, x, y, defense=_Noise(0.5), seed=8)
    assert a.defense == "_test_noise"
    assert all(torch.equal(u, v) for u, v in zip(a.shared, b.shared))
    assert not all(torch.equal(u, v) for u, v in zip(a.shared, c.shared))
    gen = torch.Generator().manual_seed(7)
    expected = [g + 0.5 * torch.randn(g.shape, generator=gen) for g in clean]
    assert _close(a.shared, expected)
    # on an update the defense acts on θ_k − θ_0; the attacker's model is untouched by it
    upd = observe(model, x, y, local_steps=2, local_lr=0.1, defense=_Noise(0.5), seed=7)
    plain = observe(model, x, y, local_steps=2, local_lr=0.1).shared
    gen = torch.Generator().manual_seed(7)
    assert _close(upd.shared, [u + 0.5 * torch.randn(u.shape, generator=gen) for u in plain])
    for p, q in zip(upd.model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_unknown_defense_lists_known_names(digits):
    model = lb.build("mlp:16", input_shape=digits.shape, classes=10, seed=0)
    x, y = digits.batch(2, seed=0)
    with pytest.raises(ConfigError) as info:
        observe(model, x, y, defense="shield:3")
    msg = str(info.value)
    assert "unknown defense 'shield'" in msg
    assert "Known defenses: " + ", ".join(DEFENSES.names()) in msg
