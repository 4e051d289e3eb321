"""Initialisation schemes, drawn from a local :class:`torch.Generator`.

The global RNG is never used: the same seed gives the same parameters
whatever else the program drew before.  Schemes act on every Conv/Linear
layer (in module order); BatchNorm layers are reset to weight 1, bias 0 and
fresh running statistics.

- ``"default"`` — the family's own default: ``"dlg"`` for the LeNet of DLG,
  ``"pytorch"`` for every other family.
- ``"pytorch"`` — PyTorch's layer defaults, re-drawn from the generator:
  weight and bias ~ U(−1/√fan_in, 1/√fan_in) (``kaiming_uniform_(a=√5)`` gives
  exactly this bound for weights).
- ``"uniform"`` — Chen & Campbell (2022), Sec. 4: "weights are initialised
  randomly from a uniform distribution"; the paper gives no range, so weights
  and biases ~ U(−a, a) with a = 1/√fan_in (the range of PyTorch's layers,
  which the CNN variants use unchanged), or a = ``init_scale`` when given.
- ``"gaussian"`` — weights ~ N(0, 1/fan_in), biases 0.  For :class:`TwoLayer`
  it is the random-feature net of Liu et al. (2024), Sec. 3 and Assumption B.2
  (after Wang et al. 2023): w_j ~ N(0, I_d) and a_j ~ N(0, 1/m²) with m the
  width, hidden biases 0.
- ``"small"`` — Haim et al. (2022), appendix C.3.1: the first layer
  ~ N(0, σ²) with σ = ``init_scale`` (default 1e-4), the other layers Kaiming
  normal N(0, 2/fan_in) (He et al. 2015); biases 0.
- ``"dlg"`` — the DLG code (Zhu et al. 2019): every weight and bias ~ U(−0.5, 0.5).
- ``"gpt"`` — GPT-2's (Radford et al. 2019; the text transformers' default): Linear and
  Embedding weights ~ N(0, 0.02²), biases 0.

Embedding tables (text models) are drawn from the generator too: N(0, 1), PyTorch's default,
under every scheme but ``"gpt"``; LayerNorm layers are reset to weight 1, bias 0.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..errors import ConfigError
from ..registry import Registry
from .zoo import TwoLayer

#: First-layer standard deviation of the ``"small"`` scheme (Haim et al. 2022, App. C.3.1).
SMALL_INIT_STD = 1e-4

InitScheme = Callable[..., None]

INITS: Registry[None] = Registry("init")

_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm)
#: GPT-2's initial standard deviation of weights and embeddings (Radford et al. 2019, the released code).
GPT_INIT_STD = 0.02


def weighted_layers(model: nn.Module) -> list[nn.Module]:
    """The Linear and Conv layers of ``model`` in module (registration) order."""
    return [m for m in model.modules() if isinstance(m, _WEIGHTED)]


def fan_in(layer: nn.Module) -> int:
    """Inputs per output unit: in_features, or in_channels/groups · kernel area."""
    w = layer.weight
    return int(w.shape[1] * math.prod(w.shape[2:]))


def _uniform(t: torch.Tensor | None, bound: float, g: torch.Generator) -> None:
    if t is not None:
        t.uniform_(-bound, bound, generator=g)


def _normal(t: torch.Tensor, std: float, g: torch.Generator) -> None:
    t.normal_(0.0, std, generator=g)


def _zero(t: torch.Tensor | None) -> None:
    if t is not None:
        t.zero_()


@INITS.register("pytorch")
def init_pytorch(model: nn.Module, *, generator: torch.Generator, init_scale: float | None = None) -> None:
    """PyTorch's layer defaults: weight, bias ~ U(±1/√fan_in)."""
    _no_scale("pytorch", init_scale)
    for layer in weighted_layers(model):
        bound = 1.0 / math.sqrt(fan_in(layer)) if fan_in(layer) > 0 else 0.0
        _uniform(layer.weight, bound, generator)
        _uniform(layer.bias, bound, generator)


@INITS.register("uniform")
def init_uniform(model: nn.Module, *, generator: torch.Generator, init_scale: float | None = None) -> None:
    """Chen & Campbell: weight, bias ~ U(−a, a), a = init_scale or 1/√fan_in."""
    for layer in weighted_layers(model):
        bound = init_scale if init_scale is not None else 1.0 / math.sqrt(max(fan_in(layer), 1))
        _uniform(layer.weight, bound, generator)
        _uniform(layer.bias, bound, generator)


@INITS.register("gaussian")
def init_gaussian(model: nn.Module, *, generator: torch.Generator, init_scale: float | None = None) -> None:
    """Weights ~ N(0, 1/fan_in), biases 0; TwoLayer: w ~ N(0, I), a ~ N(0, 1/m²) (Liu et al.)."""
    _no_scale("gaussian", init_scale)
    if isinstance(model, TwoLayer):
        _normal(model.first.weight, 1.0, generator)
        _zero(model.first.bias)
        _normal(model.second.weight, 1.0 / model.hidden, generator)
        return
    for layer in weighted_layers(model):
        _normal(layer.weight, 1.0 / math.sqrt(max(fan_in(layer), 1)), generator)
        _zero(layer.bias)


@INITS.register("small")
def init_small(model: nn.Module, *, generator: torch.Generator, init_scale: float | None = None) -> None:
    """Haim et al.: first layer ~ N(0, init_scale²) (1e-4), others Kaiming normal, biases 0."""
    std = SMALL_INIT_STD if init_scale is None else init_scale
    for i, layer in enumerate(weighted_layers(model)):
        _normal(layer.weight, std if i == 0 else math.sqrt(2.0 / max(fan_in(layer), 1)), generator)
        _zero(layer.bias)


@INITS.register("dlg")
def init_dlg(model: nn.Module, *, generator: torch.Generator, init_scale: float | None = None) -> None:
    """DLG (Zhu et al. 2019): every weight and bias ~ U(−0.5, 0.5)."""
    _no_scale("dlg", init_scale)
    for layer in weighted_layers(model):
        _uniform(layer.weight, 0.5, generator)
        _uniform(layer.bias, 0.5, generator)


@INITS.register("gpt")
def init_gpt(model: nn.Module, *, generator: torch.Generator, init_scale: float | None = None) -> None:
    """GPT-2: Linear and Embedding weights ~ N(0, 0.02²) (or N(0, init_scale²)), biases 0."""
    std = GPT_INIT_STD if init_scale is None else init_scale
    for layer in weighted_layers(model):
        _normal(layer.weight, std, generator)
        _zero(layer.bias)
    for emb in (m for m in model.modules() if isinstance(m, nn.Embedding)):
        _normal(emb.weight, std, generator)


def _no_scale(scheme: str, init_scale: float | None) -> None:
    if init_scale is not None:
        raise ConfigError(
            f"init_scale applies to init 'small' (first-layer std) or 'uniform' (bound), "
            f"got init_scale={init_scale!r} with init={scheme!r}"
        )


def init_names() -> list[str]:
    """Every accepted ``init`` name, ``"default"`` included."""
    return ["default", *INITS.names()]


def resolve_init(scheme: str, model: nn.Module | type | None = None) -> str:
    """The scheme ``scheme`` stands for: ``"default"`` → the model's ``default_init``."""
    if not isinstance(scheme, str):
        raise ConfigError(f"expected an init name (one of {', '.join(init_names())}), got {scheme!r} (field init)")
    key = scheme.strip().lower()
    if key == "default":
        return getattr(model, "default_init", "pytorch")
    if key not in INITS:
        raise ConfigError(f"unknown init {scheme!r} (field init); known inits: {', '.join(init_names())}")
    return key


def check_init_scale(init_scale: float | None) -> float | None:
    """``init_scale`` as a positive float (or ``None``); :class:`ConfigError` otherwise."""
    if init_scale is None:
        return None
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not init_scale > 0:
        raise ConfigError(f"expected a positive number for init_scale, got {init_scale!r}")
    return float(init_scale)


def make_generator(seed: int | None) -> tuple[torch.Generator, int]:
    """A CPU generator and its seed; ``seed=None`` draws a fresh one (global RNG untouched)."""
    g = torch.Generator()
    if seed is None:
        return g, g.seed()
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"expected an integer seed or None, got {seed!r} (field seed)")
    g.manual_seed(seed)
    return g, seed


@torch.no_grad()
def initialize(
    model: nn.Module,
    scheme: str = "default",
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    init_scale: float | None = None,
) -> nn.Module:
    """Re-initialise ``model`` in place with ``scheme`` and return it.

    Draws come from ``generator`` or, if none is given, from a fresh CPU
    generator seeded with ``seed``.  Parameters on another device are drawn on
    the CPU and copied over.
    """
    name = resolve_init(scheme, model)
    init_scale = check_init_scale(init_scale)
    if generator is None:
        generator, _ = make_generator(seed)
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if devices == {torch.device("meta")}:  # a model sized without memory (load_model's check): nothing to draw
        return model
    on_cpu = devices <= {torch.device("cpu")}
    target = model if on_cpu else _cpu_copy(model)
    if name != "gpt":
        for emb in (m for m in target.modules() if isinstance(m, nn.Embedding)):
            _normal(emb.weight, 1.0, generator)
    INITS.get(name)(target, generator=generator, init_scale=init_scale)
    for m in target.modules():
        if isinstance(m, _NORMS):
            m.reset_parameters()
    if not on_cpu:
        for dst, src in zip(model.state_dict().values(), target.state_dict().values()):
            dst.copy_(src)
    return model


def _cpu_copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).to("cpu")
