"""Architectures of the zoo: shapes, layer layouts and forward maps."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leakbench.errors import ConfigError
from leakbench.models import (
    ACTIVATIONS,
    CNN,
    ConvLayerSpec,
    TwoLayer,
    build,
    conv_output_size,
    count_parameters,
    describe,
)


pytestmark = pytest.mark.usefixtures("one_thread")


IMAGE_SHAPES = [(1, 8, 8), (3, 32, 32), (1, 28, 28)]

# (spec, family options, input shapes): thin widths keep the suite fast.
CASES = [
    ("mlp:16-8", {}, [(5,), *IMAGE_SHAPES]),
    ("mlp", {}, [(5,), (1, 8, 8)]),
    ("twolayer:12", {}, [(5,), (1, 8, 8)]),
    ("cnn:3-6-1-0,4-3-2-0", {}, IMAGE_SHAPES),
    ("cnn:5-16-1-0,5-6-2-0,5-32-1-2", {}, [(3, 32, 32), (1, 28, 28)]),
    ("lenet", {}, IMAGE_SHAPES),
    ("convnet-2", {}, [(3, 32, 32), (1, 28, 28), (2, 9, 9)]),
    ("convnet-2", {"norm": False}, [(3, 32, 32)]),
    ("resnet18", {"width": 2}, IMAGE_SHAPES),
    ("resnet18", {"width": 2, "norm": False}, [(1, 8, 8)]),
]
# every case with a scalar output (binary/theory nets) and with 10 classes, alternately
FORWARD_CASES = [
    (spec, options, shape, (1, 10)[i % 2])
    for i, (spec, options, shape) in enumerate((s, o, shape) for s, o, shapes in CASES for shape in shapes)
]


@pytest.mark.parametrize("spec,options,shape,classes", FORWARD_CASES, ids=lambda v: str(v))
def test_every_family_maps_a_batch_to_batch_by_classes(spec, options, shape, classes):
    model = build(spec, shape, classes, seed=0, **options)
    x = torch.rand(3, *shape, generator=torch.Generator().manual_seed(1))
    y = model(x)
    assert y.shape == (3, classes)
    assert torch.isfinite(y).all()
    y.square().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_every_family_is_exercised():
    from leakbench.models import MODELS

    text = {"gpt", "bert"}  # the text families: tests/models/test_transformers.py
    assert {spec.split(":")[0].split("-")[0] for spec, *_ in CASES} == set(MODELS.names()) - text
    assert {c for *_, c in FORWARD_CASES} == {1, 10}


def test_image_families_reject_vector_inputs():
    for spec in ("cnn:3-6-1-0", "lenet", "convnet", "resnet18"):
        with pytest.raises(ConfigError, match=r"input_shape \(C, H, W\)"):
            build(spec, (784,), 10)


def test_conv_output_size_equals_conv2d_on_odd_shapes():
    checked = 0
    for size, kernel, stride, padding in itertools.product((7, 9, 13, 31), (1, 2, 3, 4, 5), (1, 2, 3), (0, 1, 2)):
        if size + 2 * padding < kernel:
            continue
        x = torch.zeros(1, 1, size, size + 2)
        out = F.conv2d(x, torch.zeros(1, 1, kernel, kernel), stride=stride, padding=padding)
        assert out.shape[-2:] == (
            conv_output_size(size, kernel, stride, padding),
            conv_output_size(size + 2, kernel, stride, padding),
        ), (size, kernel, stride, padding)
        checked += 1
    assert checked > 150


@pytest.mark.parametrize(
    "spec,shape",
    [("cnn:4-5-3-1,3-2-2-0", (3, 31, 29)), ("cnn:2-3-2-0,3-4-3-2,5-2-1-1", (1, 17, 23)), ("cnn:1-7-2-0", (2, 9, 8))],
)
def test_cnn_feature_shapes_match_the_forward_pass_on_odd_sizes(spec, shape):
    model = build(spec, shape, 3, seed=0)
    convs = [row.output_shape for row in describe(model) if row.type == "Conv2d"]
    assert convs == model.feature_shapes
    c, h, w = model.feature_shapes[-1]
    assert model.fc.in_features == c * h * w


def test_cnn_rejects_layers_that_shrink_the_image_away():
    with pytest.raises(ConfigError, match=r"conv2 \(5-6-2-0\).*1×1"):
        build("cnn:5-6-2-0,5-6-2-0", (1, 8, 8), 10)


# Chen & Campbell (2022), Table 1: conv layers (k, c, s, p) and the width of the linear layer.
CHEN_CAMPBELL_TABLE_1 = {
    "cnn:3-6-1-0": 5400,
    "cnn:4-6-2-0": 1350,
    "cnn:3-6-1-0,4-3-2-0": 588,
    "cnn:4-6-2-0,3-3-2-0": 147,
    "cnn:3-6-1-0,3-9-1-0": 7056,
    "cnn:3-1-1-0,3-6-1-0": 4704,
    "cnn:3-6-1-0,4-5-2-0,4-3-1-0": 363,
    "cnn:5-16-1-0,5-6-2-0,5-32-1-2": 4608,
}


@pytest.mark.parametrize("spec,fc_width", CHEN_CAMPBELL_TABLE_1.items())
def test_cnn_variants_have_the_linear_widths_of_chen_campbell_table_1(spec, fc_width):
    model = build(spec, (3, 32, 32), 10, act="tanh", bias={"conv": False, "linear": True})
    assert model.fc.in_features == fc_width
    assert all(m.bias is None for m in model if isinstance(m, nn.Conv2d))
    assert model.fc.bias is not None
    assert sum(isinstance(m, nn.Tanh) for m in model) == spec.count(",") + 1


def test_lenet_is_the_lenet_of_dlg():
    model = build("lenet", (3, 32, 32), 10)
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (3, 12, (5, 5), (2, 2), (2, 2)),
        (12, 12, (5, 5), (2, 2), (2, 2)),
        (12, 12, (5, 5), (1, 1), (2, 2)),
    ]
    assert (model.fc.in_features, model.fc.out_features) == (768, 10)
    assert sum(isinstance(m, nn.Sigmoid) for m in model) == 3
    # 3·12·25+12 + 2·(12·12·25+12) + 768·10+10, as DLG's LeNet with 10 classes
    assert count_parameters(model) == 912 + 2 * 3612 + 7690 == 15826
    assert model.act == "sigmoid" and model.init == "dlg"


@pytest.mark.parametrize("width", [1, 4, 32])
def test_convnet_linear_layer_has_36_width_inputs_on_32x32(width):
    model = build(f"convnet-{width}", (3, 32, 32), 10)
    assert model.fc.in_features == 36 * width
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    assert [c.out_channels // width for c in convs] == [1, 2, 2, 4, 4, 4, 4, 4]
    assert all(c.kernel_size == (3, 3) and c.padding == (1, 1) for c in convs)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model) == 8
    assert sum(isinstance(m, nn.MaxPool2d) for m in model) == 2


def test_convnet_without_norm_has_no_batchnorm_and_needs_9x9():
    model = build("convnet-2", (3, 32, 32), 10, norm=False)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    with pytest.raises(ConfigError, match=r"too small for convnet.*pool1"):
        build("convnet-2", (1, 8, 8), 10)


def test_resnet18_standard_layout_and_parameter_count():
    model = build("resnet18", (3, 32, 32), 10)
    # The CIFAR ResNet-18 with 10 classes has 11,173,962 parameters.
    assert count_parameters(model) == 11_173_962
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 1 + 16 + 3  # stem, 8 blocks × 2, 3 projection shortcuts
    assert all(c.bias is None for c in convs)
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [2, 2, 2, 2]
    assert [getattr(model, f"layer{i}")[0].conv1.out_channels for i in range(1, 5)] == [64, 128, 256, 512]
    assert model.fc.in_features == 512


def test_thin_resnet18_scales_every_width():
    model = build("resnet18", (3, 32, 32), 10, width=4)
    assert [getattr(model, f"layer{i}")[1].conv2.out_channels for i in range(1, 5)] == [4, 8, 16, 32]
    assert model.fc.in_features == 32


def test_mlp_layers_follow_the_spec():
    model = build("mlp:1000-1000", (784,), 1, bias=False)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(784, 1000), (1000, 1000), (1000, 1)]
    linear_model = build("mlp:", (3, 4, 4), 5)
    assert [type(m) for m in linear_model] == [nn.Flatten, nn.Linear]


@pytest.mark.parametrize("act", ACTIVATIONS.names())
def test_activation_is_applied_after_every_hidden_layer(act):
    expected = type(ACTIVATIONS.create(act))
    model = build("cnn:3-4-1-1,3-4-2-0", (1, 9, 9), 2, act=act)
    assert sum(type(m) is expected for m in model) == 2
    assert model.act == act
    mlp = build("mlp:6-6-6", (4,), 2, act=act)
    assert sum(type(m) is expected for m in mlp) == 3


def test_leaky_relu_slope_default_and_option():
    default = build("mlp:4", (3,), 1, act="leaky-relu")
    assert default.act1.negative_slope == 0.2
    custom = build("mlp:4", (3,), 1, act="leaky_relu", negative_slope=0.01)
    assert custom.act1.negative_slope == 0.01 and custom.act == "leaky-relu"


def test_identity_bias_free_mlp_is_linear():
    model = build("mlp:8-8", (5,), 3, act="identity", bias=False, seed=3)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(2.5 * x - x), model(2.5 * x) - model(x))


@pytest.mark.parametrize("spec,shape", [("mlp:5-5", (4,)), ("cnn:3-2-1-0", (1, 6, 6)), ("lenet", (1, 8, 8)), ("twolayer:7", (3,))])
def test_bias_false_leaves_no_bias_parameters(spec, shape):
    model = build(spec, shape, 2, bias=False)
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert all(getattr(m, "bias", None) is None for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))


def test_bias_dict_sets_each_layer_kind():
    model = build("lenet", (1, 8, 8), 2, bias={"conv": False})
    assert [n for n, _ in model.named_parameters() if n.endswith("bias")] == ["fc.bias"]
    model = build("cnn:3-2-1-0", (1, 6, 6), 2, bias={"conv": True, "linear": False})
    assert [n for n, _ in model.named_parameters() if n.endswith("bias")] == ["conv1.bias"]


@pytest.mark.parametrize("act,bias", [("relu", True), ("relu", False), ("tanh", True), ("sigmoid", False)])
def test_twolayer_forward_is_the_sum_over_hidden_units(act, bias):
    d, m, classes = 6, 9, 2
    model = build(f"twolayer:{m}", (d,), classes, act=act, bias=bias, init="gaussian", seed=4)
    sigma = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}[act]
    w, a = model.first.weight, model.second.weight
    b = model.first.bias if bias else torch.zeros(m)
    assert w.shape == (m, d) and a.shape == (classes, m) and model.second.bias is None
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(2))
    by_hand = torch.zeros(5, classes)
    for i in range(5):
        for k in range(classes):
            by_hand[i, k] = sum(a[k, j] * sigma(w[j] @ x[i] + b[j]) for j in range(m))
    torch.testing.assert_close(model(x), by_hand, rtol=1e-5, atol=1e-6)


def test_bias_free_relu_twolayer_is_homogeneous():
    model = build("twolayer:50", (8,), 1, bias=False, seed=0)
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(3.0 * x), 3.0 * model(x))
    assert isinstance(model, TwoLayer) and model(x).shape == (10, 1)


def test_zoo_classes_can_be_used_directly():
    model = CNN((3, 10, 10), [ConvLayerSpec(3, 4, 1, 0)], 5, act="tanh")
    assert model(torch.zeros(2, 3, 10, 10)).shape == (2, 5)
    with pytest.raises(ConfigError, match="at least one convolution"):
        CNN((3, 10, 10), [], 5)
