"""The distance of trained weights to a KKT point of the max-margin problem (Haim et al. 2022, eq. 2).

Theorem 2.1 (Lyu & Li; Ji & Telgarsky) says gradient flow on such a network converges
in direction to a KKT point of  min ½‖θ‖²  s.t.  y_i Φ(θ; x_i) ≥ 1,  whose stationarity
condition is (Haim et al. eq. (2); provable-attacks paper eq. (2))

    θ = Σ_i λ_i y_i ∇_θ Φ(θ; x_i),    λ_i ≥ 0.

(for ReLU networks with ∇_θΦ a Clarke subgradient: ReLU′(0) ∈ [0, 1], see ``kink_tol``).
:func:`kkt_residual` measures how far the weights are from it:
min_{λ ≥ 0} ‖θ − Σ_i λ_i y_i ∇_θΦ(θ; x_i)‖ / ‖θ‖ with the best non-negative multipliers
found by NNLS (``scipy.optimize.nnls``).  The ratio is invariant to rescaling θ for a
homogeneous network (λ absorbs the scale), so the margin need not be normalised.  For
multiclass targets each pair (i, j ≠ y_i) contributes ∇(Φ_{y_i} − Φ_j)(x_i) (the
multiclass max-margin KKT conditions of Buzaglo et al. 2023).

Per-sample gradients are never materialised for networks made of Linear layers: with
h the layer input and δ the back-propagated output gradient, ⟨∇_W s_i, ∇_W s_k⟩ =
(δ_i·δ_k)(h_i·h_k), so the Gram matrix costs one forward and one backward pass per
output direction (other architectures fall back to ``torch.func.vmap`` per-sample
gradients).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError, expect
from ..models.targets import margins

__all__ = ["KKTResidual", "kkt_residual"]


@dataclass
class KKTResidual:
    """Distance of trained weights to the stationarity condition of the max-margin problem.

    ``residual`` = ‖θ − Σ λ_c ∇s_c‖ / ‖θ‖ with the NNLS multipliers ``multipliers``
    (one per sample for binary targets, n×(K−1) for multiclass), ``margins`` the
    per-sample margins y_i Φ(x_i) (or Φ_{y_i} − max_{j≠y_i} Φ_j), ``normalized_margins``
    the margins divided by their minimum (1 on the margin).  ``kink_tol`` > 0: the
    first-layer ReLU derivative of the ``kinks`` (sample, neuron) pairs within that
    tolerance of the kink was free in [0, 1] (see :func:`kkt_residual`).
    """

    residual: float
    multipliers: torch.Tensor
    margins: torch.Tensor
    normalized_margins: torch.Tensor
    theta_norm: float
    method: str
    kink_tol: float = 0.0
    kinks: int = 0

    @property
    def on_margin(self) -> torch.Tensor:
        """Samples whose margin is within 10 % of the smallest (the provable-attacks code's slack)."""
        return self.normalized_margins <= 1.1


def _directions(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Output weightings v (G, n, K): the scalars s_{g,i} = v_{g,i}·Φ(x_i) whose gradients enter the KKT sum."""
    n, k = outputs.shape
    if k == 1:
        return y.reshape(1, n, 1).to(outputs.dtype)
    eye = torch.eye(k, dtype=outputs.dtype, device=outputs.device)
    own = eye[y.long()]  # (n, K)
    others = torch.stack([torch.arange(k, device=y.device)[torch.arange(k, device=y.device) != c] for c in range(k)])
    j = others[y.long()]  # (n, K−1): the wrong classes of each sample
    return torch.stack([own - eye[j[:, g]] for g in range(k - 1)])  # (K−1, n, K)


def _linear_only(model: nn.Module) -> list[nn.Linear] | None:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    covered = {id(p) for m in linears for p in m.parameters(recurse=False)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    has_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not linears or has_norm or any(id(p) not in covered for p in trainable):
        return None
    return linears


def _layer_terms(model: nn.Module, linears: list[nn.Linear], x: torch.Tensor, v: torch.Tensor, act_grad: bool = False):
    """Per Linear layer: (input h (n, in), output gradients δ (c, out) of the scalars s_c, W h + b (n, out)).

    With ``act_grad`` also the gradients u (c, out) of the scalars w.r.t. the output of the activation
    that follows the first layer (the ReLU derivative not yet applied), or ``None`` as the last item
    when that activation is not a ReLU module fed by the first layer.
    """
    inputs: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}
    calls: dict[int, int] = {}
    acts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, args, output):
        calls[id(module)] = calls.get(id(module), 0) + 1
        inputs[id(module)] = args[0].detach().reshape(args[0].shape[0], -1)
        outs[id(module)] = output

    def act_hook(module, args, output):
        acts.append((args[0], output))

    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)] if act_grad else []
    handles = [m.register_forward_hook(hook) for m in linears]
    handles += [m.register_forward_hook(act_hook) for m in relus[:1]]
    try:
        with torch.enable_grad():
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    if any(calls.get(id(m), 0) != 1 for m in linears) or any(outs[id(m)].dim() != 2 for m in linears):
        return None
    first_act = None
    if act_grad and len(acts) == 1 and acts[0][0] is outs[id(linears[0])]:
        first_act = acts[0][1]
    out = out.reshape(out.shape[0], -1)
    groups = v.shape[0]
    wanted = [outs[id(m)] for m in linears] + ([first_act] if first_act is not None else [])
    deltas = []  # per group: list over layers of (n, out)
    for g in range(groups):
        s = (out * v[g]).sum()
        deltas.append(torch.autograd.grad(s, wanted, retain_graph=g < groups - 1))
    terms = []
    for li, m in enumerate(linears):
        h = inputs[id(m)]
        d = torch.cat([deltas[g][li] for g in range(groups)]).detach()  # (c, out)
        wh = h @ m.weight.detach().T  # (n, out): W h_i
        if m.bias is not None:
            wh = wh + m.bias.detach()
        terms.append((h, d, wh))
    if act_grad:
        u = torch.cat([deltas[g][-1] for g in range(groups)]).detach() if first_act is not None else None
        return terms, u
    return terms


def _gram_linear(model: nn.Module, linears: list[nn.Linear], x: torch.Tensor, v: torch.Tensor):
    """Gram matrix and ⟨∇s_c, θ⟩ of the scalars s_{g,i} = v_{g,i}·Φ(x_i), via layer inputs and output gradients."""
    terms = _layer_terms(model, linears, x, v)
    if terms is None:
        return None
    return _assemble(linears, terms, v.shape[0])


def _assemble(linears: list[nn.Linear], terms, groups: int):
    n = terms[0][0].shape[0]
    c = groups * n
    dtype, device = terms[0][0].dtype, terms[0][0].device
    gram = torch.zeros(c, c, dtype=dtype, device=device)
    proj = torch.zeros(c, dtype=dtype, device=device)
    for m, (h, d, wh) in zip(linears, terms):
        hh = h @ h.T + (1.0 if m.bias is not None else 0.0)
        gram += (d @ d.T) * hh.repeat(groups, groups)
        proj += (d * wh.repeat(groups, 1)).sum(1)
    return gram, proj


def _gram_generic(model: nn.Module, x: torch.Tensor, v: torch.Tensor, *, max_entries: float = 2e8):
    """Gram matrix and ⟨∇s_c, θ⟩ from per-sample gradients (torch.func.vmap), for any architecture."""
    from torch.func import functional_call, grad, vmap

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in params.values())
    groups, n = v.shape[:2]
    if groups * n * total > max_entries:
        raise ConfigError(f"the KKT residual of this architecture needs {groups * n} per-sample gradients of "
                          f"{total} parameters (over {max_entries:.0e} numbers); use fewer samples or an MLP")

    def scalar(p, xi, vi):
        return (functional_call(model, p, (xi.unsqueeze(0),)).reshape(-1) * vi).sum()

    per_sample = vmap(grad(scalar), in_dims=(None, 0, 0))
    rows = []
    for g in range(groups):
        gr = per_sample(params, x, v[g])
        rows.append(torch.cat([gr[name].reshape(n, -1) for name in names], dim=1))
    big = torch.cat(rows)
    theta = torch.cat([params[name].reshape(-1) for name in names])
    return big @ big.T, big @ theta


def kkt_residual(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, kink_tol: float = 0.0,
                 max_kinks: int = 6000) -> KKTResidual:
    """min_{λ≥0} ‖θ − Σ_c λ_c ∇_θ s_c(θ)‖ / ‖θ‖ by NNLS, with s = y_i Φ(x_i) (or Φ_{y_i} − Φ_j, multiclass).

    ``x`` are the network's inputs (centred if it was trained centred), ``y`` ±1 labels
    for a scalar output or class indices for K outputs.  Solved on the Gram matrix
    K = G Gᵀ of the per-sample gradients G: with K = V S Vᵀ, NNLS on
    (S^{1/2} Vᵀ, S^{−1/2} Vᵀ Gθ) minimises the same quadratic as on (Gᵀ, θ).

    ``kink_tol`` > 0 (default 0: the plain gradient, ReLU′(0) = 0): the KKT conditions
    of a non-smooth homogeneous network (Lyu & Li 2020, Def. of KKT points with the
    Clarke subdifferential) allow ReLU′ anywhere in [0, 1] at a kink, and gradient
    descent converges *in direction* to a point where some pre-activations w_j·x_i + b_j
    are exactly 0, while at any finite time they are only small: the plain gradient then
    picks 0 or 1 and the residual stalls (measured 0.3–0.4 on trained two-layer nets,
    whatever the training length).  Pairs (sample i, first-layer neuron j) with
    |w_j·x_i + b_j| ≤ kink_tol·‖(w_j, b_j)‖‖(x_i, 1)‖ (an angle within ≈ kink_tol rad of
    the kink) get a free derivative s_ij ∈ [0, 1]; with μ_ij = λ_i s_ij the problem stays
    convex (λ ≥ 0, 0 ≤ μ_ij ≤ λ_i) and is solved by accelerated projected gradient
    from the NNLS point (so the relaxed residual is never above the plain one).  Only
    the first hidden layer is relaxed (its derivative enters the gradient linearly);
    deeper kinks keep ReLU′(0) = 0.  Needs an MLP of Linear layers whose first layer
    feeds a ReLU module, and at most ``max_kinks`` relaxed pairs.
    """
    from scipy.optimize import nnls

    expect(isinstance(kink_tol, (int, float)) and not isinstance(kink_tol, bool) and kink_tol >= 0,
           f"expected kink_tol ≥ 0, got {kink_tol!r} (argument kink_tol)")
    expect(isinstance(x, torch.Tensor) and x.dim() >= 2 and isinstance(y, torch.Tensor) and y.shape[0] == x.shape[0],
           "expected inputs x (N×…) and one label per sample (arguments x, y)")
    model = model.eval()
    with torch.no_grad():
        out = model(x)
    out = out.reshape(out.shape[0], -1)
    if out.shape[1] == 1:
        expect(y.dtype.is_floating_point and set(torch.unique(y).tolist()) <= {-1.0, 1.0},
               "expected ±1 float labels for a network with one output (argument y)")
    v = _directions(out, y)
    linears = _linear_only(model)
    pair = _gram_linear(model, linears, x, v) if linears is not None else None
    method = "linear-layers"
    if pair is None:
        pair, method = _gram_generic(model, x, v), "vmap"
    gram, proj = (t.detach().to(torch.float64).cpu() for t in pair)
    theta_sq = float(sum(p.detach().double().pow(2).sum() for p in model.parameters() if p.requires_grad))
    evals, evecs = torch.linalg.eigh(gram)
    keep = evals > evals.max().clamp_min(0) * 1e-13
    root = evals[keep].sqrt()
    a = (root[:, None] * evecs[:, keep].T).numpy()
    b = ((evecs[:, keep].T @ proj) / root).numpy()
    lam, _ = nnls(a, b, maxiter=50 * max(a.shape[1], 10))
    lam_t = torch.from_numpy(lam)
    res_sq = theta_sq - 2 * float(lam_t @ proj) + float(lam_t @ gram @ lam_t)
    residual = math.sqrt(max(res_sq, 0.0) / theta_sq) if theta_sq > 0 else float("nan")
    kinks = 0
    if kink_tol > 0:
        if linears is None:
            raise ConfigError("kink_tol needs a network made of Linear layers (an MLP) (argument kink_tol)")
        lam_t, res_sq, kinks = _kink_relaxed(model, linears, x, v, theta_sq, lam_t, res_sq, float(kink_tol),
                                             max_kinks)
        residual = math.sqrt(max(res_sq, 0.0) / theta_sq) if theta_sq > 0 else float("nan")
        method += "+kinks"
    marg = margins(out, y).detach().double().cpu()
    groups, n = v.shape[:2]
    multipliers = lam_t.reshape(groups, n).T.squeeze(1) if groups > 1 else lam_t
    low = float(marg.min())
    normalized = marg / low if low > 0 else torch.full_like(marg, float("nan"))
    return KKTResidual(residual=residual, multipliers=multipliers, margins=marg, normalized_margins=normalized,
                       theta_norm=math.sqrt(theta_sq), method=method, kink_tol=float(kink_tol), kinks=kinks)


def _kink_relaxed(model: nn.Module, linears: list[nn.Linear], x: torch.Tensor, v: torch.Tensor, theta_sq: float,
                  lam0: torch.Tensor, res0: float, tol: float, max_kinks: int, iterations: int = 5000):
    """min over λ ≥ 0, 0 ≤ μ_k ≤ λ_{c(k)} of ‖θ − Σ_c λ_c G⁻_c − Σ_k μ_k E_k‖² (FISTA), from the NNLS point.

    G⁻_c: the gradient of s_c with the derivative of its near-kink first-layer pairs set to 0;
    E_k, k = (c, j): the first-layer row-j gradient u_cj·(x_i, 1) that a derivative of 1 adds.
    """
    got = _layer_terms(model, linears, x, v, act_grad=True)
    if got is None or got[1] is None:
        raise ConfigError("kink_tol needs an MLP whose first Linear layer feeds a ReLU module (argument kink_tol)")
    terms, u = got
    first = linears[0]
    h1, d1, z1 = terms[0]
    groups, n = v.shape[0], h1.shape[0]
    bias = 1.0 if first.bias is not None else 0.0
    w_sq = first.weight.detach().pow(2).sum(1) + (first.bias.detach().pow(2) if first.bias is not None else 0.0)
    x_norm = (h1.pow(2).sum(1) + bias).sqrt()
    near = (z1.abs() <= tol * x_norm[:, None] * w_sq.sqrt()[None, :]).repeat(groups, 1)  # (C, W)
    near &= u != 0
    idx = near.nonzero()
    kinks = int(idx.shape[0])
    if kinks == 0:
        return lam0, res0, 0
    if kinks > max_kinks:
        raise ConfigError(f"kink_tol={tol} relaxes {kinks} (sample, neuron) pairs, more than max_kinks={max_kinks}; "
                          "use a smaller kink_tol (argument kink_tol)")
    cs, js = idx[:, 0], idx[:, 1]
    rows = cs % n
    d1m = d1.masked_fill(near, 0.0)
    gram0, proj0 = _assemble(linears, [(h1, d1m, z1), *terms[1:]], groups)
    hh = h1 @ h1.T + bias
    uk = u[cs, js]
    ee = (js[:, None] == js[None, :]).to(hh.dtype) * (uk[:, None] * uk[None, :]) * hh[rows][:, rows]
    ge = d1m[:, js] * uk[None, :] * hh.repeat(groups, 1)[:, rows]
    q = torch.cat([torch.cat([gram0, ge], 1), torch.cat([ge.T, ee], 1)]).double().cpu()
    p = torch.cat([proj0, uk * z1[rows, js]]).double().cpu()
    cs = cs.cpu()
    count = groups * n

    # the relaxed pairs of each column c, padded: slot[k] is the position of pair k in its row
    order = torch.argsort(cs, stable=True)
    per = torch.bincount(cs, minlength=count)
    width = int(per.max())
    slot = torch.empty_like(cs)
    slot[order] = torch.arange(kinks) - torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
    filled = torch.zeros(count, width, dtype=torch.bool)
    filled[cs, slot] = True
    steps_t = torch.arange(width + 1, dtype=torch.float64)

    def project(w: torch.Tensor) -> torch.Tensor:
        # Projection on {0 ≤ μ_k ≤ λ_c}: λ_c = max_t (a_c + sum of the t largest b_k of c)/(1 + t), clipped at 0
        # (each t gives a lower bound of the root of λ = a_c + Σ_k (b_k − λ)_+, the right t gives the root).
        a, b = w[:count], w[count:]
        pad = torch.full((count, width), -math.inf, dtype=torch.float64)
        pad[cs, slot] = b
        top = torch.sort(pad, dim=1, descending=True).values
        sums = torch.cumsum(torch.where(torch.isfinite(top), top, 0.0), 1)
        cand = (a[:, None] + torch.cat([torch.zeros(count, 1, dtype=torch.float64), sums], 1)) / (1 + steps_t)
        cand[:, 1:] = cand[:, 1:].masked_fill(~torch.isfinite(top), -math.inf)
        lam = cand.max(1).values.clamp_min(0)
        return torch.cat([lam, torch.minimum(b.clamp_min(0), lam[cs])])

    def value(w: torch.Tensor) -> float:
        return theta_sq - 2 * float(w @ p) + float(w @ (q @ w))

    s0 = (z1[rows, js] > 0).to(torch.float64).cpu()  # the plain derivative: the NNLS point is feasible
    w = torch.cat([lam0.double(), lam0.double()[cs] * s0])
    best, best_w = value(w), w
    step = 1.0 / (2 * float(torch.linalg.eigvalsh(q).max()))
    prev, z, t = w, w, 1.0
    last = best
    for it in range(iterations):
        w = project(z - step * 2 * (q @ z - p))
        t_next = (1 + math.sqrt(1 + 4 * t * t)) / 2
        z = w + ((t - 1) / t_next) * (w - prev)
        prev, t = w, t_next
        if it % 50 == 0 or it == iterations - 1:
            f = value(w)
            if f < best:
                best, best_w = f, w
        if it % 1000 == 999:  # stop when 1 000 iterations gain less than 10⁻⁶ of ‖θ‖²
            if last - best < 1e-6 * theta_sq:
                break
            last = best
    return best_w[:count], min(best, res0), kinks
