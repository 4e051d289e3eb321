"""Initialisation schemes: their distributions, seeding and the global RNG."""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from torch import nn

from leakbench.errors import ConfigError
from leakbench.models import INITS, build, initialize, weighted_layers


pytestmark = pytest.mark.usefixtures("one_thread")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().flatten()


def test_small_init_first_layer_std_is_1e4_and_rest_kaiming():
    # Haim et al. (2022): d-1000-1000-1, first layer N(0, 1e-4²), the rest Kaiming.
    model = build("mlp:1000-1000", (784,), 1, init="small", seed=0)
    first, second, last = weighted_layers(model)
    assert _flat(first.weight).std().item() == pytest.approx(1e-4, rel=0.1)
    assert _flat(first.weight).mean().abs().item() < 1e-6
    assert _flat(second.weight).std().item() == pytest.approx(math.sqrt(2 / 1000), rel=0.05)
    assert _flat(last.weight).std().item() == pytest.approx(math.sqrt(2 / 1000), rel=0.15)
    assert all(torch.count_nonzero(l.bias) == 0 for l in (first, second, last))
    assert stats.kstest(_flat(first.weight).numpy() / 1e-4, "norm").pvalue > 1e-3


def test_small_init_scale_option():
    model = build("twolayer:500", (100,), 1, init="small", init_scale=1e-3, seed=1)
    assert _flat(model.first.weight).std().item() == pytest.approx(1e-3, rel=0.1)
    assert model.build_options["init_scale"] == 1e-3


def test_dlg_init_is_uniform_half_on_weights_and_biases():
    model = build("lenet", (3, 32, 32), 10, seed=0)  # default init of lenet is "dlg"
    values = torch.cat([_flat(p) for p in model.parameters()])
    assert values.min() >= -0.5 and values.max() <= 0.5
    assert values.min() < -0.49 and values.max() > 0.49
    assert stats.kstest(values.numpy(), "uniform", args=(-0.5, 1.0)).pvalue > 1e-3
    biases = torch.cat([_flat(m.bias) for m in weighted_layers(model)])
    assert biases.abs().max() > 0.3  # biases are drawn too, as in the DLG code


def test_gaussian_twolayer_follows_liu_et_al():
    # Liu et al. (2024), Assumption B.2: w_j ~ N(0, I_d), a_j ~ N(0, 1/m²).
    m = 2000
    model = build(f"twolayer:{m}", (50,), 1, init="gaussian", seed=0)
    w, a = _flat(model.first.weight), _flat(model.second.weight)
    assert w.std().item() == pytest.approx(1.0, rel=0.02)
    assert abs(w.mean().item()) < 0.01
    assert stats.kstest(w.numpy(), "norm").pvalue > 1e-3
    assert a.std().item() == pytest.approx(1 / m, rel=0.1)
    assert torch.count_nonzero(model.first.bias) == 0


def test_gaussian_deep_nets_use_one_over_fan_in():
    model = build("cnn:3-64-1-0", (16, 12, 12), 10, init="gaussian", seed=0)
    conv, fc = weighted_layers(model)
    assert _flat(conv.weight).std().item() == pytest.approx(1 / math.sqrt(16 * 9), rel=0.05)
    assert _flat(fc.weight).std().item() == pytest.approx(1 / math.sqrt(fc.in_features), rel=0.05)


@pytest.mark.parametrize("scheme", ["pytorch", "uniform"])
def test_uniform_schemes_draw_within_one_over_sqrt_fan_in(scheme):
    model = build("mlp:400", (300,), 200, init=scheme, seed=0)
    for layer in weighted_layers(model):
        bound = 1 / math.sqrt(layer.in_features)
        w = _flat(layer.weight)
        assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
        assert stats.kstest(w.numpy(), "uniform", args=(-bound, 2 * bound)).pvalue > 1e-3
        assert _flat(layer.bias).abs().max() <= bound


def test_pytorch_scheme_matches_torch_layer_defaults():
    ours = _flat(build("mlp", (256,), 512, init="pytorch", seed=0).fc.weight)
    torchs = _flat(nn.Linear(256, 512).weight)
    assert stats.ks_2samp(ours.numpy(), torchs.numpy()).pvalue > 1e-3


def test_uniform_init_scale_sets_the_bound():
    model = build("mlp:50", (40,), 3, init="uniform", init_scale=0.05, seed=0)
    values = torch.cat([_flat(p) for p in model.parameters()])
    assert values.abs().max() <= 0.05 and values.abs().max() > 0.049


def test_default_init_is_the_family_default():
    assert build("lenet", (1, 8, 8), 2).init == "dlg"
    assert build("mlp:3", (2,), 2).init == "pytorch"
    assert build("lenet", (1, 8, 8), 2, init="pytorch").init == "pytorch"


def test_same_seed_same_parameters_different_seed_different():
    for spec, options in (("lenet", {}), ("convnet-2", {}), ("twolayer:20", {"init": "gaussian"}), ("mlp:10", {"init": "small"})):
        shape = (3, 16, 16) if spec in ("lenet", "convnet-2") else (6,)
        a = build(spec, shape, 4, seed=5, **options).state_dict()
        b = build(spec, shape, 4, seed=5, **options).state_dict()
        c = build(spec, shape, 4, seed=6, **options).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_building_never_touches_the_global_rng():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    build("resnet18", (3, 8, 8), 10, width=2, seed=0)
    build("convnet-2", (3, 16, 16), 10)  # seed=None draws its own seed
    build("mlp:10", (4,), 2, init="small")
    assert torch.equal(torch.get_rng_state(), state)


def test_seed_none_is_recorded_and_reproducible():
    model = build("mlp:7", (3,), 2)
    again = build(model.spec, model.input_shape, model.classes, **model.build_options)
    assert isinstance(model.seed, int)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_initialize_resets_batchnorm_and_reseeds_in_place():
    model = build("convnet-2", (3, 16, 16), 4, seed=0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.fill_(3.0)
                m.running_mean.fill_(1.0)
    before = [p.clone() for p in model.parameters()]
    initialize(model, "gaussian", seed=9)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(torch.all(m.weight == 1) and torch.all(m.bias == 0) and torch.all(m.running_mean == 0) for m in bns)
    assert not torch.equal(before[0], model.conv0.weight)
    again = build("convnet-2", (3, 16, 16), 4, init="gaussian", seed=9)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_float64_models_are_initialised_in_float64():
    model = build("twolayer:10", (4,), 1, init="gaussian", seed=0, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert model(torch.zeros(2, 4, dtype=torch.float64)).dtype == torch.float64


def test_bad_init_names_and_scales():
    with pytest.raises(ConfigError) as err:
        build("mlp", (3,), 2, init="xavier")
    for name in ("default", *INITS.names()):
        assert name in str(err.value)
    with pytest.raises(ConfigError, match="init_scale"):
        build("mlp", (3,), 2, init="dlg", init_scale=0.1)
    with pytest.raises(ConfigError, match="positive number for init_scale"):
        build("mlp", (3,), 2, init="small", init_scale=-1.0)
    with pytest.raises(ConfigError, match="seed"):
        build("mlp", (3,), 2, seed="zero")
