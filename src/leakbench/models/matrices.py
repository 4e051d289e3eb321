"""Layers as matrices on the flattened input, and models as chains of such layers.

The one matrix builder of leakbench, shared by R-GAP / hybrid (attacks) and the
security metric (analysis).  Chen & Campbell (2022), Sec. 3 write both the
forward pass and the weight gradient of a layer as linear maps of its input x
(eqs. 1a, 1b, 6):

* weight constraint (1a): ``z = W_circ x + b`` — for ``nn.Conv2d`` W_circ is the
  (C'·H'·W') × (C·H·W) "circulant" (Toeplitz-block) matrix of the convolution;
  for ``nn.Linear`` it is the weight itself;
* gradient constraint (1b): ``vec(∇W) = K(δ) x`` with δ = ∂L/∂z (batch of one):
  ∇W[o, c, u, v] = Σ_{i,j} δ[o, i, j] · x[c, i·s − p + u·d, j·s − p + v·d] for a
  convolution, ∇W = δ xᵀ for a linear layer.

Both matrices come from one index computation (:func:`conv_indices`): every
(output, kernel entry, input pixel) triple the convolution touches.  Padding
positions fall out (zero padding), strides with (H + 2p − k) mod s ≠ 0 simply
leave trailing input rows unused.  Dense or sparse (torch COO, on the layer's
device) on request.

:func:`layer_chain` walks any model made of Conv2d, Linear, activations and
Flatten applied one after the other (checked against the model's own forward)
and returns the weighted layers with their input/output shapes and activations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ConfigError, UnsupportedThreatModel
from .layers import activation_name

__all__ = [
    "ConvGeometry", "conv_geometry", "conv_indices", "weight_matrix", "gradient_matrix", "bias_vector", "conv_system",
    "ChainBlock", "layer_chain", "SUPPORTED_LAYERS",
]

#: Leaf module types :func:`layer_chain` accepts.
SUPPORTED_LAYERS = (nn.Conv2d, nn.Linear, nn.Flatten, nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Identity)


@dataclass(frozen=True)
class ConvGeometry:
    """Shapes of one 2-d convolution applied to a C×H×W input."""

    in_channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]  # before (top, left); the output size accounts for ``padding_after``
    padding_after: tuple[int, int]
    dilation: tuple[int, int]
    out_height: int
    out_width: int

    @property
    def in_dim(self) -> int:
        return self.in_channels * self.height * self.width

    @property
    def out_dim(self) -> int:
        return self.out_channels * self.out_height * self.out_width

    @property
    def weight_numel(self) -> int:
        return self.out_channels * self.in_channels * self.kernel[0] * self.kernel[1]


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv_geometry(layer: nn.Conv2d, input_shape: Sequence[int]) -> ConvGeometry:
    """The geometry of ``layer`` on one sample of shape C×H×W (ConfigError if they do not fit)."""
    if not isinstance(layer, nn.Conv2d):
        raise ConfigError(f"expected an nn.Conv2d, got {type(layer).__name__}")
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3 or shape[0] != layer.in_channels:
        raise ConfigError(f"expected an input of shape ({layer.in_channels}, H, W) for {layer}, got {shape} "
                          "(field input_shape)")
    if layer.groups != 1:
        raise UnsupportedThreatModel(f"grouped convolutions are not supported (groups={layer.groups} in {layer})")
    if layer.padding_mode != "zeros":
        raise UnsupportedThreatModel(f"only zero padding is supported, got padding_mode={layer.padding_mode!r}")
    kernel, stride, dilation = _pair(layer.kernel_size), _pair(layer.stride), _pair(layer.dilation)
    if isinstance(layer.padding, str):
        if layer.padding == "valid":
            before = after = (0, 0)
        else:  # "same" (stride 1): total padding d·(k − 1), the extra one after, as PyTorch
            total = [d * (k - 1) for d, k in zip(dilation, kernel)]
            before = (total[0] // 2, total[1] // 2)
            after = (total[0] - before[0], total[1] - before[1])
    else:
        before = after = _pair(layer.padding)
    c, h, w = shape
    oh = (h + before[0] + after[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w + before[1] + after[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    if oh < 1 or ow < 1:
        raise ConfigError(f"input {shape} is too small for {layer}: output would be {oh}×{ow}")
    return ConvGeometry(c, h, w, layer.out_channels, kernel, stride, before, after, dilation, oh, ow)


def conv_indices(geo: ConvGeometry, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat indices (output, kernel entry, input) of every product the convolution computes.

    ``z.flatten()[out] += W.flatten()[kernel] * x.flatten()[inp]`` over all returned triples
    reproduces the bias-free convolution; positions in the zero padding are left out.
    """
    dev = torch.device(device)
    kh, kw = geo.kernel
    ar = lambda n: torch.arange(n, device=dev)  # noqa: E731
    o = ar(geo.out_channels).view(-1, 1, 1, 1, 1, 1)
    i = ar(geo.out_height).view(1, -1, 1, 1, 1, 1)
    j = ar(geo.out_width).view(1, 1, -1, 1, 1, 1)
    c = ar(geo.in_channels).view(1, 1, 1, -1, 1, 1)
    u = ar(kh).view(1, 1, 1, 1, -1, 1)
    v = ar(kw).view(1, 1, 1, 1, 1, -1)
    y = i * geo.stride[0] - geo.padding[0] + u * geo.dilation[0]
    x = j * geo.stride[1] - geo.padding[1] + v * geo.dilation[1]
    full = (geo.out_channels, geo.out_height, geo.out_width, geo.in_channels, kh, kw)
    valid = ((y >= 0) & (y < geo.height) & (x >= 0) & (x < geo.width)).expand(full)
    out = ((o * geo.out_height + i) * geo.out_width + j).expand(full)[valid]
    ker = (((o * geo.in_channels + c) * kh + u) * kw + v).expand(full)[valid]
    inp = ((c * geo.height + y) * geo.width + x).expand(full)[valid]
    return out, ker, inp


def _assemble(rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, size: tuple[int, int],
              sparse: bool) -> torch.Tensor:
    if sparse:
        return torch.sparse_coo_tensor(torch.stack([rows, cols]), values, size, check_invariants=False).coalesce()
    dense = torch.zeros(size, dtype=values.dtype, device=values.device)
    return dense.index_put_((rows, cols), values, accumulate=True)


def _check_linear(layer: nn.Linear, input_shape: Sequence[int]) -> None:
    dim = int(math.prod(input_shape))
    if dim != layer.in_features:
        raise ConfigError(f"expected an input with {layer.in_features} entries for {layer}, got shape "
                          f"{tuple(input_shape)} (field input_shape)")


def weight_matrix(layer: nn.Module, input_shape: Sequence[int], *, sparse: bool = False,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """W_circ with ``layer(x) − b == W_circ @ x.flatten()`` (eq. 1a), dense or sparse COO."""
    w = layer.weight.detach()
    w = w.to(dtype) if dtype is not None else w
    if isinstance(layer, nn.Linear):
        _check_linear(layer, input_shape)
        return w.to_sparse() if sparse else w.clone()
    geo = conv_geometry(layer, input_shape)
    out, ker, inp = conv_indices(geo, w.device)
    return _assemble(out, inp, w.reshape(-1)[ker], (geo.out_dim, geo.in_dim), sparse)


def gradient_matrix(layer: nn.Module, input_shape: Sequence[int], upstream: torch.Tensor, *,
                    sparse: bool = False) -> torch.Tensor:
    """K(δ) with ``vec(∇W) == K(δ) @ x.flatten()`` for one sample (eq. 1b), δ = ∂L/∂z of the layer's output."""
    delta = upstream.detach().reshape(-1)
    if isinstance(layer, nn.Linear):
        _check_linear(layer, input_shape)
        if delta.numel() != layer.out_features:
            raise ConfigError(f"expected an upstream gradient with {layer.out_features} entries, got {delta.numel()}")
        eye = torch.eye(layer.in_features, dtype=delta.dtype, device=delta.device)
        k = torch.kron(delta.reshape(-1, 1), eye)
        return k.to_sparse() if sparse else k
    geo = conv_geometry(layer, input_shape)
    if delta.numel() != geo.out_dim:
        raise ConfigError(f"expected an upstream gradient with {geo.out_dim} entries "
                          f"({geo.out_channels}×{geo.out_height}×{geo.out_width}), got {delta.numel()}")
    out, ker, inp = conv_indices(geo, delta.device)
    return _assemble(ker, inp, delta[out], (geo.weight_numel, geo.in_dim), sparse)


def conv_system(layer: nn.Conv2d, input_shape: Sequence[int], upstream: torch.Tensor):
    """(W_circ, K(δ)) of a convolution as float64 scipy CSR matrices from one index computation (eqs. 1a, 1b)."""
    import numpy as np
    import scipy.sparse as sp

    geo = conv_geometry(layer, input_shape)
    delta = upstream.detach().reshape(-1)
    if delta.numel() != geo.out_dim:
        raise ConfigError(f"expected an upstream gradient with {geo.out_dim} entries "
                          f"({geo.out_channels}×{geo.out_height}×{geo.out_width}), got {delta.numel()}")
    out, ker, inp = (t.numpy() for t in conv_indices(geo, "cpu"))
    w = layer.weight.detach().double().cpu().reshape(-1).numpy()
    weight = sp.csr_matrix((w[ker], (out, inp)), shape=(geo.out_dim, geo.in_dim), dtype=np.float64)
    grad = sp.csr_matrix((delta.double().cpu().numpy()[out], (ker, inp)), shape=(geo.weight_numel, geo.in_dim),
                         dtype=np.float64)
    return weight, grad


def bias_vector(layer: nn.Module, input_shape: Sequence[int], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The bias as a vector over the flattened output (zeros when the layer has none)."""
    w = layer.weight
    dtype = dtype or w.dtype
    if isinstance(layer, nn.Linear):
        n = layer.out_features
        return layer.bias.detach().to(dtype) if layer.bias is not None else torch.zeros(n, dtype=dtype, device=w.device)
    geo = conv_geometry(layer, input_shape)
    if layer.bias is None:
        return torch.zeros(geo.out_dim, dtype=dtype, device=w.device)
    return layer.bias.detach().to(dtype).repeat_interleave(geo.out_height * geo.out_width)


# --------------------------------------------------------------------------- chains of layers


@dataclass
class ChainBlock:
    """One weighted layer of a chain with the activation applied to its output.

    ``input_shape`` is the per-sample shape the layer receives (after any Flatten),
    ``output_shape`` the shape of its output; ``act`` is the registered activation
    name (``"identity"`` when none follows), ``slope`` the leaky ReLU's slope.
    ``start`` is the position of the layer among the chain's leaf modules, so
    ``nn.Sequential(*modules[start:])`` is the model from this layer on.
    """

    name: str
    layer: nn.Module
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    act: str
    act_module: nn.Module | None
    slope: float
    start: int

    @property
    def kind(self) -> str:
        return "conv" if isinstance(self.layer, nn.Conv2d) else "linear"

    @property
    def input_dim(self) -> int:
        return int(math.prod(self.input_shape))


@dataclass
class Chain:
    """A model seen as leaf modules applied in order, grouped into :class:`ChainBlock`."""

    modules: list[nn.Module]
    names: list[str]
    blocks: list[ChainBlock]
    input_shape: tuple[int, ...]

    def tail(self, block: int) -> nn.Sequential:
        """The model from block ``block`` on (shares the modules, so parameters and names map)."""
        return nn.Sequential(*self.modules[self.blocks[block].start:])


def layer_chain(model: nn.Module, input_shape: Sequence[int], *, check: bool = True) -> Chain:
    """Walk ``model`` as a chain of Conv2d / Linear / activation / Flatten leaves.

    Raises :class:`UnsupportedThreatModel` naming the offending layer when the model
    holds another kind of layer or does not apply its leaves one after the other
    (checked on a random input when ``check``).
    """
    shape = tuple(int(s) for s in input_shape)
    leaves = [(n, m) for n, m in model.named_modules() if not any(True for _ in m.children())]
    for name, m in leaves:
        if not isinstance(m, SUPPORTED_LAYERS):
            raise UnsupportedThreatModel(
                f"layer {name!r} is a {type(m).__name__}; supported layers are "
                f"{', '.join(t.__name__ for t in SUPPORTED_LAYERS)} applied one after the other")
    if not any(isinstance(m, (nn.Conv2d, nn.Linear)) for _, m in leaves):
        raise UnsupportedThreatModel("the model has no Conv2d or Linear layer")
    ref = next(iter(model.parameters()))
    probe = torch.rand((2, *shape), generator=torch.Generator().manual_seed(0)).to(ref.device, ref.dtype)
    blocks: list[ChainBlock] = []
    with torch.no_grad():
        h = probe
        for pos, (name, m) in enumerate(leaves):
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                in_shape = tuple(h.shape[1:])
                if isinstance(m, nn.Linear) and len(in_shape) != 1:
                    raise UnsupportedThreatModel(f"linear layer {name!r} receives shape {in_shape}; "
                                                 "add an nn.Flatten before it")
                if isinstance(m, nn.Conv2d) and len(in_shape) != 3:
                    raise UnsupportedThreatModel(f"conv layer {name!r} receives shape {in_shape}, expected C×H×W")
                try:
                    h = m(h)
                except RuntimeError as err:
                    raise ConfigError(f"layer {name!r} does not accept inputs of shape {in_shape}: {err}") from None
                blocks.append(ChainBlock(name, m, in_shape, tuple(h.shape[1:]), "identity", None, 0.0, pos))
                continue
            if isinstance(m, nn.Flatten):
                h = m(h)
                continue
            if not blocks:
                raise UnsupportedThreatModel(f"activation {name!r} comes before any weighted layer")
            if blocks[-1].act != "identity" and not isinstance(m, nn.Identity):
                raise UnsupportedThreatModel(f"two activations follow layer {blocks[-1].name!r}")
            h = m(h)
            if not isinstance(m, nn.Identity):
                block = blocks[-1]
                block.act, block.act_module = activation_name(m) or "identity", m
                block.slope = float(m.negative_slope) if isinstance(m, nn.LeakyReLU) else 0.0
        if check:
            try:
                expected = model(probe)
            except RuntimeError as err:
                raise ConfigError(f"the model does not accept inputs of shape {shape}: {err}") from None
            if expected.shape != h.shape or not torch.allclose(expected, h, rtol=1e-4, atol=1e-5):
                raise UnsupportedThreatModel(
                    f"{type(model).__name__} does not apply its layers one after the other (skip connections, "
                    "pooling or a custom forward); the analytic attacks need a plain chain of layers")
    return Chain([m for _, m in leaves], [n for n, _ in leaves], blocks, shape)
