"""Weight modifications of a malicious server that keep the model's architecture (or add one block).

Each function takes a model and returns the modified copy the server sends (the caller's model is never
changed); every random draw comes from ``seed``:

- :func:`trap_weights` — the trap weights of Boenisch et al. ("When the Curious Abandon Honesty", EuroS&P 2023,
  Sec. 4.2): the first fully connected layer's rows get a random negative half and a positive half scaled by s, so
  each neuron fires for few inputs and a sample alone on a neuron is ∇W_k / ∇b_k exactly (``trap-weights``); on a
  model that does not start with a ReLU FC layer, a :class:`TrapBlock` of K such neurons goes in front.
- :func:`fishing` — class fishing of Wen et al. (ICML 2022, Sec. 3): the final layer keeps the target class's row,
  zeroes the others and gives them one large bias, so only the target class's samples send a gradient into the
  body of the network (``fishing``); :func:`feature_fishing` (Sec. 3.2) further splits that class by one feature
  of the head's input.

The blocks of Robbing the Fed and Liu et al. are in :mod:`leakbench.models.malicious`.
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .malicious import _copy_attributes, _head, _input_shape, _layer_inputs, _param_device, _public

__all__ = ["TrapBlock", "trap_weights", "first_linear", "trap_rows", "trap_scales", "fishing", "feature_fishing",
           "refished", "head_inputs"]


# --------------------------------------------------------------------------- trap weights (Boenisch et al.)


class TrapBlock(nn.Module):
    """x ↦ x + V·ReLU(W x + b): K trap-weight neurons in front of a model whose first layer is not a ReLU FC layer.

    ``linear0`` (W: K × d, b = 0) holds the trap rows of :func:`trap_rows`; ``linear1`` (V: d × K) has all columns
    equal to ``gain``/K, as the imprint block's back-projection, so the model behind sees nearly the raw input and
    every active neuron of a sample receives the same upstream gradient.  ``scales[k]`` is row k's factor s_k.
    """

    def __init__(self, input_shape: Sequence[int], weight: torch.Tensor, scales: torch.Tensor, *,
                 gain: float = 1e-3) -> None:
        super().__init__()
        self.input_shape = tuple(int(s) for s in input_shape)
        d = math.prod(self.input_shape)
        neurons = int(weight.shape[0])
        self.neurons = neurons
        self.linear0 = nn.Linear(d, neurons)
        self.linear1 = nn.Linear(neurons, d)
        self.register_buffer("scales", scales.detach().double().clone().reshape(neurons))
        with torch.no_grad():
            self.linear0.weight.copy_(weight)
            self.linear0.bias.zero_()
            self.linear1.weight.fill_(gain / neurons)
            self.linear1.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1)
        return (flat + self.linear1(torch.relu(self.linear0(flat)))).reshape(x.shape)


def first_linear(model: nn.Module, input_shape: Sequence[int]) -> tuple[str, nn.Linear] | str:
    """(name, layer) of the model's first weighted layer when it is an ``nn.Linear`` with bias on the flattened
    input, followed by an ``nn.ReLU``; else a sentence saying why not.

    Decided on one probe forward pass (hooks on every leaf module, in call order): the first Linear/Conv called
    must be that Linear, its input the probe itself (no normalisation or block before it), and the next leaf
    module called an ``nn.ReLU`` (its output ReLU(W x + b) is what makes a row fire for few inputs).
    """
    shape = tuple(input_shape)
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[tuple[nn.Module, torch.Tensor | None]] = []
    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(lambda mod, inp, _out: calls.append(
        (mod, inp[0] if inp and isinstance(inp[0], torch.Tensor) else None))) for m in leaves]
    device, dtype = _param_device(model)
    probe = torch.rand((2, *shape), generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(device, dtype)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(probe)
    except Exception as err:  # noqa: BLE001 - a model the probe cannot run has no layer we can name
        return f"the model does not run on inputs of shape {shape}: {type(err).__name__}"
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    weighted = [i for i, (m, _) in enumerate(calls) if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))]
    if not weighted:
        return "the model has no Linear or Conv layer"
    i = weighted[0]
    layer, seen = calls[i]
    if not isinstance(layer, nn.Linear):
        return f"its first weighted layer is a {type(layer).__name__}, not a fully connected layer"
    if layer.bias is None:
        return f"its first fully connected layer {names[id(layer)]!r} has no bias (the attack divides by ∇b)"
    if seen is None or seen.reshape(seen.shape[0], -1).shape != (2, math.prod(shape)) or not torch.equal(
            seen.reshape(2, -1), probe.reshape(2, -1)):
        return f"the input of its first fully connected layer {names[id(layer)]!r} is not the raw input"
    if i + 1 >= len(calls) or not isinstance(calls[i + 1][0], nn.ReLU):
        after = type(calls[i + 1][0]).__name__ if i + 1 < len(calls) else "nothing"
        return f"its first fully connected layer {names[id(layer)]!r} is followed by {after}, not an nn.ReLU"
    return names[id(layer)], layer


def trap_rows(neurons: int, d: int, *, generator: torch.Generator, bound: float = 1.0) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """(magnitudes m, negative mask) of ``neurons`` trap rows of width d: m ~ U(0, bound), and in each row a
    seeded random half of the entries (⌊d/2⌋) is the negative half (Boenisch et al., Sec. 4.2)."""
    m = torch.rand((neurons, d), generator=generator, dtype=torch.float64) * bound
    order = torch.argsort(torch.rand((neurons, d), generator=generator, dtype=torch.float64), dim=1)
    negative = torch.zeros((neurons, d), dtype=torch.bool)
    negative.scatter_(1, order[:, : d // 2], True)
    return m, negative


def trap_scales(m: torch.Tensor, negative: torch.Tensor, public: torch.Tensor, rate: float, *,
                per_row: bool = True) -> torch.Tensor:
    """Per-row factors s_k so that row k fires for a fraction ``rate`` of the public samples (``per_row=False``:
    one s for every row, so that the rows fire for that fraction on average: the ratios of all rows pooled).

    Row k's pre-activation on x ≥ 0 is s_k·a_k(x) − c_k(x), a_k = Σ_{positive half} m x and
    c_k = Σ_{negative half} m x (bias 0), so it fires iff s_k > c_k(x)/a_k(x): s_k is the ``rate``-quantile of
    that ratio over the public samples (a sample with a_k = 0 never fires; an infinite quantile falls back to
    the largest finite ratio).
    """
    flat = public.reshape(public.shape[0], -1).double().cpu()
    pos = flat @ (m * ~negative).T
    neg = flat @ (m * negative).T
    ratio = torch.where(pos > 0, neg / pos.clamp_min(1e-300), torch.full_like(pos, math.inf))
    if not per_row:
        pooled = ratio.reshape(-1)
        if pooled.numel() > 16_000_000:
            pooled = pooled[torch.randperm(pooled.numel(), generator=torch.Generator().manual_seed(0))[:16_000_000]]
        value = torch.quantile(pooled, float(rate), interpolation="higher")
        value = value if torch.isfinite(value) else pooled[torch.isfinite(pooled)].max()
        return value.expand(m.shape[0]).clone()
    s = torch.quantile(ratio, float(rate), dim=0, interpolation="higher")
    finite = torch.where(torch.isfinite(ratio), ratio, torch.full_like(ratio, -math.inf)).amax(0)
    s = torch.where(torch.isfinite(s), s, finite)
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))


def trap_weights(model: nn.Module, *, rate: float = 1 / 64, scale: float | None = None,
                 calibration: object | None = None, per_row: bool = True, neurons: int | None = None, seed: int = 0,
                 gain: float = 1e-3, data_range: tuple[float, float] = (0.0, 1.0),
                 input_shape: Sequence[int] | None = None) -> nn.Module:
    """The model a dishonest server ships with trap weights (Boenisch et al., "When the Curious Abandon Honesty",
    EuroS&P 2023, Sec. 4.2).

    Trap rows: every row k of the first fully connected layer gets positive magnitudes m_k (U(0, a), a = the
    largest |weight| the layer had, so the rows keep the honest layer's range); a random half of each row is made
    negative and the other half is scaled by s_k:  w_kj = −m_kj on the negative half, s_k·m_kj on the positive
    half, bias 0.  On non-negative inputs the row's pre-activation s_k·a_k(x) − c_k(x) is then negative for
    most inputs, so the neuron fires for few of them, and a sample that alone activates neuron k in the batch is
    rebuilt exactly by ``trap-weights`` as ∇W_k / ∇b_k.

    The factor: ``scale=s`` uses one s for every row, as the paper does (its s is tuned by hand per dataset);
    otherwise each row's s_k is calibrated on ``calibration`` (public images the server holds, N × input_shape
    or a dataset with ``.images``, as for :func:`imprint`) so that it fires for a fraction ``rate`` of them
    (:func:`trap_scales`; rate 1/B isolates best: a sample is alone on a row with probability
    ≈ rate·(1 − rate)^(B−1), largest at rate = 1/B; under secure aggregation of L clients, 1/(L·B)).  The
    per-row calibration is our departure (documented in docs/feature-attacks.md): with one s, rows fire at
    rates spread over orders of magnitude; ``per_row=False`` calibrates the paper's single s instead (the
    rows then fire for ``rate`` of the public images on average).

    Where: with ``neurons=None`` the model's own first layer is replaced (the paper's setting; the model must
    start with an ``nn.Linear`` with bias on the raw input followed by an ``nn.ReLU``, :func:`first_linear`);
    with ``neurons=K`` a :class:`TrapBlock` of K trap neurons is put in front of any model (as the imprint block
    is).  The input box ``data_range`` must be non-negative (the trap's sign argument needs x ≥ 0).
    """
    shape = _input_shape(model, input_shape)
    lo, hi = (float(v) for v in data_range)
    if not hi > lo or lo < 0:
        raise ConfigError(f"expected a non-negative data_range (lo, hi) with hi > lo (trap rows fire on the sign "
                          f"of s·a(x) − c(x) for x ≥ 0), got {data_range!r} (argument data_range)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ConfigError(f"expected scale > 0 (the paper's factor s, e.g. 0.95) or None, got {scale!r} "
                          "(argument scale)")
    if scale is None and not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < 1):
        raise ConfigError(f"expected rate in (0, 1) (each row fires for this fraction of inputs; 1/B isolates "
                          f"best), got {rate!r} (argument rate)")
    if neurons is not None and (isinstance(neurons, bool) or not isinstance(neurons, int) or neurons < 1):
        raise ConfigError(f"expected neurons ≥ 1 (a trap block of that many rows) or None (the model's first "
                          f"layer), got {neurons!r} (argument neurons)")
    if not gain > 0:
        raise ConfigError(f"expected gain > 0, got {gain!r} (argument gain)")
    if scale is None and calibration is None:
        raise ConfigError("trap_weights needs public images to calibrate each row's rate (argument calibration, "
                          "N × input_shape or a dataset with .images), or the paper's fixed factor scale=s")
    public = _public(calibration, shape, 2, "calibration") if scale is None else None
    d = math.prod(shape)
    gen = torch.Generator().manual_seed(int(seed))
    device, dtype = _param_device(model)
    shipped = copy.deepcopy(model)
    if neurons is None:
        found = first_linear(shipped, shape)
        if isinstance(found, str):
            raise ConfigError(f"trap_weights replaces the model's first layer, but {found}; pass neurons=K to put "
                              "a trap block of K neurons in front of the model instead (argument neurons)")
        name, layer = found
        k, bound = layer.out_features, float(layer.weight.detach().abs().max()) or 1.0
    else:
        name, layer, k, bound = None, None, neurons, 1.0 / math.sqrt(d)
    m, negative = trap_rows(k, d, generator=gen, bound=bound)
    s = trap_scales(m, negative, public, rate, per_row=bool(per_row)) if scale is None else torch.full(
        (k,), float(scale), dtype=torch.float64)
    weight = torch.where(negative, -m, s[:, None] * m)
    if layer is not None:
        with torch.no_grad():
            layer.weight.copy_(weight.to(layer.weight))
            layer.bias.zero_()
        shipped.trap_layer = name
    else:
        block = TrapBlock(shape, weight, s, gain=gain).to(device=device, dtype=dtype)
        block.scales = s.to(device)
        shipped = nn.Sequential(OrderedDict(trap=block, model=shipped))
        shipped.trap_layer = "trap.linear0"
    # what the server chose, as plain attributes (no buffer: the state dict keeps the honest model's keys)
    shipped.trap_scales = s.clone()
    shipped.trap_rate = None if scale is not None else float(rate)
    _copy_attributes(model, shipped, shape)
    return shipped


# --------------------------------------------------------------------------- fishing (Wen et al.)


def _labelled(calibration: object) -> tuple[object, torch.Tensor | None]:
    """(images, labels or None) of public samples given as a tensor, an (images, labels) pair or a dataset."""
    if isinstance(calibration, tuple) and len(calibration) == 2:
        return calibration[0], torch.as_tensor(calibration[1]).reshape(-1)
    labels = getattr(calibration, "labels", None)
    return calibration, (labels.reshape(-1) if isinstance(labels, torch.Tensor) else None)


def fishing(model: nn.Module, *, target: int, margin: float = 20.0, calibration: object | None = None,
            seed: int = 0, input_shape: Sequence[int] | None = None, feature: int | str | None = None,
            quantile: float | None = None) -> nn.Module:
    """Class fishing (Wen, Geiping, Fowl, Goldblum & Goldstein, "Fishing for User Data in Large-Batch Federated
    Learning via Gradient Magnification", ICML 2022, Sec. 3): the model's final linear layer (W, b) keeps the
    row of class ``target`` and zeroes every other row, whose bias becomes one large constant μ.

    Every non-target logit is then μ, and μ = (the largest target logit over ``calibration``, public samples
    the server holds; else over 256 uniform inputs drawn from ``seed``) + ``margin``.  So p_target ≤ e^(−margin) for every
    plausible input, and the gradient that reaches the body of the network, Wᵀ(p − e_y) = W_target·p_target −
    W_target·1[y = target], is that of the target-class samples alone: each of them ≈ −W_target, each other
    sample ≤ e^(−margin)·‖W_target‖.  A batch of B samples shares, below the head, only its target-class
    samples' gradient (the magnification: the rest is suppressed by e^(−margin)); ``trap-weights`` (or any
    attack on the first layer) then reads those samples.  ``shipped.fishing_target`` records the class and
    ``shipped.fishing_head`` the final layer's name.

    With ``quantile=q`` the head does feature fishing instead (:func:`feature_fishing`, Sec. 3.2).
    """
    if quantile is not None or feature is not None:
        return feature_fishing(model, target=target, quantile=quantile, feature=feature, margin=margin,
                               calibration=calibration, input_shape=input_shape)
    shape = _input_shape(model, input_shape)
    _check_margin(margin)
    shipped = copy.deepcopy(model)
    name, head = _fished_head(shipped, shape, target)
    classes = head.out_features
    images, _ = _labelled(calibration)
    probe = _public(images, shape, 1, "calibration") if calibration is not None else torch.rand(
        (256, *shape), generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
    device, dtype = _param_device(shipped)
    was = shipped.training
    shipped.eval()
    with torch.no_grad():
        top = max(float(shipped(probe[s:s + 256].to(device, dtype))[:, target].max())
                  for s in range(0, probe.shape[0], 256))
        keep = torch.zeros(classes, dtype=torch.bool, device=head.weight.device)
        keep[target] = True
        head.weight[~keep] = 0
        head.bias[~keep] = top + float(margin)
    shipped.train(was)
    shipped.fishing_target = int(target)
    shipped.fishing_head = name
    _copy_attributes(model, shipped, shape)
    return shipped


def _check_margin(margin: object) -> None:
    if not (isinstance(margin, (int, float)) and not isinstance(margin, bool) and math.isfinite(margin)
            and margin > 0):
        raise ConfigError(f"expected margin > 0 (the target logit's distance below the others), got {margin!r} "
                          "(argument margin)")


def _fished_head(shipped: nn.Module, shape: tuple[int, ...], target: object) -> tuple[str, nn.Linear]:
    name, head = _head(shipped, shape)
    classes = head.out_features
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < classes:
        raise ConfigError(f"expected target a class in 0..{classes - 1}, got {target!r} (argument target)")
    if head.bias is None:
        raise ConfigError(f"fishing needs a final linear layer with bias ({name!r} has none): the non-target "
                          "classes' constant logit is a bias")
    return name, head


def feature_fishing(model: nn.Module, *, target: int, quantile: float | None, feature: int | str | None = None,
                    margin: float = 20.0, calibration: object | None = None,
                    input_shape: Sequence[int] | None = None) -> nn.Module:
    """Feature fishing (Wen et al., ICML 2022, Sec. 3.2), the single-round variant: of the target class's samples
    only those whose feature j of the head's input φ lies below a threshold τ keep the target gradient.

    The head's rows are zeroed except entry (target, j) = m, with bias b_target = −m·τ + log(C − 1) and 0 for the
    other classes, so p_target = σ(m·(φ_j − τ)) exactly, and the gradient below the head is
    m·(p_target − 1[y = target])·∇φ_j: a target-class sample below τ sends ≈ −m·∇φ_j, one above τ ≈ 0; a sample
    of another class sends m·p_target·∇φ_j, ≈ 0 below τ — but ≈ m·∇φ_j above τ (the construction's leak: one
    logit cannot say "target class and below τ").  τ is the ``quantile`` q of φ_j over the public samples of the
    target class (``calibration``: an (images, labels) pair or a dataset with ``.labels``), so about q·n_t of a
    batch's n_t target samples pass (q = 1/n_t isolates one); m = ``margin``/σ_j (σ_j: φ_j's spread over those
    samples), so a target sample one σ_j above τ is damped by e^(−margin).  ``feature``: the index j, or None /
    "auto" for the feature whose τ the fewest public samples of the other classes exceed (the leak; ties: the
    widest spread) among those that split the class (samples below τ, no mass at the minimum, a spread at least
    the median feature's), chosen on the even-numbered public samples and τ then placed on the odd-numbered ones.  The authors' reference code takes the feature with the largest target-class mean instead;
    ours minimises the leak the one-logit construction has, from the same public samples.

    The paper's multi-round variant (a search on τ over several queries of the same client, a single sample's
    gradient the difference of two rounds) is the attack ``fishing-rounds``, which moves τ with :func:`refished`
    and looks next at ``shipped.fishing_candidates`` (features most public samples keep above their minimum).
    ``shipped.fishing_feature``, ``fishing_threshold``, ``fishing_quantile``, ``fishing_spread`` (σ_j) and
    ``fishing_scale`` (m) record the choice.
    """
    shape = _input_shape(model, input_shape)
    _check_margin(margin)
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0 < quantile < 1:
        raise ConfigError(f"expected quantile in (0, 1) (about q·n of the batch's n target samples pass; 1/n "
                          f"isolates one), got {quantile!r} (argument quantile)")
    shipped = copy.deepcopy(model)
    name, head = _fished_head(shipped, shape, target)
    width, classes = head.in_features, head.out_features
    if feature not in (None, "auto") and (isinstance(feature, bool) or not isinstance(feature, int)
                                          or not 0 <= feature < width):
        raise ConfigError(f"expected feature an index in 0..{width - 1} of the final layer's input (or 'auto'), "
                          f"got {feature!r} (argument feature)")
    images, labels = _labelled(calibration) if calibration is not None else (None, None)
    if labels is None:
        raise ConfigError("feature fishing needs labelled public samples of the target class to place its threshold "
                          "(argument calibration: an (images, labels) pair or a dataset with .labels)")
    images = _public(images, shape, 2, "calibration")
    if labels.shape[0] != images.shape[0]:
        raise ConfigError(f"expected one label per calibration image ({images.shape[0]}), got {labels.shape[0]} "
                          "(argument calibration)")
    mine = labels.to(images.device) == target
    if int(mine.sum()) < 4:
        raise ConfigError(f"feature fishing needs at least 4 public samples of class {target} to place its "
                          f"threshold, got {int(mine.sum())} (argument calibration)")
    phi_all = head_inputs(shipped, name, images)
    mine = mine.cpu()
    phi = phi_all[mine]
    if feature in (None, "auto"):
        # chosen on the even-numbered public samples, τ placed on the odd ones: a feature picked for its low leak on
        # the samples that also place τ would carry that choice's luck into τ (more batch samples would pass)
        pick, place = phi[0::2], phi[1::2]
        taus = torch.quantile(pick, float(quantile), dim=0)
        # among the features that split the class at τ: some public samples below it, no mass at the minimum
        # (a ReLU feature at 0 for many samples passes them with zero gradient), a spread at least the median
        # feature's (a near-constant feature makes m = margin/σ_j explode)
        spread = pick.std(0)
        splits = ((pick < taus).double().mean(0) >= quantile / 2) & \
            ((phi == phi.min(0).values).double().mean(0) <= quantile / 2) & (spread >= spread.median())
        if not bool(splits.any()) or place.shape[0] < 1:
            raise ConfigError(f"no feature of the final layer's input splits the public samples of class {target} "
                              f"at quantile {quantile} (each has a mass at its minimum, e.g. ReLU zeros); pass "
                              "feature=j or another quantile (argument feature)")
        others = phi_all[~mine][0::2]
        leak = (others > taus).double().mean(0) if others.shape[0] else torch.zeros_like(taus)
        score = torch.where(splits, leak - 1e-9 * spread / (spread.max() + 1e-300), torch.full_like(leak, math.inf))
        j = int(torch.argmin(score))
        phi = place
    else:
        j = int(feature)
    values = phi[:, j]
    tau = float(torch.quantile(values, float(quantile)))
    spread = float(values.std())
    scale = float(margin) / (spread if spread > 0 else 1.0)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[target, j] = scale
        head.bias.zero_()
        head.bias[target] = -scale * tau + math.log(max(classes - 1, 1))
    shipped.fishing_target = int(target)
    shipped.fishing_head = name
    shipped.fishing_feature, shipped.fishing_threshold, shipped.fishing_quantile = j, tau, float(quantile)
    shipped.fishing_spread, shipped.fishing_scale = spread if spread > 0 else 1.0, scale
    shipped.fishing_candidates = _candidate_features(phi_all, j, tau, shipped.fishing_spread)
    _copy_attributes(model, shipped, shape)
    return shipped


#: the features recorded for the multi-round search, beside the shipped one
CANDIDATES = 8


def _candidate_features(phi: torch.Tensor, first: int, tau: float, spread: float) -> list[tuple[int, float, float]]:
    """(feature, centre, spread) of the shipped feature, then of the ``CANDIDATES`` features the most public samples
    (all classes) hold above the feature's minimum (a sample at a ReLU feature's zero sends no gradient through it),
    widest spread first among equals: where the multi-round search (``fishing-rounds``) looks next."""
    active = (phi > phi.min(0).values).double().mean(0)
    spreads = phi.std(0)
    order = sorted(range(phi.shape[1]), key=lambda k: (-float(active[k]), -float(spreads[k])))
    out = [(int(first), float(tau), float(spread))]
    for k in order:
        if len(out) > CANDIDATES:
            break
        if k != first and float(spreads[k]) > 0:
            out.append((int(k), float(phi[:, k].median()), float(spreads[k])))
    return out


def head_inputs(model: nn.Module, head: str, images: torch.Tensor, *, chunk: int = 256) -> torch.Tensor:
    """The input φ of ``model``'s layer ``head`` for each of ``images`` (N × width, float64 on the CPU), in eval
    mode and without gradients, ``chunk`` images at a time; the model's mode is restored."""
    return _layer_inputs(model, dict(model.named_modules())[head], images, chunk=chunk).cpu()


def refished(shipped: nn.Module, threshold: float, scale: float | None = None, feature: int | None = None) -> nn.Module:
    """A copy of a feature-fishing model (:func:`feature_fishing`) with its threshold moved to ``threshold`` and,
    when given, its multiplier m to ``scale`` and the fished feature to ``feature``: p_target = σ(m·(φ_j − τ)) for
    every sample.  The server's next query in the multi-round variant (Wen et al. 2022, Sec. 3.2; ``fishing-rounds``)."""
    if getattr(shipped, "fishing_feature", None) is None:
        raise ConfigError("refished needs a feature-fishing model (leakbench.models.active.feature_fishing or "
                          "fishing(..., quantile=q)) (argument shipped)")
    if not math.isfinite(float(threshold)) or (scale is not None and not (math.isfinite(scale) and scale > 0)):
        raise ConfigError(f"expected a finite threshold and a scale > 0, got {threshold!r} and {scale!r}")
    out = copy.deepcopy(shipped)
    head = dict(out.named_modules())[out.fishing_head]
    m = float(out.fishing_scale if scale is None else scale)
    target, j = int(out.fishing_target), int(out.fishing_feature if feature is None else feature)
    if not 0 <= j < head.in_features:
        raise ConfigError(f"expected feature an index in 0..{head.in_features - 1}, got {feature!r} (argument feature)")
    with torch.no_grad():
        head.weight[target].zero_()
        head.weight[target, j] = m
        head.bias[target] = -m * float(threshold) + math.log(max(head.out_features - 1, 1))
    out.fishing_threshold, out.fishing_scale, out.fishing_feature = float(threshold), m, j
    return out
