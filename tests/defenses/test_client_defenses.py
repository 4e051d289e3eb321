"""Defenses in the client's computation (dpsgd, local, secagg, dropout), against independent computations."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import PRVAccountant, RDPAccountant

import leakbench as lb
from leakbench.defenses import DPSGD, epsilon, parse
from leakbench.defenses.pipeline import other_batches
from leakbench.errors import ConfigError
from leakbench.threat import observe


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    return lb.load("digits")


@pytest.fixture(scope="module")
def mlp(data):
    return lb.build("mlp:16", input_shape=data.shape, classes=10, seed=0)


def _close(a, b, rtol=1e-5, atol=1e-6):
    return len(a) == len(b) and all(torch.allclose(u, v, rtol=rtol, atol=atol) for u, v in zip(a, b))


def _sample_grads_by_loop(model, x, y):
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(x.shape[0]):
        out.append(torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params))
    return out


# --------------------------------------------------------------------------- DP-SGD


@pytest.mark.parametrize("spec,opts", [("mlp:16", {}), ("cnn:3-4-1-0,3-4-2-1", {"act": "tanh"}), ("lenet", {})])
@pytest.mark.parametrize("C", [0.05, 1.0, 100.0])
def test_dpsgd_per_sample_clipping_equals_a_per_sample_loop(spec, opts, C, data):
    model = lb.build(spec, input_shape=data.shape, classes=10, seed=1, **opts)
    x, y = data.batch(6, seed=2)
    obs = observe(model, x, y, defense=f"dpsgd:{C},0")
    per_sample = _sample_grads_by_loop(model, x, y)
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for grads in per_sample:
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        factor = min(1.0, C / norm)
        for e, g in zip(expected, grads):
            e += factor * g
    expected = [e / x.shape[0] for e in expected]
    assert _close(obs.shared, expected, rtol=1e-4, atol=1e-7)
    if C == 100.0:  # no sample clipped: the plain mean gradient
        assert _close(obs.shared, observe(model, x, y).shared, rtol=1e-4, atol=1e-7)


def test_dpsgd_noise_has_std_sigma_C_on_the_sum(mlp, data):
    x, y = data.batch(8, seed=0)
    C, sigma, B = 0.5, 2.0, 8
    clean = observe(mlp, x, y, defense=f"dpsgd:{C},0").shared
    diffs = []
    for seed in range(4):
        noisy = observe(mlp, x, y, defense=f"dpsgd:{C},{sigma}", seed=seed).shared
        diffs.append(torch.cat([(n - c).reshape(-1) for n, c in zip(noisy, clean)]) * B)  # noise on the sum
    diff = torch.cat(diffs)
    assert float(diff.std()) == pytest.approx(sigma * C, rel=0.03)
    obs = observe(mlp, x, y, defense=f"dpsgd:{C},{sigma}")
    info = obs.extras["defense"]["dpsgd"]
    assert info["max_norm"] == C and info["noise_multiplier"] == sigma and info["sum_noise_std"] == sigma * C


@pytest.mark.parametrize("sigma,q,steps,delta", [(1.1, 0.01, 1, 1e-5), (1.0, 0.004, 1000, 1e-5), (0.8, 0.1, 50, 1e-6)])
def test_dpsgd_epsilon_equals_opacus_rdp_accountant(sigma, q, steps, delta):
    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    expected = acc.get_epsilon(delta=delta)
    assert epsilon(sigma, q, steps, delta=delta) == expected
    d = parse(f"dpsgd:1,{sigma},{q},{steps},{delta}")
    assert isinstance(d, DPSGD) and d.epsilon() == expected
    assert parse(f"dpsgd:1,{sigma}").epsilon(sample_rate=q, steps=steps, delta=delta) == expected


def test_dpsgd_epsilon_equals_opacus_prv_accountant():
    acc = PRVAccountant()
    for _ in range(200):
        acc.step(noise_multiplier=1.0, sample_rate=0.02)
    assert epsilon(1.0, 0.02, 200, delta=1e-5, accountant="prv") == acc.get_epsilon(delta=1e-5)
    assert parse("dpsgd:1,1,0.02,200,1e-5,prv").epsilon() == acc.get_epsilon(delta=1e-5)


def test_dpsgd_epsilon_falls_with_noise_and_grows_with_steps():
    eps = [epsilon(s, 0.01, 100) for s in (0.6, 1.0, 1.5, 2.0)]
    assert all(a > b for a, b in zip(eps, eps[1:]))
    eps = [epsilon(1.0, 0.01, t) for t in (1, 10, 100, 1000)]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    assert epsilon(0.0, 0.01, 10) == math.inf and epsilon(1.0, 0.01, 0) == 0.0


def test_dpsgd_rejects_batch_norm_in_training_mode():
    data16 = lb.load("digits", size=16)
    model = lb.build("convnet-4", input_shape=data16.shape, classes=10, seed=0)
    x, y = data16.batch(2, seed=0)
    with pytest.raises(ConfigError, match="batch-norm in training mode"):
        observe(model, x, y, train=True, defense="dpsgd:1,1")
    assert observe(model, x, y, train=False, defense="dpsgd:1,0").kind == "gradient"  # running statistics: fine


# --------------------------------------------------------------------------- local aggregation


def _sgd_by_hand(model, x, y, *, steps, lr):
    m = copy.deepcopy(model)
    start = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return [p.detach() - s for p, s in zip(m.parameters(), start)]


@pytest.mark.parametrize("k,lr", [(1, 0.5), (3, 0.1), (5, 0.05)])
def test_local_aggregation_equals_k_explicit_sgd_steps(k, lr, mlp, data):
    x, y = data.batch(5, seed=1)
    obs = observe(mlp, x, y, defense=f"local:{k},{lr}")
    assert obs.kind == "update" and obs.local_steps == k and obs.local_lr == lr
    assert _close(obs.shared, _sgd_by_hand(mlp, x, y, steps=k, lr=lr))
    assert obs.extras["defense"]["local"] == {"spec": obs.defense, "local_steps": k, "local_lr": lr}
    # the same as observe's own local_steps option, and the attacker's model holds θ_0
    assert _close(obs.shared, observe(mlp, x, y, local_steps=k, local_lr=lr).shared, rtol=0, atol=0)
    assert all(torch.equal(p, q) for p, q in zip(obs.model.parameters(), mlp.parameters()))


def test_local_with_dpsgd_noises_every_step(mlp, data):
    x, y = data.batch(4, seed=1)
    plain = observe(mlp, x, y, defense="local:3,0.1+dpsgd:100,0").shared  # C large, no noise: plain SGD
    assert _close(plain, _sgd_by_hand(mlp, x, y, steps=3, lr=0.1), rtol=1e-4, atol=1e-6)
    noisy = observe(mlp, x, y, defense="local:3,0.1+dpsgd:100,1", seed=0).shared
    diff = torch.cat([(a - b).reshape(-1) for a, b in zip(noisy, plain)])
    # three steps of lr·N(0, (σC)²)/B noise: std ≈ lr·σC·√3/B up to the drift the noise causes
    assert float(diff.std()) == pytest.approx(0.1 * 100 * math.sqrt(3) / 4, rel=0.15)


def test_local_steps_given_twice_is_an_error(mlp, data):
    x, y = data.batch(2, seed=0)
    with pytest.raises(ConfigError, match="give the local steps once"):
        observe(mlp, x, y, local_steps=2, defense="local:3,0.1")
    with pytest.raises(ConfigError, match="expected one local-aggregation defense, got a second 'local:2'"):
        observe(mlp, x, y, defense="local:3,0.1+local:2")


# --------------------------------------------------------------------------- secure aggregation


@pytest.mark.parametrize("L", [2, 4])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("local", [0, 2])
def test_secagg_equals_the_aggregate_of_independent_clients(L, reduce, local, mlp, data):
    x, y = data.batch(3, seed=0)
    spec = f"secagg:{L},{reduce}" + (f"+local:{local},0.1" if local else "")
    obs = observe(mlp, x, y, defense=spec, population=data, labels_known=True, seed=11)
    # the other clients' batches: the same draws from a generator seeded alike (nothing random precedes them)
    others = other_batches(data, L - 1, 3, like_x=x, like_y=y, generator=torch.Generator().manual_seed(11))
    outs = [observe(mlp, bx, by, local_steps=local, local_lr=0.1).shared for bx, by in [(x, y), *others]]
    total = [sum(o[i] for o in outs) for i in range(len(outs[0]))]
    expected = total if reduce == "sum" else [t / L for t in total]
    assert _close(obs.shared, expected)
    assert obs.batch_size == 3 * L and obs.extras["clients"] == L and obs.extras["client_batch_size"] == 3
    assert torch.equal(obs.labels, torch.cat([y, *[by for _, by in others]]))
    assert obs.kind == ("update" if local else "gradient")
    # disjoint batches from the population
    assert len({tuple(b.reshape(-1).tolist()) for bx, _ in others for b in bx}) == 3 * (L - 1)


def test_secagg_mean_of_gradients_is_the_gradient_of_the_union(mlp, data):
    pool = data.subset(list(range(40, 49)))  # exactly the 3 other clients' 9 samples
    x, y = data.batch(3, seed=0)
    obs = observe(mlp, x, y, defense="secagg:4,mean", population=pool)
    union_x = torch.cat([x, pool.images])
    union_y = torch.cat([y, pool.labels])
    assert _close(obs.shared, observe(mlp, union_x, union_y).shared)


def test_secagg_needs_a_population(mlp, data):
    x, y = data.batch(2, seed=0)
    with pytest.raises(ConfigError, match=r"defense secagg:3 needs the other clients' data: pass population="):
        observe(mlp, x, y, defense="secagg:3")
    with pytest.raises(ConfigError, match="at least 8 samples for 2 other clients of 4 samples"):
        observe(mlp, *data.batch(4, seed=0), defense="secagg:3", population=data.subset([0, 1, 2]))
    with pytest.raises(ConfigError, match="expected population as an ImageDataset"):
        observe(mlp, x, y, defense="secagg:3", population=[1, 2, 3])
    with pytest.raises(ConfigError, match="expected at most one aggregation defense"):
        observe(mlp, x, y, defense="secagg:2+secagg:2", population=data)
    # a population given to the defense itself
    from leakbench.defenses import SecureAggregation
    obs = observe(mlp, x, y, defense=SecureAggregation(2, population=data))
    assert obs.batch_size == 4


def test_shared_defenses_before_secagg_act_per_client_after_it_on_the_aggregate(mlp, data):
    x, y = data.batch(2, seed=0)
    L, sigma = 4, 0.3
    clean = observe(mlp, x, y, defense=f"secagg:{L}", population=data, seed=0).shared
    per_client = observe(mlp, x, y, defense=f"noise:{sigma}+secagg:{L}", population=data, seed=0).shared
    on_sum = observe(mlp, x, y, defense=f"secagg:{L}+noise:{sigma}", population=data, seed=0).shared
    std = lambda s: float(torch.cat([(a - b).reshape(-1) for a, b in zip(s, clean)]).std())  # noqa: E731
    assert std(on_sum) == pytest.approx(sigma, rel=0.08)
    assert std(per_client) == pytest.approx(sigma * math.sqrt(L), rel=0.08)  # sum of L independent noises
    mean_clean = observe(mlp, x, y, defense=f"secagg:{L},mean", population=data, seed=0).shared
    per_client_mean = observe(mlp, x, y, defense=f"noise:{sigma}+secagg:{L},mean", population=data, seed=0).shared
    std_mean = float(torch.cat([(a - b).reshape(-1) for a, b in zip(per_client_mean, mean_clean)]).std())
    assert std_mean == pytest.approx(sigma / math.sqrt(L), rel=0.08)  # mean of L independent noises


# --------------------------------------------------------------------------- dropout


def test_dropout_equals_a_forward_with_the_seeded_masks(mlp, data):
    x, y = data.batch(5, seed=0)
    p = 0.4
    obs = observe(mlp, x, y, defense=f"dropout:{p}", seed=7)
    # by hand: the hidden activations (input of the last Linear) masked with the same draws, kept ones ×1/(1−p)
    gen = torch.Generator().manual_seed(7)
    m = copy.deepcopy(mlp)
    layers = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
    assert len(layers) == 2
    seen = []
    handle = layers[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    m(x)
    handle.remove()
    hidden = seen[0]
    assert hidden.shape == (5, 16)
    mask = (torch.rand(hidden.shape, generator=gen) >= p).float()
    out = layers[1](hidden * mask / (1 - p))
    expected = torch.autograd.grad(F.cross_entropy(out, y), list(m.parameters()))
    assert _close(obs.shared, list(expected))
    # a dropped unit has a zero column in the last layer's weight gradient for a single sample
    one = observe(mlp, x[:1], y[:1], defense="dropout:0.5", seed=3)
    w = one.shared[-2]
    zero_cols = int((w.abs().sum(0) == 0).sum())
    assert 0 < zero_cols < 16
    assert observe(mlp, x, y, defense="dropout:0").shared[0].equal(observe(mlp, x, y).shared[0])


def test_dropout_rate_over_many_units(data):
    model = lb.build("mlp:400", input_shape=data.shape, classes=10, seed=0)
    x, y = data.batch(1, seed=0)
    plain = observe(model, x, y).shared[-2]
    live = int((plain.abs().sum(0) != 0).sum())  # ReLU units active for this sample
    zero = []
    for seed in range(5):
        w = observe(model, x, y, defense="dropout:0.3", seed=seed).shared[-2]
        zero.append(int(((w.abs().sum(0) == 0) & (plain.abs().sum(0) != 0)).sum()) / live)
    assert sum(zero) / len(zero) == pytest.approx(0.3, abs=0.05)


def test_dropout_needs_a_hidden_layer(data):
    linear = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    x, y = data.batch(2, seed=0)
    with pytest.raises(ConfigError, match="dropout needs a model with a hidden layer"):
        observe(linear, x, y, defense="dropout:0.5")
    with pytest.raises(ConfigError, match=r"expected the drop probability p in \[0, 1\) for defense 'dropout'"):
        parse("dropout:1")


def test_dropout_with_dpsgd_draws_a_mask_per_sample(mlp, data):
    x, y = data.batch(4, seed=0)
    a = observe(mlp, x, y, defense="dropout:0.5+dpsgd:100,0", seed=1).shared
    b = observe(mlp, x, y, defense="dropout:0.5+dpsgd:100,0", seed=1).shared
    assert _close(a, b, rtol=0, atol=0)
    assert not _close(a, observe(mlp, x, y, defense="dpsgd:100,0").shared)


# --------------------------------------------------------------------------- specs and the observation


@pytest.mark.parametrize("spec,match", [
    ("dpsgd:1", "defense 'dpsgd' needs sigma"),
    ("dpsgd:0,1", "expected the per-sample norm bound C > 0 for defense 'dpsgd'"),
    ("dpsgd:1,-1", "expected the noise multiplier σ ≥ 0"),
    ("dpsgd:1,1,0", r"expected sample_rate in \(0, 1\]"),
    ("dpsgd:1,1,0.01,0", "expected steps ≥ 1"),
    ("dpsgd:1,1,0.01,10,2", r"expected delta in \(0, 1\)"),
    ("dpsgd:1,1,0.01,10,1e-5,moments", "expected accountant in"),
    ("local:0", "expected the number of local steps k ≥ 1"),
    ("local:2.5", "expected a number for k of defense 'local', got '2.5'"),
    ("local:2,0", "expected the local learning rate lr > 0"),
    ("secagg:0", "expected the number of clients L ≥ 1"),
    ("secagg:2,avg", r"expected reduce in \('mean', 'sum'\)"),
    ("dropout:-0.5", "expected the drop probability p"),
])
def test_bad_client_specs(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse(spec)


def test_client_defenses_cannot_be_applied_to_given_gradients():
    grads = [torch.ones(3)]
    for spec in ["dpsgd:1,1", "local:2", "secagg:2", "dropout:0.5", "clip:1+local:2"]:
        with pytest.raises(ConfigError, match="acts inside the client's computation"):
            parse(spec)(grads)
    assert torch.equal(parse("clip:1+noise:0")(grads)[0], torch.ones(3) / math.sqrt(3))


def test_two_gradient_replacements_are_an_error(mlp, data):
    x, y = data.batch(2, seed=0)
    with pytest.raises(ConfigError, match="one defense that replaces the client's gradient"):
        observe(mlp, x, y, defense="dpsgd:1,1+dpsgd:2,1")


def test_client_specs_round_trip():
    for spec in ["dpsgd:1,1.1", "dpsgd:1,1.1,0.004,1000", "dpsgd:2,0.5,0.01,1,1e-06,prv", "local:3",
                 "local:5,0.05", "secagg:4", "secagg:4,mean", "dropout:0.5", "local:3+prune:0.9+secagg:2+noise:0.01"]:
        assert parse(spec).spec == spec
        assert parse(parse(spec).spec).spec == spec
    assert parse("local:3,0.1").spec == "local:3"
    assert parse("dpsgd:1,1.1,0.01,1,1e-5,rdp").spec == "dpsgd:1,1.1"


def test_every_defense_is_seeded_through_observe(mlp, data):
    x, y = data.batch(4, seed=0)
    spec = "dropout:0.3+dpsgd:1,0.5+graddrop:0.2+secagg:2+noise:0.01"
    a = observe(mlp, x, y, defense=spec, population=data, seed=3).shared
    b = observe(mlp, x, y, defense=spec, population=data, seed=3).shared
    c = observe(mlp, x, y, defense=spec, population=data, seed=4).shared
    assert _close(a, b, rtol=0, atol=0) and not _close(a, c)
