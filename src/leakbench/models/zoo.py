"""The model zoo: the architectures the papers attack, written by hand.

- :class:`MLP` — fully connected nets, e.g. the ``d-1000-1000-1`` nets whose
  trained weights Haim et al. (2022) reconstruct from, and the ReLU MLPs of
  Pan et al. (2022, neuron exclusivity).
- :class:`CNN` — convolution layers written ``kernel-channels-stride-padding``
  and one fully connected layer, the "CNN2/3/4 variants" of Chen & Campbell
  (2022), Table 1 (e.g. CNN3 variant 1 = ``3-6-1-0,4-3-2-0``, FC width 588 on
  3×32×32).
- :class:`LeNet` — the sigmoid LeNet of DLG (Zhu, Liu & Han 2019): three 5×5
  convolutions (strides 2, 2, 1, padding 2) with 12 channels, then one linear
  layer (768 inputs on 32×32 images).
- :class:`ConvNet` — the ConvNet of Inverting Gradients (Geiping et al. 2020):
  eight 3×3 conv+BN+ReLU layers of widths W, 2W, 2W, 4W, 4W, 4W | pool | 4W, 4W
  | pool, then a linear layer (36·W inputs on 32×32 images).
- :class:`ResNet18` — the CIFAR ResNet-18 (He et al. 2016; 3×3 stem, no
  max-pool), the backbone of Liu et al. (2024)'s systematic evaluation.
- :class:`TwoLayer` — f(x) = Σ_j a_j σ(w_jᵀx + b_j), the two-layer nets of the
  tensor attack and bounds (Wang et al. 2023; Liu et al. 2024, Sec. 3) and of
  the provable attacks on trained shallow networks (homogeneous without bias).

Every model maps a batch (B, *input_shape) to (B, classes).  Shapes are
checked when the model is made, so a too-small input is a
:class:`~leakbench.errors.ConfigError` naming the layer, never a runtime
shape error.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .layers import activation_factory

ActLike = str | Callable[[], nn.Module]

__all__ = [
    "ConvLayerSpec",
    "conv_output_size",
    "MLP",
    "CNN",
    "LeNet",
    "ConvNet",
    "BasicBlock",
    "ResNet18",
    "TwoLayer",
]


class ConvLayerSpec(NamedTuple):
    """One convolution of a ``cnn:`` spec, in Chen & Campbell's order k, c, s, p."""

    kernel: int
    channels: int
    stride: int
    padding: int

    def __str__(self) -> str:
        return f"{self.kernel}-{self.channels}-{self.stride}-{self.padding}"


def conv_output_size(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial output size of a convolution or pooling: floor((size + 2p − k) / s) + 1.

    Can be ≤ 0, meaning the kernel does not fit; callers turn that into a
    :class:`ConfigError`.
    """
    return (size + 2 * padding - kernel) // stride + 1


def _factory(act: ActLike) -> Callable[[], nn.Module]:
    return activation_factory(act) if isinstance(act, str) else act


def _image_shape(input_shape: Sequence[int], model: str) -> tuple[int, int, int]:
    shape = tuple(input_shape)
    if len(shape) != 3:
        raise ConfigError(
            f"expected input_shape (C, H, W) for {model}, got {shape} (field input_shape)"
        )
    return shape  # type: ignore[return-value]


def _too_small(model: str, layer: str, size: tuple[int, int], input_shape: Sequence[int]) -> ConfigError:
    return ConfigError(
        f"input_shape {tuple(input_shape)} is too small for {model}: the output of {layer} "
        f"would be {size[0]}×{size[1]} (expected at least 1×1; use larger images or fewer/"
        f"smaller-stride layers)"
    )


class MLP(nn.Sequential):
    """Flatten → [Linear → act] per hidden width → Linear to ``classes``.

    With no hidden width it is a linear model.  ``bias`` applies to every
    Linear (``bias=False`` and a homogeneous activation give a homogeneous
    net, as in Haim et al. 2022).
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int],
        classes: int,
        *,
        act: ActLike = "relu",
        bias: bool = True,
    ) -> None:
        make_act = _factory(act)
        layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]
        width = in_features
        for i, h in enumerate(hidden, start=1):
            layers.append((f"fc{i}", nn.Linear(width, h, bias=bias)))
            layers.append((f"act{i}", make_act()))
            width = h
        layers.append(("fc", nn.Linear(width, classes, bias=bias)))
        super().__init__(OrderedDict(layers))
        self.hidden = tuple(hidden)


class CNN(nn.Sequential):
    """Chen & Campbell's convolutional variants: [Conv → act]* → Flatten → Linear.

    ``layers`` are :class:`ConvLayerSpec` (kernel, channels, stride, padding).
    :attr:`feature_shapes` lists the (C, H, W) after each convolution; the
    final Linear has ``C·H·W`` of the last one as inputs.  Chen & Campbell
    take the convolutions bias-free and the linear layer with bias
    (``bias={"conv": False, "linear": True}``).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        layers: Sequence[ConvLayerSpec],
        classes: int,
        *,
        act: ActLike = "relu",
        conv_bias: bool = True,
        linear_bias: bool = True,
    ) -> None:
        c, h, w = _image_shape(input_shape, "cnn")
        if not layers:
            raise ConfigError("expected at least one convolution layer for cnn, got none")
        make_act = _factory(act)
        modules: list[tuple[str, nn.Module]] = []
        shapes: list[tuple[int, int, int]] = []
        for i, spec in enumerate(layers, start=1):
            k, ch, s, p = spec
            h, w = conv_output_size(h, k, s, p), conv_output_size(w, k, s, p)
            if h < 1 or w < 1:
                raise _too_small("cnn", f"conv{i} ({spec})", (h, w), input_shape)
            modules.append((f"conv{i}", nn.Conv2d(c, ch, k, stride=s, padding=p, bias=conv_bias)))
            modules.append((f"act{i}", make_act()))
            c = ch
            shapes.append((c, h, w))
        modules.append(("flatten", nn.Flatten()))
        modules.append(("fc", nn.Linear(c * h * w, classes, bias=linear_bias)))
        super().__init__(OrderedDict(modules))
        self.conv_layers = tuple(ConvLayerSpec(*spec) for spec in layers)
        self.feature_shapes = shapes


class LeNet(CNN):
    """The LeNet of DLG (Zhu et al. 2019): Conv(C,12,5,s2,p2) σ, Conv(12,12,5,s2,p2) σ,
    Conv(12,12,5,s1,p2) σ, Flatten, Linear.

    On 3×32×32 images the Linear has 12·8·8 = 768 inputs.  The activation is
    the sigmoid by default; DLG initialises every weight and bias from
    U(−0.5, 0.5) (init scheme ``"dlg"``, this family's default in :func:`build`).
    """

    LAYERS = (ConvLayerSpec(5, 12, 2, 2), ConvLayerSpec(5, 12, 2, 2), ConvLayerSpec(5, 12, 1, 2))
    #: What ``init="default"`` means for this model (see :mod:`leakbench.models.init`).
    default_init = "dlg"

    def __init__(
        self,
        input_shape: Sequence[int],
        classes: int,
        *,
        act: ActLike = "sigmoid",
        conv_bias: bool = True,
        linear_bias: bool = True,
    ) -> None:
        super().__init__(
            input_shape, self.LAYERS, classes, act=act, conv_bias=conv_bias, linear_bias=linear_bias
        )


class ConvNet(nn.Sequential):
    """The ConvNet of Inverting Gradients (Geiping et al. 2020), width W.

    3×3 convolutions (padding 1) C→W, W→2W, 2W→2W, 2W→4W, 4W→4W, 4W→4W, each
    followed by BatchNorm2d and the activation; MaxPool2d(3); two more
    4W→4W conv+BN+act; MaxPool2d(3); Flatten; Linear.  The Linear has
    4W·h·w inputs, h = w = 3 on 32×32 images (36·W).  ``norm=False`` drops
    the BatchNorm layers.  Needs images of at least 9×9.
    """

    WIDTHS = (1, 2, 2, 4, 4, 4, "pool", 4, 4, "pool")

    def __init__(
        self,
        input_shape: Sequence[int],
        classes: int,
        *,
        width: int = 32,
        act: ActLike = "relu",
        norm: bool = True,
        conv_bias: bool = True,
        linear_bias: bool = True,
    ) -> None:
        c, h, w = _image_shape(input_shape, "convnet")
        make_act = _factory(act)
        modules: list[tuple[str, nn.Module]] = []
        conv_i = pool_i = 0
        for item in self.WIDTHS:
            if item == "pool":
                h, w = conv_output_size(h, 3, 3), conv_output_size(w, 3, 3)
                if h < 1 or w < 1:
                    raise _too_small("convnet", f"pool{pool_i} (MaxPool2d(3))", (h, w), input_shape)
                modules.append((f"pool{pool_i}", nn.MaxPool2d(3)))
                pool_i += 1
                continue
            out = int(item) * width
            modules.append((f"conv{conv_i}", nn.Conv2d(c, out, 3, padding=1, bias=conv_bias)))
            if norm:
                modules.append((f"bn{conv_i}", nn.BatchNorm2d(out)))
            modules.append((f"act{conv_i}", make_act()))
            c = out
            conv_i += 1
        modules.append(("flatten", nn.Flatten()))
        modules.append(("fc", nn.Linear(c * h * w, classes, bias=linear_bias)))
        super().__init__(OrderedDict(modules))
        self.width = width
        self.feature_shape = (c, h, w)


class BasicBlock(nn.Module):
    """ResNet basic block: conv3×3(stride)-BN-act-conv3×3-BN, plus a shortcut, then act."""

    def __init__(
        self,
        in_channels: int,
        channels: int,
        *,
        stride: int = 1,
        act: ActLike = "relu",
        norm: bool = True,
        conv_bias: bool = False,
    ) -> None:
        super().__init__()
        make_act = _factory(act)
        bn = (lambda n: nn.BatchNorm2d(n)) if norm else (lambda n: nn.Identity())
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=conv_bias)
        self.bn1 = bn(channels)
        self.act1 = make_act()
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=conv_bias)
        self.bn2 = bn(channels)
        if stride != 1 or in_channels != channels:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=conv_bias), bn(channels)
            )
        else:
            self.shortcut = nn.Identity()
        self.act2 = make_act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act2(out + self.shortcut(x))


class ResNet18(nn.Module):
    """The CIFAR ResNet-18: 3×3 stem (stride 1, no max-pool), BasicBlocks [2, 2, 2, 2]
    of widths w, 2w, 4w, 8w (w = ``width``, 64 in the standard net) with strides
    1, 2, 2, 2, global average pooling and a linear layer.

    Convolutions carry no bias when followed by BatchNorm (the standard net);
    with ``norm=False`` they take ``conv_bias``.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        classes: int,
        *,
        width: int = 64,
        act: ActLike = "relu",
        norm: bool = True,
        conv_bias: bool = False,
        linear_bias: bool = True,
    ) -> None:
        super().__init__()
        c, _, _ = _image_shape(input_shape, "resnet18")
        make_act = _factory(act)
        bias = conv_bias and not norm
        self.conv1 = nn.Conv2d(c, width, 3, stride=1, padding=1, bias=bias)
        self.bn1: nn.Module = nn.BatchNorm2d(width) if norm else nn.Identity()
        self.act1 = make_act()
        blocks: list[nn.Module] = []
        in_ch = width
        for mult, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            out_ch = mult * width
            layer = nn.Sequential(
                BasicBlock(in_ch, out_ch, stride=stride, act=make_act, norm=norm, conv_bias=bias),
                BasicBlock(out_ch, out_ch, stride=1, act=make_act, norm=norm, conv_bias=bias),
            )
            blocks.append(layer)
            in_ch = out_ch
        self.layer1, self.layer2, self.layer3, self.layer4 = blocks
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_ch, classes, bias=linear_bias)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.pool(x)))


class TwoLayer(nn.Module):
    """f(x) = Σ_j a_j σ(w_jᵀx + b_j): M hidden units, no output bias.

    :attr:`first` is the hidden layer (weights w_j as rows of an (M, d)
    matrix, bias b optional), :attr:`second` the output layer, its weight the
    (classes, M) matrix a.  Without hidden bias and with a homogeneous σ
    (ReLU, leaky ReLU, identity) the net is positively homogeneous, as the
    margin-based attacks on trained shallow networks assume; Liu et al. (2024,
    Sec. 3) and Wang et al. (2023) take no bias and Gaussian weights
    (init ``"gaussian"``: w_j ~ N(0, I_d), a_j ~ N(0, 1/M²)).
    """

    def __init__(
        self,
        in_features: int,
        hidden: int,
        classes: int = 1,
        *,
        act: ActLike = "relu",
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.first = nn.Linear(in_features, hidden, bias=bias)
        self.act1 = _factory(act)()
        self.second = nn.Linear(hidden, classes, bias=False)
        self.hidden = hidden

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """σ(Wx + b): the hidden activations, (B, M)."""
        return self.act1(self.first(self.flatten(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.features(x))


def flat_size(input_shape: Sequence[int]) -> int:
    """Number of entries of one sample of shape ``input_shape``."""
    return int(math.prod(input_shape))
