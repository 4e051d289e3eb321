"""Spec parsing, build options, round trips, errors and summaries."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from leakbench.errors import ConfigError
from leakbench.models import (
    ACTIVATIONS,
    MODELS,
    ConvLayerSpec,
    activation,
    build,
    canonical_spec,
    count_parameters,
    describe,
    parse_spec,
)


pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.mark.parametrize(
    "spec,family,args",
    [
        ("mlp", "mlp", ()),
        ("mlp:", "mlp", ()),
        ("mlp:1000-1000", "mlp", (1000, 1000)),
        (" MLP : 10 - 20 ", "mlp", (10, 20)),
        ("cnn:3-6-1-0,4-3-2-0", "cnn", (ConvLayerSpec(3, 6, 1, 0), ConvLayerSpec(4, 3, 2, 0))),
        ("cnn: 5-32-1-2", "cnn", (ConvLayerSpec(5, 32, 1, 2),)),
        ("lenet", "lenet", ()),
        ("convnet", "convnet", (32,)),
        ("convnet-64", "convnet", (64,)),
        ("convnet:16", "convnet", (16,)),
        ("resnet18", "resnet18", ()),
        ("twolayer:1000", "twolayer", (1000,)),
    ],
)
def test_parse_spec(spec, family, args):
    assert parse_spec(spec) == (family, args)


@pytest.mark.parametrize(
    "spec,canonical",
    [("mlp:", "mlp"), (" MLP:10-20", "mlp:10-20"), ("convnet", "convnet-32"), ("CNN:3-6-1-0", "cnn:3-6-1-0")],
)
def test_canonical_spec(spec, canonical):
    assert canonical_spec(spec) == canonical


@pytest.mark.parametrize(
    "spec,fragments",
    [
        ("cnn:3-6-1", ["'cnn:3-6-1'", "expected kernel-channels-stride-padding like 3-6-1-0", "got '3-6-1'", "layer 1"]),
        ("cnn:3-6-1-0,4-3-x-0", ["expected kernel-channels-stride-padding", "got '4-3-x-0'", "layer 2"]),
        ("cnn:3-0-1-0", ["channels ≥ 1", "got '3-0-1-0'"]),
        ("cnn:3-6-0-0", ["stride ≥ 1"]),
        ("cnn", ["'cnn'", "like cnn:3-6-1-0,4-3-2-0"]),
        ("mlp:100-x", ["'mlp:100-x'", "hidden widths", "width 2: 'x'"]),
        ("mlp:100-0", ["width 2: '0'"]),
        ("twolayer", ["'twolayer'", "twolayer:1000"]),
        ("twolayer:-3", ["twolayer:1000", "got '-3'"]),
        ("lenet:5", ["'lenet' with no arguments", "got 'lenet:5'"]),
        ("resnet18:2", ["'resnet18' with no arguments"]),
        ("convnet-x", ["unknown model 'convnet-x'"]),
        ("convnet:0", ["positive width like convnet-32"]),
    ],
)
def test_bad_specs_name_the_spec_and_what_was_expected(spec, fragments):
    with pytest.raises(ConfigError) as err:
        parse_spec(spec)
    for fragment in fragments:
        assert fragment in str(err.value)
    with pytest.raises(ConfigError):
        build(spec, (3, 32, 32), 10)


def test_unknown_family_lists_the_registered_families():
    with pytest.raises(ConfigError) as err:
        build("vgg16:3", (3, 32, 32), 10)
    message = str(err.value)
    assert "'vgg16:3'" in message and "unknown model 'vgg16'" in message
    for name in MODELS.names():
        assert name in message
    assert set(MODELS.names()) == {"mlp", "cnn", "lenet", "convnet", "resnet18", "twolayer", "gpt", "bert"}


@pytest.mark.parametrize("spec", [None, 3, "", "   "])
def test_non_specs_are_config_errors(spec):
    with pytest.raises(ConfigError, match="model spec"):
        parse_spec(spec)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"input_shape": (0, 4, 4)}, "input_shape"),
        ({"input_shape": "3x32x32"}, "input_shape"),
        ({"input_shape": None}, "needs input_shape and classes"),
        ({"classes": 0}, "classes"),
        ({"classes": True}, "classes"),
        ({"classes": 2.0}, "classes"),
        ({"act": "gelu"}, "known activations: identity, leaky-relu, relu, sigmoid, tanh"),
        ({"act": "tanh", "negative_slope": 0.1}, "negative_slope only applies"),
        ({"bias": {"conv": False, "fc": True}}, "field bias"),
        ({"bias": "yes"}, "field bias"),
        ({"width": 8}, "unknown option width for model 'mlp:4'"),
        ({"dtype": torch.int64}, "floating torch dtype"),
        ({"device": "gpu:7"}, "torch device"),
    ],
)
def test_bad_options_are_config_errors(kwargs, fragment):
    args = {"input_shape": (3,), "classes": 2, **kwargs}
    with pytest.raises(ConfigError) as err:
        build("mlp:4", **args)
    assert fragment in str(err.value)


def test_family_options_are_checked():
    with pytest.raises(ConfigError, match="expected True or False for norm"):
        build("convnet-2", (3, 16, 16), 2, norm="no")
    with pytest.raises(ConfigError, match="positive integer for width"):
        build("resnet18", (3, 16, 16), 2, width=0)
    with pytest.raises(ConfigError, match="options of convnet: norm, negative_slope, init_scale"):
        build("convnet-2", (3, 16, 16), 2, width=4)


ROUND_TRIP = [
    ("mlp:12-6", (2, 5, 5), {"act": "tanh", "bias": False}),
    ("mlp", (7,), {}),
    ("cnn:3-4-1-0,2-3-2-1", (3, 11, 13), {"bias": {"conv": False, "linear": True}, "act": "leaky-relu", "negative_slope": 0.1}),
    ("lenet", (1, 12, 12), {}),
    ("convnet-2", (3, 16, 16), {"norm": False}),
    ("resnet18", (3, 8, 8), {"width": 2}),
    ("twolayer:9", (4,), {"init": "small", "init_scale": 1e-3, "bias": False}),
]


@pytest.mark.parametrize("spec,shape,options", ROUND_TRIP, ids=[c[0] for c in ROUND_TRIP])
def test_spec_round_trip_rebuilds_the_same_model(spec, shape, options):
    model = build(spec, shape, 3, seed=11, **options)
    assert (model.input_shape, model.classes) == (shape, 3)
    assert parse_spec(model.spec)[0] == model.family
    rebuilt = build(model.spec, model.input_shape, model.classes, **model.build_options)
    assert type(rebuilt) is type(model) and rebuilt.spec == model.spec
    a, b = model.state_dict(), rebuilt.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = build(model.spec, shape, 3, **{**model.build_options, "seed": 12})
    assert [p.shape for p in other.parameters()] == [p.shape for p in model.parameters()]
    x = torch.rand(2, *shape, generator=torch.Generator().manual_seed(0))
    model.eval(), rebuilt.eval()
    torch.testing.assert_close(model(x), rebuilt(x))


def test_model_attributes():
    model = build("cnn:3-6-1-0", (3, 32, 32), 10, act="tanh", seed=1)
    assert model.spec == "cnn:3-6-1-0" and model.family == "cnn"
    assert model.input_shape == (3, 32, 32) and model.classes == 10
    assert model.act == "tanh" and model.init == "pytorch" and model.seed == 1
    assert build("cnn:3-6-1-0", [3, 32, 32], 10).input_shape == (3, 32, 32)


def test_registry_create_builds_from_parsed_arguments():
    model = MODELS.create("mlp", args=(4,), input_shape=(3,), classes=2, seed=0)
    assert model.spec == "mlp:4" and model(torch.zeros(1, 3)).shape == (1, 2)
    assert set(MODELS.describe()) == set(MODELS.names())


def test_modules_are_returned_as_is_on_the_requested_dtype():
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    out = build(net, (4,), 2, dtype=torch.float64)
    assert out is net and net[1].weight.dtype == torch.float64
    assert out.input_shape == (4,) and out.classes == 2
    with pytest.raises(ConfigError, match="act, seed apply to spec strings only"):
        build(net, (4,), 2, act="relu", seed=0)
    with pytest.raises(ConfigError, match="init"):
        build(net, init="small")


def test_activation_factory():
    assert isinstance(activation("relu"), nn.ReLU)
    assert activation("leaky-relu").negative_slope == 0.2
    assert activation("Leaky_ReLU", negative_slope=0.3).negative_slope == 0.3
    assert set(ACTIVATIONS.names()) == {"relu", "leaky-relu", "tanh", "sigmoid", "identity"}
    with pytest.raises(ConfigError, match="known activations"):
        activation("swish")


def test_describe_chains_shapes_and_counts_parameters():
    model = build("lenet", (3, 32, 32), 10)
    rows = describe(model)
    assert [r.name for r in rows] == ["conv1", "act1", "conv2", "act2", "conv3", "act3", "flatten", "fc"]
    assert rows[0].input_shape == (3, 32, 32) and rows[-1].output_shape == (10,)
    assert all(a.output_shape == b.input_shape for a, b in zip(rows, rows[1:]))
    assert sum(r.params for r in rows) == count_parameters(model) == 15826
    assert rows[-2].output_shape == (768,)


def test_describe_leaves_batchnorm_and_training_mode_alone():
    model = build("resnet18", (3, 8, 8), 5, width=2, seed=0)
    model.train()
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    rows = describe(model)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(stats[k], v) for k, v in model.state_dict().items())
    assert sum(r.params for r in rows) == count_parameters(model)
    assert rows[-1] == ("fc", "Linear", (16,), (5,), 16 * 5 + 5)
    with pytest.raises(ConfigError, match="needs input_shape"):
        describe(nn.Linear(3, 2))
    assert describe(nn.Linear(3, 2), (3,))[0].params == 8


def test_count_parameters_trainable_only():
    model = build("twolayer:5", (4,), 2)
    model.first.weight.requires_grad_(False)
    assert count_parameters(model) == 20 + 5 + 10
    assert count_parameters(model, trainable_only=True) == 15
