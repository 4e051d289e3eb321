"""Rank deficiency and the security metric of Chen & Campbell (2022), with R-GAP's structural count.

Chen & Campbell, "Analysing Training-Data Leakage from Gradients through Linear
Systems and Gradient Matching" (BMVC 2022):

* eq. (6)/(7): at convolutional layer i the input x_i satisfies the stacked system
  [W_circ; K(δ_i)] x_i = [z_i − b_i; vec(∇W_i)] (weight and gradient constraints,
  built by :mod:`leakbench.models.matrices`);
* Definition 3.3, eq. (12): rd_i = rank([W_circ; K]) − dim(x_i) ≤ 0 and, for L
  convolutional layers numbered from the input (i = 1 first),
  ``metric = Σ_i (L − i + 1)·rd_i / L``.  Fully connected layers are left out:
  Lemma 3.1 inverts them exactly.  Table 1 prints the metric rounded to an integer.

The rank is numerical (pivoted Cholesky of the Gram matrix of the smaller side,
float64, LAPACK's default tolerance n·ε·max diag) and generic in the weights: the
model's weights with seeded random upstream gradients δ_i reproduce Table 1; pass
a sample ``x`` (and label) to use the δ_i of its real backward pass instead.

R-GAP's rank analysis (Zhu & Blaschko, ICLR 2021, Sec. 3.3, "RA-i") counts instead
of ranks: unknowns u_i = dim(x_i) against weight constraints w_i = dim(z_i),
gradient constraints g_i = |W_i| and virtual constraints v_i, the surplus the
convolution above leaves (v_i = max(0, w + g + v − u) of layer i+1; 0 below the FC
layer).  There is no reference code; we report ``ra_i = u_i − (w_i + g_i + v_i)``
(> 0: under-determined by that many) as our reading of the paper.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from ..errors import ConfigError
from ..losses import get_loss
from ..models import build
from ..models.matrices import Chain, conv_geometry, gradient_matrix, layer_chain, weight_matrix

__all__ = ["LayerSecurity", "SecurityReport", "security_metric", "numerical_rank", "stacked_system"]


@dataclass
class LayerSecurity:
    """Eq. (6)–(12) quantities of one convolutional layer (``index`` 1 = first)."""

    index: int
    name: str
    kernel: int
    channels: int
    stride: int
    padding: int
    input_dim: int
    output_dim: int
    weight_rows: int
    gradient_rows: int
    rank: int
    rank_deficiency: int
    ra_unknowns: int
    ra_constraints: int
    ra_virtual: int
    ra_i: int


@dataclass
class SecurityReport:
    """Per-conv-layer rank deficiencies, the eq. (12) metric and R-GAP's structural count."""

    model: str
    input_shape: tuple[int, ...]
    layers: list[LayerSecurity]
    metric: float
    fc_input_dim: int | None
    upstream: str
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def rank_deficiencies(self) -> list[int]:
        return [layer.rank_deficiency for layer in self.layers]

    @property
    def ra_i(self) -> list[int]:
        return [layer.ra_i for layer in self.layers]

    @property
    def full_rank(self) -> bool:
        """True when every conv layer's system determines its input (metric 0)."""
        return all(rd == 0 for rd in self.rank_deficiencies)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["input_shape"] = list(self.input_shape)
        out["metric_rounded"] = int(round(self.metric))
        return out


def _scipy(t: torch.Tensor) -> sp.csr_matrix:
    t = t.coalesce().cpu()
    i = t.indices().numpy()
    return sp.csr_matrix((t.values().double().numpy(), (i[0], i[1])), shape=tuple(t.shape))


def numerical_rank(weight: sp.spmatrix | np.ndarray, grad: np.ndarray) -> int:
    """Numerical rank of the stacked matrix [weight; grad] (float64).

    The Gram matrix of the smaller side (AᵀA or AAᵀ, sparse products for the
    convolution block) is factorised by LAPACK's pivoted Cholesky ``dpstrf`` with
    its default tolerance; cheaper than an SVD at the sizes of Table 1.
    """
    w = sp.csr_matrix(weight, dtype=np.float64)
    g = np.asarray(grad, dtype=np.float64)
    rows, n = w.shape[0] + g.shape[0], w.shape[1]
    if rows >= n:
        gram = (w.T @ w).toarray() + g.T @ g
    else:
        wg = np.asarray(w @ g.T)
        gram = np.block([[(w @ w.T).toarray(), wg], [wg.T, g @ g.T]])
    if not gram.any():
        return 0
    from scipy.linalg import lapack  # here, not at import (~0.4 s per CLI start)

    _, _, rank, info = lapack.dpstrf(gram, lower=1, tol=-1.0)
    if info < 0:  # pragma: no cover - LAPACK argument error
        raise RuntimeError(f"dpstrf failed with info={info}")
    return int(rank)


def stacked_system(layer: nn.Conv2d, input_shape: Sequence[int], upstream: torch.Tensor
                   ) -> tuple[sp.csr_matrix, np.ndarray]:
    """The two blocks of eq. (6): sparse W_circ and dense K(δ) (float64)."""
    w = _scipy(weight_matrix(layer, input_shape, sparse=True, dtype=torch.float64))
    k = gradient_matrix(layer, input_shape, upstream.double(), sparse=True)
    return w, _scipy(k).toarray()


def _upstreams(chain: Chain, model: nn.Module, x: torch.Tensor | None, y: torch.Tensor | None,
               loss: str, seed: int) -> list[torch.Tensor]:
    """δ_i = ∂L/∂z_i for every conv block: from a real backward pass on (x, y), or seeded N(0, 1)."""
    convs = [b for b in chain.blocks if b.kind == "conv"]
    if x is None:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(int(math.prod(b.output_shape)), generator=gen, dtype=torch.float64) for b in convs]
    outputs: dict[int, torch.Tensor] = {}
    handles = [b.layer.register_forward_hook(lambda m, i, o, k=id(b.layer): outputs.__setitem__(k, o))  # noqa: B008 (binds each layer)
               for b in convs]
    try:
        out = model(x)
        zs = [outputs[id(b.layer)] for b in convs]
        grads = torch.autograd.grad(get_loss(loss)(out, y), zs)
    finally:
        for h in handles:
            h.remove()
    return [g.detach().reshape(-1).double() for g in grads]


def security_metric(model: str | nn.Module, input_shape: Sequence[int] | None = None, *, classes: int = 10,
                    act: str = "tanh", seed: int = 0, x: torch.Tensor | None = None,
                    y: torch.Tensor | None = None, loss: str = "ce") -> SecurityReport:
    """Rank deficiency per conv layer and the metric of eq. (12) for ``model`` on inputs of ``input_shape``.

    ``model`` is a spec (built as in the paper: tanh, bias-free convolutions, a biased
    FC layer, uniform initialisation seeded by ``seed``) or any chain of Conv2d /
    Linear / activation / Flatten layers.  Upstream gradients are seeded random
    vectors unless a sample ``x`` (1×C×H×W) and label ``y`` are given.
    """
    start = time.perf_counter()
    if isinstance(model, str):
        if input_shape is None:
            raise ConfigError("expected input_shape like (3, 32, 32) with a model spec (field input_shape)")
        net = build(model, input_shape=tuple(input_shape), classes=classes, act=act,
                    bias={"conv": False, "linear": True}, init="uniform", seed=seed, dtype=torch.float64)
        name = model
    elif isinstance(model, nn.Module):
        net = model
        name = getattr(model, "spec", type(model).__name__)
        input_shape = input_shape if input_shape is not None else getattr(model, "input_shape", None)
        if input_shape is None:
            raise ConfigError(f"expected input_shape for a {type(model).__name__} without .input_shape "
                              "(field input_shape)")
    else:
        raise ConfigError(f"expected a model spec or an nn.Module, got {type(model).__name__} (field model)")
    shape = tuple(int(s) for s in input_shape)
    if x is not None and (y is None or x.dim() != len(shape) + 1 or x.shape[0] != 1):
        raise ConfigError("expected x as one sample 1×C×H×W with its label y (fields x, y)")
    chain = layer_chain(net, shape)
    ref = next(iter(net.parameters()))
    if x is not None:
        x = x.to(ref.device, ref.dtype)
        y = y.to(ref.device)
    deltas = _upstreams(chain, net, x, y, loss, seed)
    convs = [b for b in chain.blocks if b.kind == "conv"]
    count = len(convs)
    layers: list[LayerSecurity] = []
    for i, (block, delta) in enumerate(zip(convs, deltas), start=1):
        geo = conv_geometry(block.layer, block.input_shape)
        w, k = stacked_system(block.layer, block.input_shape, delta)
        rank = numerical_rank(w, k)
        layers.append(LayerSecurity(
            index=i, name=block.name, kernel=geo.kernel[0], channels=geo.out_channels, stride=geo.stride[0],
            padding=geo.padding[0], input_dim=geo.in_dim, output_dim=geo.out_dim, weight_rows=geo.out_dim,
            gradient_rows=geo.weight_numel, rank=rank, rank_deficiency=rank - geo.in_dim,
            ra_unknowns=geo.in_dim, ra_constraints=geo.out_dim + geo.weight_numel, ra_virtual=0, ra_i=0))
    virtual = 0  # R-GAP: the surplus of the conv layer above becomes virtual constraints below
    for layer in reversed(layers):
        layer.ra_virtual = virtual
        layer.ra_i = layer.ra_unknowns - (layer.ra_constraints + virtual)
        virtual = max(0, -layer.ra_i)
    metric = sum((count - i + 1) * layer.rank_deficiency for i, layer in enumerate(layers, start=1)) / max(count, 1)
    fcs = [b for b in chain.blocks if b.kind == "linear"]
    notes = [] if convs else ["no convolution: fully connected layers are inverted exactly (Lemma 3.1)"]
    return SecurityReport(model=str(name), input_shape=shape, layers=layers, metric=float(metric),
                          fc_input_dim=fcs[-1].input_dim if fcs else None,
                          upstream="random (seeded)" if x is None else "backward pass of x",
                          seconds=time.perf_counter() - start, notes=notes)
