"""Models: build the attacked architectures from short specs.

>>> from leakbench.models import build
>>> model = build("cnn:3-6-1-0,4-3-2-0", input_shape=(3, 32, 32), classes=10, act="tanh", seed=0)
>>> model.spec, model[-1].in_features
('cnn:3-6-1-0,4-3-2-0', 588)

Families (registry :data:`MODELS`): ``mlp``, ``cnn``, ``lenet``, ``convnet``,
``resnet18``, ``twolayer``; activations (:data:`ACTIVATIONS`): relu,
leaky-relu, tanh, sigmoid, identity; initialisations (:data:`INITS`, plus
"default"): pytorch, uniform, gaussian, small, dlg.  See ``docs/models.md``.
"""
from __future__ import annotations

from .init import INITS, SMALL_INIT_STD, initialize, weighted_layers
from .generator import UNetGenerator
from .layers import ACTIVATIONS, DEFAULT_NEGATIVE_SLOPE, activation, activation_name
from .active import TrapBlock, fishing, trap_weights
from .malicious import ImprintBlock, RandomFeatureHead, imprint, random_head
from .loki import LokiBlock, loki
from .targets import TargetConfig, TrainedTarget, train_target
from .spec import MODELS, Family, LayerInfo, build, canonical_spec, count_parameters, describe, parse_spec
from .transformers import TextTransformer
from .zoo import CNN, MLP, BasicBlock, ConvLayerSpec, ConvNet, LeNet, ResNet18, TwoLayer, conv_output_size

__all__ = [
    "ACTIVATIONS",
    "BasicBlock",
    "CNN",
    "ConvLayerSpec",
    "ConvNet",
    "DEFAULT_NEGATIVE_SLOPE",
    "Family",
    "INITS",
    "LayerInfo",
    "LeNet",
    "MLP",
    "MODELS",
    "ResNet18",
    "SMALL_INIT_STD",
    "TwoLayer",
    "TextTransformer",
    "activation",
    "activation_name",
    "build",
    "canonical_spec",
    "conv_output_size",
    "count_parameters",
    "describe",
    "initialize",
    "parse_spec",
    "weighted_layers",
    "ImprintBlock",
    "RandomFeatureHead",
    "TrapBlock",
    "UNetGenerator",
    "imprint",
    "random_head",
    "trap_weights",
    "fishing",
    "LokiBlock",
    "loki",
    "TargetConfig", "TrainedTarget", "train_target",
]
