"""Model modifications a malicious (or curious) server ships to its clients.

Each function takes a model and returns the modified copy the server sends
(the caller's model is never changed); every random draw comes from ``seed``::

    model = imprint(model, bins=64, seed=0)
    obs = lb.observe(model, x, y)          # the attack finds the block in obs.model

- :func:`imprint` — the imprint block of Fowl et al. ("Robbing the Fed", ICLR 2022,
  Sec. 3): placed *before* the model, a linear layer of K bins that all share one
  query direction q, biases at the equal-mass quantiles of the query's distribution
  (bin k fires for ⟨q, x⟩ > c_k), a ReLU, then a linear layer back to data size whose
  columns are all equal, so every active bin of a sample receives the same upstream
  gradient.  A sample alone between c_k and c_{k+1} is then exactly
  (∇W_k − ∇W_{k+1}) / (∇b_k − ∇b_{k+1}).  The server calibrates the edges on public
  data it plausibly holds (Fowl et al. use the quantiles of the data distribution): a
  held-out slice of the same dataset, or another offline dataset of the same shape;
  without one it warns and assumes i.i.d. uniform pixels.  ``block.masses`` are the
  bins' probability masses measured on public data the edges were not fitted to
  (``holdout``), which :func:`leakbench.analysis.imprint_expected` turns into the
  expected recovery.
- :func:`imprint_text` — the same block on a text transformer's input vectors h⁰ = E[v] + P[t]
  (``model.pre``): every token position is one "sample" of Fowl et al.'s construction, so a
  position alone in its bin gives h⁰ exactly, hence its token and its position (the table
  E[v] + P[t] is public).  Edges at equal-mass quantiles of ⟨q, h⁰⟩ over public text's positions.
  With ``signature=r`` (Decepticons, Fowl et al. ICLR 2023): block 1's attention is made uniform (Q = K = 0)
  and writes a map of each token's LN₁ input averaged over the prefix (the sentence, for an encoder) into r
  reserved dimensions, and the block sits after that attention (``blocks[0].mid``), so each recovered vector
  carries its sentence's signature; ``text-imprint`` groups the pairs into sentences by it.
- :func:`random_head` — the partly random penultimate layer of Liu et al. (2024,
  App. F, "Technical details on feature reconstruction"): the head A σ(W z) is split into
  a trained part (here the model's own head, kept exactly) and v neurons with random
  Gaussian W₂ whose output rows are constants, A₂[i, :] = i / v, as the tensor method
  of Wang et al. (2023) requires.  The features z are the head's input; ``center=`` (a
  documented departure, off by default) feeds the random neurons z − μ for a fixed μ.

Trap weights (Boenisch et al. 2023) and class fishing (Wen et al. 2022), which change the weights of the
model itself rather than add a block, are in :mod:`leakbench.models.active`.
"""
from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict
from statistics import NormalDist
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .layers import activation

__all__ = ["ImprintBlock", "RandomFeatureHead", "imprint", "imprint_text", "random_head", "QUERIES", "CENTERS",
           "find_module", "UncalibratedImprintWarning"]

#: Query directions of the imprint block: a seeded Gaussian direction, or the mean brightness.
QUERIES = ("randn", "mean")


class ImprintBlock(nn.Module):
    """x ↦ x + V·ReLU(W x + b) with W's K rows all equal to the query q and V's columns all equal.

    ``thresholds[k]`` = c_k (bin k fires when ⟨q, x⟩ > c_k; c_0 lies below every input in the
    data box, so bin 0 always fires); ``b = −c``.  ``gain`` scales V so the model behind the
    block sees nearly the raw input.  ``masses[k]`` is the server's estimate of the probability
    that a sample falls in bin k (``masses_source`` says on which data it was measured);
    :meth:`bin_masses` measures them on any sample.
    """

    def __init__(self, input_shape: Sequence[int], query: torch.Tensor, thresholds: torch.Tensor,
                 *, gain: float = 1e-3, masses: torch.Tensor | None = None,
                 masses_source: str = "assumed equal") -> None:
        super().__init__()
        self.input_shape = tuple(int(s) for s in input_shape)
        d = math.prod(self.input_shape)
        bins = int(thresholds.numel())
        self.bins = bins
        self.linear0 = nn.Linear(d, bins)
        self.linear1 = nn.Linear(bins, d)
        self.register_buffer("query", query.detach().clone().reshape(d))
        self.register_buffer("thresholds", thresholds.detach().clone().reshape(bins))
        equal = torch.full((bins,), 1.0 / bins, dtype=torch.float64)
        self.register_buffer("masses", equal if masses is None else masses.detach().double().clone().reshape(bins))
        self.masses_source = masses_source
        self.masses_samples: int | None = None  # size of the held-out sample the masses were counted on
        with torch.no_grad():
            self.linear0.weight.copy_(self.query.expand(bins, d))
            self.linear0.bias.copy_(-self.thresholds)
            self.linear1.weight.fill_(gain / bins)
            self.linear1.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1)
        out = flat + self.linear1(torch.relu(self.linear0(flat)))
        return out.reshape(x.shape)

    def bin_of(self, x: torch.Tensor) -> torch.Tensor:
        """The bin of every sample of ``x`` (N×input_shape): the highest k with ⟨q, x⟩ > c_k."""
        scores = x.detach().reshape(x.shape[0], -1).to(self.query) @ self.query
        return ((scores[:, None] > self.thresholds[None, :]).sum(1) - 1).clamp_min(0)

    def bin_masses(self, x: torch.Tensor) -> torch.Tensor:
        """Fraction of the samples of ``x`` in each bin (float64, sums to 1)."""
        return torch.bincount(self.bin_of(x).cpu(), minlength=self.bins).double() / x.shape[0]


class RandomFeatureHead(nn.Module):
    """head(z) + A₂ σ(W₂ (z − μ)): the model's head kept exactly plus v random-feature neurons.

    ``random`` (W₂, v×d, no bias) is drawn N(0, std²); ``out`` (A₂, K×v, no bias) has rows
    A₂[i, :] = scale·i / v, i = 1..K (Liu et al. 2024, App. F).  ``center`` (buffer μ, d, or None)
    is a fixed shift the server subtracts before the random layer — a departure from App. F (see
    :func:`random_head`); the features of the tensor method are the input of ``random``,
    z − μ (z without a centre), and the tensor attack reads the gradient of ``out.weight``.
    """

    def __init__(self, head: nn.Linear, width: int, *, act: str = "relu", std: float = 1.0,
                 scale: float = 1.0, generator: torch.Generator, center: torch.Tensor | None = None) -> None:
        super().__init__()
        d, k = head.in_features, head.out_features
        self.head = head
        self.random = nn.Linear(d, width, bias=False)
        self.act = activation(act)
        self.out = nn.Linear(width, k, bias=False)
        self.width = width
        dev, dt = head.weight.device, head.weight.dtype
        with torch.no_grad():
            w = torch.randn((width, d), generator=generator, dtype=torch.float64) * std
            self.random.weight.copy_(w.to(dev, dt))
            # Liu et al. App. F: "each row i of A_2 is initialized to a constant value of i/v" (i = 1..K).
            rows = torch.arange(1, k + 1, dtype=torch.float64) * (scale / width)
            self.out.weight.copy_(rows[:, None].expand(k, width).to(dev, dt))
        self.random.to(dev, dt)
        self.out.to(dev, dt)
        self.register_buffer("center", None if center is None else center.detach().reshape(d).to(dev, dt).clone())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        u = z if self.center is None else z - self.center
        return self.head(z) + self.out(self.act(self.random(u)))


def find_module(model: nn.Module, kind: type) -> nn.Module | None:
    """The first submodule of ``model`` (itself included) of type ``kind``, or None."""
    return next((m for m in model.modules() if isinstance(m, kind)), None)


def _input_shape(model: nn.Module, input_shape: Sequence[int] | None) -> tuple[int, ...]:
    shape = input_shape if input_shape is not None else getattr(model, "input_shape", None)
    if shape is None:
        raise ConfigError("expected input_shape for a model without an input_shape attribute "
                          "(argument input_shape, e.g. (3, 32, 32))")
    shape = tuple(shape)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
        raise ConfigError(f"expected input_shape as positive sizes, got {shape!r} (argument input_shape)")
    return shape


def _copy_attributes(source: nn.Module, target: nn.Module, input_shape: tuple[int, ...]) -> None:
    target.input_shape = input_shape
    for name in ("classes", "act"):
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))


def _param_device(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(iter(model.parameters()), None)
    return (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)


class UncalibratedImprintWarning(UserWarning):
    """The imprint block's edges assume i.i.d. uniform pixels: no public calibration sample was given."""


_WARNED: set[str] = set()


def _public(value: object, shape: tuple[int, ...], minimum: int, field: str) -> torch.Tensor:
    """Public samples as an N×shape tensor (a tensor, or a dataset with ``.images``)."""
    value = getattr(value, "images", value)
    if not isinstance(value, torch.Tensor) or tuple(value.shape[1:]) != shape or value.shape[0] < minimum:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"expected {field} samples of shape (N ≥ {minimum}, {', '.join(map(str, shape))}) "
                          f"(a tensor or a dataset with .images), got {got} (argument {field})")
    return value.detach()


def imprint(model: nn.Module, *, bins: int, query: str = "randn", seed: int = 0,
            calibration: object | None = None, holdout: object | None = None,
            mean: float | None = None, std: float | None = None,
            data_range: tuple[float, float] = (0.0, 1.0), gain: float = 1e-3,
            input_shape: Sequence[int] | None = None) -> nn.Sequential:
    """The model the server ships: ``Sequential(imprint=ImprintBlock, model=copy of model)``.

    ``bins`` K ≥ 2.  ``query``: "randn" (a unit Gaussian direction from ``seed``) or "mean"
    (average brightness).  The bin edges are the equal-mass quantiles c_k, k = 1..K−1, of
    the query score s = ⟨q, x⟩ as the server models it: the empirical quantiles of
    ``calibration`` — public samples the server holds (N×input_shape, or a dataset with
    ``.images``): a held-out slice of the clients' dataset or another offline dataset — else
    N(``mean``, ``std``²), else the Gaussian approximation of pixels i.i.d. uniform on
    ``data_range``, with an :class:`UncalibratedImprintWarning` (once per process): real
    images are far from uniform, and such edges crowd them into a few bins (digits, K = 8:
    one bin holds 60 % of the images).

    ``block.masses`` are the bins' masses measured on ``holdout`` (more public samples, not
    used for the edges: the realised masses, unequal because quantiles of N samples are
    noisy), else on ``calibration`` (equal by construction, hence optimistic), else 1/K.
    ``imprint_expected(block, B)`` is then the expected recovery (unbiased from the holdout counts).
    """
    shape = _input_shape(model, input_shape)
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2:
        raise ConfigError(f"expected bins ≥ 2 (an integer), got {bins!r} (argument bins)")
    if query not in QUERIES:
        raise ConfigError(f"expected query in {QUERIES}, got {query!r} (argument query)")
    lo, hi = (float(v) for v in data_range)
    if not hi > lo:
        raise ConfigError(f"expected data_range (lo, hi) with hi > lo, got {data_range!r} (argument data_range)")
    if not gain > 0:
        raise ConfigError(f"expected gain > 0, got {gain!r} (argument gain)")
    d = math.prod(shape)
    gen = torch.Generator().manual_seed(int(seed))
    if query == "randn":
        q = torch.randn(d, generator=gen, dtype=torch.float64)
    else:
        q = torch.ones(d, dtype=torch.float64)
    q = q / q.norm()
    levels = torch.arange(1, bins, dtype=torch.float64) / bins
    public = _public(calibration, shape, bins, "calibration") if calibration is not None else None
    assumption = "score N(mean, std²)"
    held = _public(holdout, shape, 1, "holdout") if holdout is not None else None
    if public is not None:
        scores = public.reshape(public.shape[0], -1).double().cpu() @ q
        inner = torch.quantile(scores, levels)
    else:
        if (mean is None) != (std is None):
            raise ConfigError("expected both mean and std of the query score, or neither (arguments mean, std)")
        if mean is None:
            if "uniform" not in _WARNED:
                _WARNED.add("uniform")
                warnings.warn("imprint() got no public calibration sample: its bin edges assume pixels i.i.d. "
                              "uniform on the data range, which real images are not, so samples crowd into a few "
                              "bins and imprint_expected over-predicts recovery. Pass calibration=<public images> "
                              "(e.g. a held-out slice of the dataset) and holdout=<more public images>.",
                              UncalibratedImprintWarning, stacklevel=2)
            assumption = "pixels i.i.d. uniform"
            mean, std = (lo + hi) / 2 * float(q.sum()), (hi - lo) / math.sqrt(12.0)
        if not std > 0:
            raise ConfigError(f"expected std > 0, got {std!r} (argument std)")
        dist = NormalDist(float(mean), float(std))
        inner = torch.tensor([dist.inv_cdf(float(p)) for p in levels], dtype=torch.float64)
    # c_0 below every input in the box: bin 0 fires for every sample (Fowl et al.'s "−∞" edge).
    floor = -(q.abs().sum() * max(abs(lo), abs(hi))) - 1.0
    thresholds = torch.cat([floor.reshape(1), inner])
    device, dtype = _param_device(model)
    block = ImprintBlock(shape, q, thresholds, gain=gain)
    for sample, source in ((held, "holdout"), (public, "calibration")):
        if sample is not None:
            block.masses.copy_(block.bin_masses(sample.cpu()))
            block.masses_source = source
            block.masses_samples = int(sample.shape[0]) if source == "holdout" else None
            break
    else:
        block.masses_source = f"assumed equal ({assumption})"
    masses = block.masses.clone()
    block = block.to(device=device, dtype=dtype)
    block.masses = masses.to(device)  # probabilities stay float64
    shipped = nn.Sequential(OrderedDict(imprint=block, model=copy.deepcopy(model)))
    _copy_attributes(model, shipped, shape)
    return shipped


def _head(model: nn.Module, shape: tuple[int, ...]) -> tuple[str, nn.Linear]:
    """Name and module of the final nn.Linear whose output is the model's output."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError("random_head needs a model whose last layer is an nn.Linear, found no nn.Linear")
    name, head = linears[-1]
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda m, i, o: captured.append(o))
    device, dtype = _param_device(model)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            probe = torch.rand((2, *shape), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            out = model(probe.to(device, dtype))
    finally:
        handle.remove()
        model.train(was)
    if not captured or captured[-1].shape != out.shape or not torch.equal(captured[-1], out):
        raise ConfigError(f"random_head needs a model whose output is its last nn.Linear ({name!r}); "
                          "this model transforms that layer's output further")
    return name, head


CENTERS = (None, "noise", "calibration")


def _layer_inputs(model: nn.Module, layer: nn.Module, inputs: torch.Tensor, *, train: bool = False,
                  chunk: int = 256) -> torch.Tensor:
    """The input of ``layer`` (a module of ``model``, or ``model`` itself) for each of ``inputs`` (N × width, float64
    on the model's device), without gradients, ``chunk`` at a time.  In train mode (the client's, with BatchNorm) a
    throw-away copy runs, since train mode moves the running statistics; in eval mode the model runs and gets its
    mode back."""
    probe = copy.deepcopy(model) if train else model
    names = {id(m): n for n, m in model.named_modules()}
    target = probe.get_submodule(names[id(layer)])
    seen: list[torch.Tensor] = []
    handle = target.register_forward_pre_hook(lambda _m, i: seen.append(i[0].detach().reshape(i[0].shape[0], -1)))
    device, dtype = _param_device(model)
    was = probe.training
    probe.train(train)
    try:
        with torch.no_grad():
            for s in range(0, inputs.shape[0], chunk):
                probe(inputs[s:s + chunk].to(device, dtype))
    finally:
        handle.remove()
        probe.train(was)
    return torch.cat(seen).double()


def random_head(model: nn.Module, *, width: int = 4096, seed: int = 0, act: str = "relu", std: float = 1.0,
                scale: float = 1.0, center: str | None = None, calibration: torch.Tensor | None = None,
                data_range: tuple[float, float] = (0.0, 1.0), train: bool = True, center_batch: int = 8,
                input_shape: Sequence[int] | None = None) -> nn.Module:
    """A copy of ``model`` whose final linear layer becomes a :class:`RandomFeatureHead` of ``width`` random neurons.

    Liu et al. (2024, App. F) use 14 336 random neurons on 512 features; the tensor step's
    error scales as B·sqrt(d / width) (Theorem 3.1), so choose ``width`` ≫ d·B².

    ``center`` — a departure from App. F, off by default (``None``, the paper's block σ(W₂ z)):
    the block becomes σ(W₂ (z − μ)) with μ a fixed vector the server computes before shipping,
    the mean penultimate feature of ``calibration`` samples (``"calibration"``, N × input_shape,
    public data as for :func:`imprint`) or of ``32·center_batch`` seeded inputs uniform on
    ``data_range`` (``"noise"``, data-free), computed in batches of ``center_batch`` in training
    (``train``) or evaluation mode as the client will run the model.  Why: App. F uses a trained
    ResNet-18, whose features differ; the post-ReLU, pooled features of small or untrained CNNs
    share a large common component (pairwise cosines 0.8–0.999), which makes the rank-B
    decomposition ill-conditioned and the 1 − cos² feature term nearly blind to which image is
    which.  Removing a common μ keeps the trained head exact and the tensor method unchanged (its
    features are then z − μ, the input of ``random``).
    """
    shape = _input_shape(model, input_shape)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ConfigError(f"expected width ≥ 1 random neurons, got {width!r} (argument width)")
    if not std > 0 or not scale > 0:
        raise ConfigError(f"expected std > 0 and scale > 0, got std={std!r}, scale={scale!r}")
    if center not in CENTERS:
        raise ConfigError(f"expected center in {CENTERS}, got {center!r} (argument center)")
    if isinstance(center_batch, bool) or not isinstance(center_batch, int) or center_batch < 2:
        raise ConfigError(f"expected center_batch ≥ 2 (an integer), got {center_batch!r} (argument center_batch)")
    shipped = copy.deepcopy(model)
    name, head = _head(shipped, shape)
    mu = None
    if center == "calibration":
        if not isinstance(calibration, torch.Tensor) or tuple(calibration.shape[1:]) != shape \
                or calibration.shape[0] < 2:
            got = tuple(calibration.shape) if isinstance(calibration, torch.Tensor) else type(calibration).__name__
            raise ConfigError(f"expected calibration samples of shape (N ≥ 2, {', '.join(map(str, shape))}) "
                              f"for center='calibration', got {got} (argument calibration)")
        mu = _layer_inputs(shipped, head, calibration.detach(), train=train, chunk=center_batch).mean(0)
    elif center == "noise":
        lo, hi = (float(v) for v in data_range)
        if not hi > lo:
            raise ConfigError(f"expected data_range (lo, hi) with hi > lo, got {data_range!r} (argument data_range)")
        gen = torch.Generator().manual_seed(int(seed) + 1)
        noise = lo + (hi - lo) * torch.rand((32 * center_batch, *shape), generator=gen, dtype=torch.float64)
        mu = _layer_inputs(shipped, head, noise, train=train, chunk=center_batch).mean(0)
    block = RandomFeatureHead(head, width, act=act, std=std, scale=scale,
                              generator=torch.Generator().manual_seed(int(seed)), center=mu)
    if name == "":
        shipped = block
    else:
        parent_name, _, leaf = name.rpartition(".")
        parent = shipped.get_submodule(parent_name) if parent_name else shipped
        setattr(parent, leaf, block)
    _copy_attributes(model, shipped, shape)
    return shipped


#: most bins of a text imprint block (its first layer is bins × width)
MAX_TEXT_BINS = 65536


def imprint_text(model: nn.Module, bins: int = 1024, *, seed: int = 0, public: torch.Tensor | None = None,
                 gain: float = 1e-3, signature: int = 0) -> nn.Module:
    """A copy of a text transformer carrying the server's imprint block (and, with ``signature``, a signature attention).

    ``signature=0`` (Robbing the Fed, Fowl et al. ICLR 2022, Sec. 3, per token position): the block sits on the
    input vectors h⁰ = E[v] + P[t] (``model.pre``): K bins ReLU(⟨q, h⁰⟩ − c_k) with one seeded Gaussian query q,
    edges c_1 < … < c_{K−1} at the equal-mass quantiles of ⟨q, h⁰⟩ over the non-padding positions of ``public``
    (N × T ids of public text, e.g. the bundled training split), else over every (token, position) pair of the
    public table; c_0 lies below every vector, so bin 0 always fires.  A position alone in its bin is recovered
    exactly by ``text-imprint``.

    ``signature=r`` (Decepticons, Fowl et al. ICLR 2023, Sec. 3): the server also changes *parameters* so that
    block 1's attention writes a sentence signature into r dimensions R it reserves (the last r), and places
    the imprint block after that attention (``blocks[0].mid``, on h¹ = h⁰ + Attn(LN₁ h⁰)):

    - E[:, R] = P[:, R] = 0, so h⁰ lives on the other width − r dimensions;
    - Q = K = 0 (weights and biases of block 1's ``qkv``): every score is 0 and the softmax is uniform over the
      allowed keys, j ≤ t for ``gpt:``, the non-padding positions for ``bert:``;
    - V = LN₁(h⁰) (identity value projection, no bias) and W_o = G, a seeded Gaussian map into R (zero outside R,
      no bias), scaled so its entries match the table's:  x_j = G·LN₁(h⁰_j),  h¹_t = h⁰_t + mean_{j ≤ t} x_j.

    The edges are quantiles of ⟨q, h¹⟩ over ``public`` text (else 256 seeded sequences of uniform tokens).  The
    shipped model is a different model from the caller's (block 1 no longer attends by content, r embedding
    dimensions are zero): the malicious-server threat model.  ``r`` must leave width to spare: 1 ≤ r ≤ width/2.
    """
    from .transformers import TextTransformer

    if not isinstance(model, TextTransformer):
        raise ConfigError(f"expected a leakbench text transformer (gpt:/bert: spec), got {type(model).__name__} "
                          "(argument model)")
    if not (isinstance(bins, int) and not isinstance(bins, bool) and 2 <= bins <= MAX_TEXT_BINS):
        raise ConfigError(f"expected bins in 2..{MAX_TEXT_BINS}, got {bins!r} (argument bins)")
    if not (isinstance(gain, float) and 0 < gain <= 1):
        raise ConfigError(f"expected gain in (0, 1], got {gain!r} (argument gain)")
    if not (isinstance(signature, int) and not isinstance(signature, bool) and 0 <= signature <= model.width // 2):
        raise ConfigError(f"expected signature in 0..{model.width // 2} (reserved dimensions, at most half the width "
                          f"{model.width}), got {signature!r} (argument signature); 0: no sentence signature")
    out = copy.deepcopy(model)
    if out.modified:
        raise ConfigError("expected an honest model, got one that already carries a server's block (argument model)")
    weight = out.tok.weight
    d = out.width
    gen = torch.Generator().manual_seed(int(seed))
    q = torch.randn(d, generator=gen, dtype=torch.float64)
    q = q / q.norm()
    if public is not None:
        if not (isinstance(public, torch.Tensor) and public.dim() == 2 and not public.is_floating_point()):
            raise ConfigError("expected public token ids as an integer tensor N × T (argument public)")
        out.check_tokens(public, field="public")
    if signature:
        reserved = torch.arange(d - signature, d)
        bound = _signature_attention(out, reserved, gen)
        ids = public.cpu() if public is not None else _random_text(out, gen)
        keep = ids != out.pad_id
        scores = []
        with torch.no_grad():
            for s in range(0, ids.shape[0], 256):
                h = out.attended(ids[s:s + 256].to(weight.device)).double().cpu()
                scores.append((h @ q)[keep[s:s + 256]])
        scores = torch.cat(scores)
        if scores.numel() < bins:
            raise ConfigError(f"expected at least {bins} public positions to place {bins} edges, got "
                              f"{scores.numel()} (argument public); give more public text or fewer bins")
        low = -bound - 1.0  # |⟨q, h¹⟩| ≤ ‖h¹‖ ≤ bound for every input: bin 0 always fires
    else:
        with torch.no_grad():
            tok_s = out.tok.weight.detach().double().cpu() @ q     # ⟨q, E[v]⟩
            pos_s = out.pos.weight.detach().double().cpu() @ q     # ⟨q, P[t]⟩
        if public is not None:
            ids = public.cpu()
            keep = ids != out.pad_id
            scores = (tok_s[ids] + pos_s[: ids.shape[1]])[keep]
            if scores.numel() < bins:
                raise ConfigError(f"expected at least {bins} public positions to place {bins} edges, got "
                                  f"{scores.numel()} (argument public); give more public text or fewer bins")
        else:
            vocab = torch.arange(out.vocab) != out.pad_id
            scores = (tok_s[vocab][:, None] + pos_s[None, :]).reshape(-1)
        low = float(torch.minimum(tok_s.min() + pos_s.min(), scores.min())) - 1.0
    levels = torch.arange(1, bins, dtype=torch.float64) / bins
    inner = torch.quantile(scores, levels) if scores.numel() <= 16_000_000 else torch.quantile(
        scores[torch.randperm(scores.numel(), generator=gen)[:16_000_000]], levels)
    thresholds = torch.cat([torch.tensor([low], dtype=torch.float64), inner])
    block = ImprintBlock((d,), q.to(weight.dtype), thresholds.to(weight.dtype), gain=gain,
                         masses_source="public text" if public is not None else
                         ("random token sequences" if signature else "the public table, uniform"))
    if signature:
        # V's columns all equal to (gain / K)·u, u a seeded unit Gaussian direction, where Robbing the Fed's block
        # uses the all-ones vector: every consumer of a pre-LN residual stream is a LayerNorm, whose input gradient
        # is orthogonal to 1, so with ones each position's g_p = (gain / K)·1ᵀ∂L/∂out_p vanishes up to float
        # rounding (measured: |∇b| ≈ 1e-13 against 1e-7 with u; eq. (1) is then a ratio of round-off, which any
        # defense noise swamps).  Decepticons' backward-flow layer likewise writes into one coordinate, not 1.
        u = torch.randn(d, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            block.linear1.weight.copy_((u / u.norm())[:, None].expand(d, bins) * (gain / bins))
    block = block.to(weight.device)
    if signature:
        block.register_buffer("reserved", reserved.to(weight.device))
        out.blocks[0].mid = block
    else:
        out.pre = block
    return out


def _random_text(model: nn.Module, gen: torch.Generator, n: int = 256) -> torch.Tensor:
    """n seeded sequences of ``context`` tokens drawn uniformly from the vocabulary without padding."""
    ids = torch.randint(0, model.vocab - 1, (n, model.context), generator=gen)
    return ids + (ids >= model.pad_id).long()


def _signature_attention(model: nn.Module, reserved: torch.Tensor, gen: torch.Generator) -> float:
    """Set block 1's attention and the embeddings for the sentence signature (see :func:`imprint_text`).

    Returns a bound on ‖h¹‖ over every input: max ‖E[v]‖ + max ‖P[t]‖ + ‖G‖₂ (√d max|γ₁| + ‖β₁‖)."""
    d = model.width
    rest = torch.ones(d, dtype=torch.bool)
    rest[reserved] = False
    attn = model.blocks[0].attn
    with torch.no_grad():
        model.tok.weight[:, reserved] = 0
        model.pos.weight[:, reserved] = 0
        table = model.tok.weight.detach().double()[:, rest]
        scale = float(table.pow(2).mean().sqrt()) or 1.0      # rms entry of E on the kept dimensions
        attn.qkv.weight.zero_()
        attn.qkv.bias.zero_()
        attn.qkv.weight[2 * d:] = torch.eye(d, dtype=attn.qkv.weight.dtype, device=attn.qkv.weight.device)
        g = torch.randn(len(reserved), d, generator=gen, dtype=torch.float64) * (scale / math.sqrt(d))
        attn.proj.weight.zero_()
        attn.proj.bias.zero_()
        attn.proj.weight[reserved] = g.to(attn.proj.weight)
        ln = model.blocks[0].ln1
        gamma = ln.weight.detach().double().abs().max() if ln.weight is not None else 1.0
        beta = ln.bias.detach().double().norm() if ln.bias is not None else 0.0
        bound = (model.tok.weight.detach().double().norm(dim=1).max() + model.pos.weight.detach().double().norm(dim=1).max()
                 + torch.linalg.matrix_norm(g, ord=2) * (math.sqrt(d) * gamma + beta))
    return float(bound)
