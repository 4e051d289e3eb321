"""PRECODE (Scheliga et al. 2022): the bottleneck's forward and KL, its insertion, fresh ε per round, bad specs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.defenses import extend_model, parse, share
from leakbench.defenses.precode import (
    PrecodeBottleneck,
    find_head,
    insert_bottleneck,
    kl_to_standard,
    precode_gradient,
    split_statistics,
)
from leakbench.errors import ConfigError
from leakbench.evaluation.training.seeds import seeds_refusal
from leakbench.evaluation.training.utility import train_model
from leakbench.losses import get_loss


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 36, 12), nn.Tanh(),
                         nn.Linear(12, 5))


@pytest.fixture(scope="module")
def setting():
    model = insert_bottleneck(_model(), 4, _gen(7))
    x = torch.rand(3, 1, 6, 6, generator=_gen(1))
    y = torch.tensor([0, 3, 4])
    params = {n: p.detach() for n, p in model.named_parameters()}
    return model, params, x, y, get_loss("ce")


def test_bottleneck_shapes_and_kl_against_torch_distributions():
    neck = PrecodeBottleneck(12, 4, generator=_gen())
    h = torch.randn(5, 12, generator=_gen(2))
    mu, logvar = neck.statistics(h)
    assert mu.shape == logvar.shape == (5, 4) and neck(h).shape == (5, 12)
    q = torch.distributions.Normal(mu, (0.5 * logvar).exp())
    p = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
    direct = torch.distributions.kl_divergence(q, p).sum(-1)
    assert torch.allclose(kl_to_standard(mu, logvar), direct, atol=1e-6)
    assert torch.allclose(neck(h), neck.decoder(mu))  # no noise source: the mean (inference)


def test_the_bottleneck_samples_z_by_reparameterisation_from_the_generator():
    neck = PrecodeBottleneck(12, 4, generator=_gen())
    h = torch.randn(5, 12, generator=_gen(2))
    mu, logvar = neck.statistics(h)
    eps = torch.randn(mu.shape, generator=_gen(9))
    neck.noise = _gen(9)
    assert torch.allclose(neck(h), neck.decoder(mu + (0.5 * logvar).exp() * eps), atol=1e-6)


def test_insertion_before_the_output_layer_is_seeded_idempotent_and_checked():
    a, b = insert_bottleneck(_model(), 4, _gen(3)), insert_bottleneck(_model(), 4, _gen(3))
    names = [n for n, _ in a.named_parameters()]
    assert names[-6:] == ["5.bottleneck.encoder.weight", "5.bottleneck.encoder.bias", "5.bottleneck.decoder.weight",
                          "5.bottleneck.decoder.bias", "5.output.weight", "5.output.bias"]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert insert_bottleneck(a, 4, _gen(5)) is a and len(list(a.parameters())) == len(names)
    with pytest.raises(ConfigError, match="width 4"):
        insert_bottleneck(a, 8, _gen())
    with pytest.raises(ConfigError, match="output layer"):
        insert_bottleneck(nn.Linear(3, 2), 4, _gen())
    assert extend_model("noise:0.1", _model(), seed=0) is not None and find_head(extend_model("none", _model())) is None


def test_the_gradient_is_the_loss_plus_beta_kl_at_the_drawn_eps(setting):
    model, params, x, y, loss_fn = setting
    neck = find_head(model)[1].bottleneck
    got = precode_gradient(model, params, x, y, loss_fn, _gen(4), beta=0.1)
    live = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    feats = []
    hook = neck.register_forward_pre_hook(lambda _m, a: feats.append(a[0]))
    torch.func.functional_call(model, live, (x,))
    hook.remove()
    enc = torch.nn.functional.linear(feats[0], live["5.bottleneck.encoder.weight"], live["5.bottleneck.encoder.bias"])
    mu, logvar = split_statistics(enc, 4)
    z = mu + (0.5 * logvar).exp() * torch.randn(mu.shape, generator=_gen(4))
    dec = torch.nn.functional.linear(z, live["5.bottleneck.decoder.weight"], live["5.bottleneck.decoder.bias"])
    out = torch.nn.functional.linear(dec, live["5.output.weight"], live["5.output.bias"])
    loss = loss_fn(out, y) + 0.1 * (0.5 * (mu ** 2 + logvar.exp() - logvar - 1).sum(1)).mean()
    want = torch.autograd.grad(loss, list(live.values()))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


def test_the_kl_part_scales_with_beta_and_eps_is_fresh_per_round(setting):
    model, params, x, y, loss_fn = setting
    g0, g1, g2 = (precode_gradient(model, params, x, y, loss_fn, _gen(4), beta=b) for b in (0.0, 0.1, 0.2))
    for a, b, c in zip(g0, g1, g2):
        assert torch.allclose(c - a, 2 * (b - a), atol=1e-6)
    same = share("precode:4", model, params, x, y, loss_fn, generator=_gen(4)).tensors
    other = share("precode:4", model, params, x, y, loss_fn, generator=_gen(5)).tensors
    assert all(torch.equal(a, b) for a, b in zip(same, precode_gradient(model, params, x, y, loss_fn, _gen(4),
                                                                        beta=1e-3)))
    assert not torch.allclose(same[0], other[0])  # ε differs: even the first layer's gradient moves


def test_observe_extends_client_and_attacker_and_records_the_defense():
    data = lb.load("digits")
    model = lb.build("cnn:3-8-1-1,3-8-2-1", input_shape=data.shape, classes=10, act="tanh", seed=0)
    x, y = data.batch(2, seed=0)
    obs = lb.observe(model, x, y, defense="precode:16,0.01", seed=0)
    assert find_head(model) is None  # the user's model is not modified
    assert "fc.bottleneck.encoder.weight" in obs.param_names and find_head(obs.model) is not None
    assert obs.extras["defense"]["precode"] == {"spec": "precode:16,0.01", "latent": 16, "beta": 0.01,
                                                "layer": parse("precode").describe()["layer"]}


def test_utility_training_inserts_and_trains_the_bottleneck_one_seed_after_the_other():
    data = lb.load("digits").subset(list(range(64)))
    model = lb.build("mlp:16", input_shape=data.shape, classes=10, seed=0)
    run = train_model(model, data, defense="precode:8", epochs=1, batch_size=16, seed=0)
    assert find_head(model) is not None and all(torch.isfinite(torch.tensor(run.losses)))
    assert "precode" in seeds_refusal(parse("precode:8"), model)


@pytest.mark.parametrize("spec, field", [("precode:0", "latent width k"), ("precode:1.5", "k"),
                                         ("precode:100000", "latent width k"), ("precode:8,-1", "KL weight beta")])
def test_bad_specs_are_one_line_errors_naming_the_field(spec, field):
    with pytest.raises(ConfigError) as err:
        parse(spec)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_a_model_without_its_bottleneck_is_refused_in_the_round(setting):
    _, _, x, y, loss_fn = setting
    plain = _model()
    with pytest.raises(ConfigError, match="bottleneck"):
        share("precode:4", plain, {n: p.detach() for n, p in plain.named_parameters()}, x, y, loss_fn, generator=_gen())
