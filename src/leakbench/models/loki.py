"""LOKI's customised models (Zhao, Sharma, Elkordy, Ezzeldin, Avestimehr & Bagchi, "LOKI: Large-scale Data
Reconstruction Attack against Federated Learning through Model Manipulation", IEEE S&P 2024).

Under secure aggregation the server sees only Σ_l Δθ_l over its L clients, so one imprint block (Robbing the
Fed) mixes every client's samples in the same bins.  LOKI's move is to send every client its *own* model: a
convolution in front of an imprint-style FC layer, whose kernels are scaled identity kernels in the channels the
server assigned to that client and zero in all the others.  Client l's convolution therefore copies its image
into its own channel set and nothing anywhere else, so the FC layer's weight gradient, read column-block by
column-block, holds each client's contribution separately even after the sum (the numbering below is ours; the
paper's text is not in ``papers/`` and this follows its published description of the construction):

    (L1)  h^(l)(x) = conv_l(x):  channels S_l = {l(C+1), …, l(C+1)+C−1} hold s·x (kernel e_center · s per input
          channel, s the convolutional scaling factor), channel l(C+1)+C holds the constant 1 (the conv bias),
          every channel of another client is 0;
    (L2)  z_k = Σ_m ⟨q, h^(l)_{S_m}⟩ − s·c_k·h^(l)_{off_m} = s(⟨q, x⟩ − c_k)   (one query q, K bins, edges c_k at
          the equal-mass quantiles of ⟨q, x⟩ over public data, as Robbing the Fed's imprint);
    (L3)  out = x + V·ReLU(z) with V's columns equal (each active bin of a sample gets the same upstream g_i);
    (L4)  Σ_l ∇W_k|_{S_m} = s Σ_{i ∈ client m, ⟨q,x_i⟩ > c_k} g_i x_i,   Σ_l ∇W_k|_{off_m} = Σ_{i ∈ client m, …} g_i,
          since h^(l) vanishes on S_m and off_m for l ≠ m;
    (L5)  x_i = (∇W_k − ∇W_{k+1})|_{S_m} / (s · (∇W_k − ∇W_{k+1})|_{off_m})   for a sample of client m alone in
          its bin k, exactly, under the secure sum.

The constant channel (L1) is our realisation of the per-client bias of (L5): the FC layer's own bias is one
parameter shared by all clients, so after the sum its gradient mixes them; a bias carried by each client's own
conv channel keeps it separate (LOKI's reference code instead normalises each recovered image to [0, 1], which
loses its scale).  Under FedAvg local steps each client's rows and kernels move by O(lr·gain), so (L5) holds
up to that drift for a sample that stays alone in its bin (the conv scaling factor s keeps the client's own
signal large next to it, the role the paper gives it).

:func:`client_parameters` is the per-client hook the client round (:func:`leakbench.defenses.share`) applies:
any submodule with a ``client_overrides(index)`` method gives the values of its parameters in the model sent to
client ``index``; the model as shipped (and as the attacker holds it) is client 0's.
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .malicious import _copy_attributes, _input_shape, _param_device, _public

__all__ = ["LokiBlock", "loki", "client_parameters"]


class LokiBlock(nn.Module):
    """x ↦ x + V·ReLU(W·conv_l(x)) for client l: (L1)–(L3) of the module docstring.

    ``conv`` holds client 0's kernels (the model as shipped); :meth:`client_overrides` gives client l's.
    ``fc0`` (K × L(C+1)HW, no bias) holds q on every client's image channels and −s·c_k on the first position
    of every client's constant channel; ``fc1`` maps the K bins back to data size with equal columns.
    """

    def __init__(self, input_shape: Sequence[int], clients: int, query: torch.Tensor, thresholds: torch.Tensor,
                 *, scale: float = 1.0, slope: float = 1e-3, gain: float = 1.0) -> None:
        super().__init__()
        self.input_shape = tuple(int(s) for s in input_shape)
        c, h, w = self.input_shape
        self.clients, self.channels, self.pixels = int(clients), c, h * w
        bins = int(thresholds.numel())
        self.bins, self.scale, self.slope = bins, float(scale), float(slope)
        self.conv = nn.Conv2d(c, self.clients * (c + 1), 3, padding=1)
        self.fc0 = nn.Linear(self.clients * (c + 1) * h * w, bins, bias=False)
        self.fc1 = nn.Linear(bins, c * h * w)
        self.register_buffer("query", query.detach().clone().reshape(c * h * w))
        self.register_buffer("thresholds", thresholds.detach().clone().reshape(bins))
        with torch.no_grad():
            weight, bias = self.kernels(0)
            self.conv.weight.copy_(weight)
            self.conv.bias.copy_(bias)
            rows = torch.zeros(bins, self.clients, c + 1, h * w, dtype=torch.float64)
            rows[:, :, :c, :] = self.query.double().reshape(1, 1, c, h * w) * (self.slope / self.scale)
            rows[:, :, c, 0] = -self.thresholds.double()[:, None] * (self.slope / self.scale)
            self.fc0.weight.copy_(rows.reshape(bins, -1))
            self.fc1.weight.fill_(gain / bins)
            self.fc1.bias.zero_()

    def kernels(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv weight, conv bias) of client ``index``: scaled identity kernels into its channels, a constant 1 on
        its offset channel, zero everywhere else (L1)."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.clients:
            raise ConfigError(f"this LOKI model was customised for {self.clients} client(s), got client {index!r}: "
                              f"build it with clients=L for secagg:L (argument clients)")
        c = self.channels
        weight = torch.zeros(self.clients * (c + 1), c, 3, 3, dtype=torch.float64)
        first = index * (c + 1)
        weight[first + torch.arange(c), torch.arange(c), 1, 1] = self.scale
        bias = torch.zeros(self.clients * (c + 1), dtype=torch.float64)
        bias[first + c] = self.scale
        return weight, bias

    def client_overrides(self, index: int) -> dict[str, torch.Tensor]:
        """Parameter name (relative to this block) → its value in the model sent to client ``index``."""
        weight, bias = self.kernels(index)
        like = self.conv.weight
        return {"conv.weight": weight.to(like.device, like.dtype), "conv.bias": bias.to(like.device, like.dtype)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc0(self.conv(x.reshape(x.shape[0], *self.input_shape)).flatten(1))
        return (x.reshape(x.shape[0], -1) + self.fc1(torch.relu(z))).reshape(x.shape)

    def bin_of(self, x: torch.Tensor) -> torch.Tensor:
        """The bin of every sample of ``x``: the highest k with ⟨q, x⟩ > c_k."""
        scores = x.detach().reshape(x.shape[0], -1).to(self.query) @ self.query
        return ((scores[:, None] > self.thresholds[None, :]).sum(1) - 1).clamp_min(0)

    def split(self, grad_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, L, C·H·W) image blocks and (K, L) offset entries of a gradient of ``fc0.weight`` (L4)."""
        c = self.channels
        rows = grad_w.reshape(self.bins, self.clients, c + 1, self.pixels)
        return rows[:, :, :c, :].reshape(self.bins, self.clients, c * self.pixels), rows[:, :, c, 0]


def loki(model: nn.Module, *, clients: int, bins: int, scale: float = 1.0, slope: float = 1e-3, seed: int = 0,
         calibration: object | None = None, gain: float = 1.0,
         input_shape: Sequence[int] | None = None) -> nn.Sequential:
    """The model the server ships to client 0: ``Sequential(loki=LokiBlock, model=copy of model)``; client l
    trains the same model with :meth:`LokiBlock.client_overrides` (l) (see :func:`client_parameters`).

    ``clients`` L ≥ 1 (the clients of ``secagg:L``), ``bins`` K ≥ 2, ``scale`` s > 0 (the identity kernels'
    factor), ``calibration``: public images (N ≥ K, the dataset's shape C×H×W) whose ⟨q, x⟩ quantiles place the
    K bins' edges (the query q is a unit Gaussian direction from ``seed``).  ``slope`` ε scales the bins,
    z_k = ε(⟨q, x⟩ − c_k), and ``gain`` V's columns (gain/K): a small ε with gain 1 keeps V's columns nearly
    equal through FedAvg's local steps (V's gradient is ∝ ReLU(z), its columns ∝ gain), which (L5) needs; the
    block's output then differs from x by ε·gain·mean_k ReLU(⟨q, x⟩ − c_k), about 10⁻² on digits.  (Our
    choice, scanned on digits B = 64: ε = 1, gain = 10⁻³ — the imprint's values — loses every sample after one
    minibatch step, V's columns no longer being equal.)
    """
    shape = _input_shape(model, input_shape)
    if len(shape) != 3:
        raise ConfigError(f"loki convolves images C×H×W, got input_shape {shape!r} (argument input_shape)")
    for value, name, low in ((clients, "clients", 1), (bins, "bins", 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"expected {name} ≥ {low} (an integer), got {value!r} (argument {name})")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ConfigError(f"expected scale > 0 (the identity kernels' factor), got {scale!r} (argument scale)")
    for value, name in ((slope, "slope"), (gain, "gain")):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"expected {name} > 0, got {value!r} (argument {name})")
    if calibration is None:
        raise ConfigError("loki needs public images to place its bins (argument calibration, N ≥ bins images of the "
                          "data's shape)")
    public = _public(calibration, shape, bins, "calibration")
    d = math.prod(shape)
    q = torch.randn(d, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
    q = q / q.norm()
    scores = public.reshape(public.shape[0], -1).double().cpu() @ q
    inner = torch.quantile(scores, torch.arange(1, bins, dtype=torch.float64) / bins)
    floor = -q.abs().sum() * max(1.0, float(public.abs().max())) - 1.0  # bin 0 fires for every input in the box
    block = LokiBlock(shape, clients, q, torch.cat([floor.reshape(1), inner]), scale=float(scale), slope=float(slope),
                      gain=float(gain))
    device, dtype = _param_device(model)
    shipped = nn.Sequential(OrderedDict(loki=block.to(device=device, dtype=dtype), model=copy.deepcopy(model)))
    _copy_attributes(model, shipped, shape)
    return shipped


def client_parameters(model: nn.Module, params: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """``params`` as client ``index`` receives them: every submodule with a ``client_overrides(index)`` method
    replaces its parameters' values (an honest model: ``params`` unchanged)."""
    overrides: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        hook = getattr(module, "client_overrides", None)
        if callable(hook):
            overrides.update({f"{prefix}.{n}" if prefix else n: v for n, v in hook(index).items()})
    if not overrides:
        return params
    missing = sorted(set(overrides) - set(params))
    if missing:
        raise ConfigError(f"the per-client parameters {missing} are not trainable in this model; the clients' "
                          "customised layers must be shared (requires_grad=True)")
    return {n: overrides.get(n, p) for n, p in params.items()}
