"""Defenses from the gradient-leakage literature: soteria, topk (with error feedback), mixup, instahide.

- ``soteria:p`` — Soteria (Sun, Li, Wang, Chen & Li, CVPR 2021, "Provable defense against privacy
  leakage in federated learning from representation perspective").  The representation r = f(X) is
  the input of the network's last fully connected layer (the paper's "FC layer").  Removing element
  i of r moves the reconstruction by about ‖r (∂r/∂X)⁻¹‖ ≈ ‖r_i‖ / ‖∇_X r_i‖ (the single-element
  approximation of Sec. 4 that the authors' code writes as "use ||r||/||d(f(r))/dX|| to approximate
  ||r(d(f(r))/dX)^-1||"); the client perturbs the ⌊p·d⌋ elements with the largest ratio, i.e. the
  FC layer's weight gradient ∂ℓ/∂W = δ rᵀ is computed with those elements of r set to zero
  (the columns of torch's out × in weight, the rows of the paper's rδᵀ).  Every other tensor (the
  bias, all earlier layers) is the plain gradient, bit for bit.  For a batch the ratio is summed
  over the samples (per sample: ∇_{X_b} r_{b,i}, exact in eval mode); the authors' code sums the
  inverse ratio and prunes its smallest values, which orders the elements the same at B = 1.
- ``topk:k[,ef]`` — top-k sparsification with error feedback (Stich, Cordonnier & Jaggi,
  NeurIPS 2018, "Sparsified SGD with memory", Alg. 1; Karimireddy et al., ICML 2019, EF-SGD
  Alg. 2): p_t = g_t + e_t, the client sends Δ_t = top_k(p_t) (the ⌈k·n⌉ entries of largest
  magnitude over the whole gradient, at least one) and keeps e_{t+1} = p_t − Δ_t.  The learning
  rate is applied by the server, so the memory holds gradient units (γ = 1 in Alg. 2).  The residual
  belongs to one client's run: it is kept per random stream (one per :func:`~.pipeline.share`
  caller's generator: one per training run, per seed, per observation) and per client under
  ``secagg:L`` (the L clients of one observation share its generator, each keeps its own e_t), so a fresh
  observation starts from e_0 = 0 and utility training carries it from step to step.  ``ef=false`` is plain top-k.
- ``mixup:α`` — MixUp (Zhang, Cisse, Dauphin & Lopez-Paz, ICLR 2018, eq. 1): x̃ = λ x_i + (1 − λ) x_j,
  ỹ = λ y_i + (1 − λ) y_j with λ ~ Beta(α, α), one λ per step and j = π(i) for a random permutation π
  of the step's batch (the authors' code); the loss is λ ℓ(f(x̃), y) + (1 − λ) ℓ(f(x̃), y_π), which is
  the cross-entropy with the mixed label ỹ.
- ``instahide:k[,c]`` — InstaHide, inside-dataset (Huang, Song, Li & Arora, ICML 2020, Sec. 3,
  eq. 2–3): each image is mixed with k − 1 others of the client's batch, x̃ = σ ∘ Σ_j λ_j x_{i_j},
  ỹ = Σ_j λ_j y_{i_j}, with a fresh one-time pixel-wise sign mask σ ∈ {±1}^d per encoding.  The
  paper normalises pixels to [−1, 1] before the sign flip; here the flip acts on the pixels centred
  on the data box (x − m with m its midpoint) and the encoding is shifted back, m + σ ∘ Σ λ_j (x_j − m),
  so it stays in the data box.  The paper asks λ random with Σ λ_j = 1 and λ_j ≤ c (c = 0.65 by
  default); we draw λ uniformly on the simplex and redraw rows whose largest coefficient exceeds c.
  The partners are k − 1 random permutations of the batch (each image enters exactly k encodings);
  the loss is the cross-entropy with the soft label ỹ.

soteria, mixup and instahide replace how one step's gradient is computed (stage ``step``, like DP-SGD:
one such defense per spec); topk acts on the shared tensors.
"""
from __future__ import annotations

import abc

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..errors import ConfigError
from .base import ClientPlan, Defense, check_fraction, check_positive, current_client, register
from .gradient import _flat, _unflat


# --------------------------------------------------------------------------- Soteria


def representation_layer(model: nn.Module, names: list[str] | None = None) -> tuple[str, nn.Linear]:
    """(name, module) of the last ``nn.Linear`` of ``model``: Soteria's FC layer, whose input is the representation."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)
             and (names is None or f"{n}.weight" in names)]
    if not found:
        raise ConfigError("defense soteria needs a model whose classifier is a fully connected layer (nn.Linear with "
                          "a trainable weight): its input is the representation Soteria perturbs")
    return found[-1]


def soteria_scores(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                   layer: nn.Module) -> torch.Tensor:
    """Σ_b ‖r_{b,i}‖ / ‖∇_{X_b} r_{b,i}‖ for every element i of the representation (0/0 counts 0)."""
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    xin = x.detach().requires_grad_(True)
    try:
        with torch.enable_grad():
            functional_call(model, {n: p.detach() for n, p in params.items()}, (xin,), strict=False)
    finally:
        handle.remove()
    r = seen[-1].reshape(x.shape[0], -1)
    d = r.shape[1]
    eye = torch.eye(d, dtype=r.dtype, device=r.device)
    try:  # one batched vector-Jacobian product per element i: ∂(Σ_b r_{b,i})/∂X, whose block b is ∇_{X_b} r_{b,i}
        jac = torch.autograd.grad(r, xin, grad_outputs=eye[:, None, :].expand(d, *r.shape), is_grads_batched=True)[0]
        norms = jac.flatten(2).norm(dim=2).T  # B × d
    except RuntimeError:  # an op without a batching rule: the same products one element after the other
        norms = torch.stack([torch.autograd.grad(r[:, i].sum(), xin, retain_graph=True)[0].flatten(1).norm(dim=1)
                             for i in range(d)], dim=1)
    ratio = torch.where(norms > 0, r.detach().abs() / norms.clamp_min(torch.finfo(r.dtype).tiny),
                        torch.where(r.detach() != 0, torch.full_like(norms, float("inf")), torch.zeros_like(norms)))
    return ratio.sum(0)


def soteria_mask(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean mask over the representation, False on the ⌊p·d⌋ elements of largest score (the pruned ones)."""
    from .gradient import pruned_count

    d = scores.numel()
    drop = pruned_count(p, d)
    keep = torch.ones(d, dtype=torch.bool, device=scores.device)
    if drop:
        keep[torch.topk(scores, drop, sorted=False).indices] = False
    return keep


def soteria_gradient(model, params, x, y, loss_fn, generator, *, p: float) -> list[torch.Tensor]:
    """The plain mean-loss gradient with the FC weight's columns of the pruned representation elements zeroed."""
    from .pipeline import mean_gradient

    grads = mean_gradient(model, params, x, y, loss_fn, generator)
    name, layer = representation_layer(model, list(params))
    keep = soteria_mask(soteria_scores(model, params, x, layer), p)
    index = list(params).index(f"{name}.weight")
    grads[index] = grads[index] * keep.to(grads[index].dtype)[None, :]
    return grads


class _StepDefense(Defense, abc.ABC):
    """A defense that replaces one step's gradient (stage ``step``: one such defense per spec)."""

    stage = "step"

    @abc.abstractmethod
    def gradient(self, model, params, x, y, loss_fn, generator) -> list[torch.Tensor]:
        """The client's step gradient under this defense, one tensor per parameter."""

    def configure(self, plan: ClientPlan) -> None:
        if plan.gradient is not None:
            raise ConfigError(f"expected one defense that replaces the client's gradient, got {plan.gradient_owner!r} "
                              f"and {self.spec!r}")
        plan.gradient, plan.gradient_owner = self.gradient, self.spec


@register("soteria", help="Soteria (Sun et al. 2021): prune the fraction p of the representation's elements of largest "
                          "‖r_i‖/‖∇_X r_i‖ from the FC layer's weight gradient (soteria:p)")
class Soteria(_StepDefense):
    def __init__(self, p: float) -> None:
        self.p = check_fraction(p, "the pruned fraction p of the representation", "soteria")

    def gradient(self, model, params, x, y, loss_fn, generator):
        return soteria_gradient(model, params, x, y, loss_fn, generator, p=self.p)

    def describe(self) -> dict[str, Any]:
        return {"pruned_fraction": self.p, "layer": "the last fully connected layer's weight"}


# --------------------------------------------------------------------------- top-k with error feedback


def topk_count(k: float, n: int) -> int:
    """How many of ``n`` entries top-k keeps: ⌈k·n⌉, at least one."""
    return max(1, min(n, int(math.ceil(k * n - 1e-9 * max(1, n)))))


def topk_sparsify(grads: list[torch.Tensor], k: float) -> list[torch.Tensor]:
    """Keep the ⌈k·n⌉ entries of largest magnitude over all tensors, zero the rest."""
    flat = _flat(grads)
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[torch.topk(flat.abs(), topk_count(k, flat.numel()), sorted=False).indices] = True
    return _unflat(flat * mask, grads)


def error_feedback(grads: list[torch.Tensor], residual: list[torch.Tensor] | None,
                   k: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(Δ_t = top_k(g_t + e_t), e_{t+1} = g_t + e_t − Δ_t): one round of EF-SGD (Karimireddy et al. Alg. 2)."""
    p = list(grads) if residual is None else [g + e for g, e in zip(grads, residual)]
    sent = topk_sparsify(p, k)
    return sent, [a - s for a, s in zip(p, sent)]


@register("topk", help="top-k sparsification: send the fraction k of entries of largest magnitude, carrying the rest "
                       "into the next round (error feedback, Stich et al. 2018; off with ef=false) (topk:k[,ef])")
class TopK(Defense):
    def __init__(self, k: float, ef: bool = True) -> None:
        self.k = check_fraction(k, "the kept fraction k", "topk")
        if self.k == 0:
            raise ConfigError("expected the kept fraction k in (0, 1] for defense 'topk', got 0 (nothing would be sent)")
        self.ef = bool(ef)
        self._memory: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        """A copy sent to another process starts without memory (a run's residual stays with its stream)."""
        return {k: v for k, v in self.__dict__.items() if k != "_memory"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._memory = weakref.WeakKeyDictionary()

    def residual(self, generator: torch.Generator, client: int = 0) -> list[torch.Tensor] | None:
        """e_t of the client run drawing from ``generator`` (None before its first round); ``client``: its index
        under secure aggregation (the clients of one observation share a generator, not a memory)."""
        return self._memory.get(generator, {}).get(client)

    def apply_gradients(self, grads, *, generator):
        if not self.ef:
            return topk_sparsify(grads, self.k)
        memory = self._memory.setdefault(generator, {})
        client = current_client()
        old = memory.get(client)
        if old is not None and [tuple(e.shape) for e in old] != [tuple(g.shape) for g in grads]:
            old = None  # another model's round on the same stream: its own memory
        sent, memory[client] = error_feedback(grads, old, self.k)
        return sent

    def describe(self) -> dict[str, Any]:
        return {"kept_fraction": self.k, "error_feedback": self.ef}


# --------------------------------------------------------------------------- MixUp and InstaHide


def mixup_inputs(x: torch.Tensor, lam: float, perm: torch.Tensor) -> torch.Tensor:
    """x̃ = λ x + (1 − λ) x_π (Zhang et al. eq. 1)."""
    return lam * x + (1.0 - lam) * x[perm]


def mixup_gradient(model, params, x, y, loss_fn, generator, *, alpha: float) -> list[torch.Tensor]:
    """∇θ [λ ℓ(f(x̃), y) + (1 − λ) ℓ(f(x̃), y_π)] with λ ~ Beta(α, α) and π a random permutation."""
    lam = _beta(alpha, generator)
    perm = torch.randperm(x.shape[0], generator=generator).to(x.device)
    mixed = mixup_inputs(x, lam, perm)
    live = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    out = functional_call(model, live, (mixed,), strict=False)
    loss = lam * loss_fn(out, y) + (1.0 - lam) * loss_fn(out, y[perm])
    return [g.detach() for g in torch.autograd.grad(loss, list(live.values()))]


def _beta(alpha: float, generator: torch.Generator) -> float:
    """λ ~ Beta(α, α) from ``generator`` by inversion: the regularised incomplete beta's inverse at U(0, 1)."""
    from scipy.special import betaincinv

    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    return float(betaincinv(float(alpha), float(alpha), u))


def simplex_coefficients(rows: int, k: int, cap: float, generator: torch.Generator) -> torch.Tensor:
    """``rows`` × ``k`` coefficients uniform on the simplex (normalised Exp(1) draws), each row's largest ≤ ``cap``."""
    out = torch.empty(rows, k, dtype=torch.float64)
    todo = torch.arange(rows)
    for _ in range(10_000):
        if todo.numel() == 0:
            return out
        e = -torch.log(torch.rand(todo.numel(), k, generator=generator, dtype=torch.float64).clamp_min(1e-300))
        lam = e / e.sum(1, keepdim=True)
        ok = lam.max(1).values <= cap
        out[todo[ok]] = lam[ok]
        todo = todo[~ok]
    raise ConfigError(f"could not draw InstaHide coefficients with max ≤ {cap} for k={k}")  # pragma: no cover


def instahide_encode(x: torch.Tensor, lam: torch.Tensor, partners: torch.Tensor, signs: torch.Tensor,
                     mid: float) -> torch.Tensor:
    """m + σ ∘ Σ_j λ_j (x_{partners[:, j]} − m): the encodings (Huang et al. eq. 2, centred on the box midpoint m)."""
    centred = x - mid
    mixed = sum(lam[:, j].to(x.dtype).view(-1, *[1] * (x.dim() - 1)) * centred[partners[:, j]]
                for j in range(partners.shape[1]))
    return mid + signs * mixed


def instahide_draw(x: torch.Tensor, k: int, cap: float, generator: torch.Generator):
    """(λ B×k, partners B×k — column 0 the image itself, the others random permutations —, signs ±1 like x)."""
    b = x.shape[0]
    lam = simplex_coefficients(b, k, cap, generator)
    partners = torch.stack([torch.arange(b)] + [torch.randperm(b, generator=generator) for _ in range(k - 1)], 1)
    signs = torch.where(torch.rand(x.shape, generator=generator) < 0.5, -1.0, 1.0).to(x)
    return lam, partners.to(x.device), signs


def soft_targets(y: torch.Tensor, lam: torch.Tensor, partners: torch.Tensor, classes: int) -> torch.Tensor:
    """ỹ_i = Σ_j λ_ij e_{y_{partners[i, j]}} (B × classes)."""
    onehot = F.one_hot(y.long(), classes).to(torch.float64)
    return sum(lam[:, j:j + 1] * onehot[partners[:, j]] for j in range(partners.shape[1]))


def instahide_gradient(model, params, x, y, loss_fn, generator, *, k: int, cap: float,
                       data_range: tuple[float, float]) -> list[torch.Tensor]:
    """∇θ CE(f(x̃), ỹ) on the InstaHide encodings of the step's batch."""
    lam, partners, signs = instahide_draw(x, k, cap, generator)
    mixed = instahide_encode(x, lam, partners, signs, (data_range[0] + data_range[1]) / 2)
    live = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    out = functional_call(model, live, (mixed,), strict=False)
    if out.dim() != 2:
        raise ConfigError("defense instahide needs a classifier with B × classes outputs (it mixes the labels)")
    target = soft_targets(y, lam, partners, out.shape[1]).to(out.dtype)
    loss = F.cross_entropy(out, target)
    return [g.detach() for g in torch.autograd.grad(loss, list(live.values()))]


@register("mixup", help="MixUp (Zhang et al. 2018): train on λx_i + (1−λ)x_π(i) with mixed labels, λ ~ Beta(α, α) "
                        "(mixup:α)")
class MixUp(_StepDefense):
    def __init__(self, alpha: float = 1.0) -> None:
        self.alpha = check_positive(alpha, "the Beta parameter α", "mixup")

    def gradient(self, model, params, x, y, loss_fn, generator):
        return mixup_gradient(model, params, x, y, loss_fn, generator, alpha=self.alpha)

    def describe(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "mixed": 2}


@register("instahide", help="InstaHide (Huang et al. 2020), inside-dataset: mix each image with k−1 others of the batch "
                            "(coefficients ≤ c) and flip pixel signs with a one-time mask (instahide:k[,c[,lo,hi]])")
class InstaHide(_StepDefense):
    """``lo``, ``hi``: the data box whose midpoint the sign flip is centred on (digits and CIFAR-10: [0, 1])."""

    def __init__(self, k: int = 4, c: float = 0.65, lo: float = 0.0, hi: float = 1.0) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ConfigError(f"expected the number of mixed images k ≥ 2 (an int) for defense 'instahide', got {k!r}")
        self.k = k
        self.c = check_fraction(c, "the coefficient cap c", "instahide")
        if self.c * k < 1:
            raise ConfigError(f"expected the coefficient cap c ≥ 1/k = {1 / k:.3g} for defense 'instahide' (k "
                              f"coefficients summing to 1), got {c!r}")
        self.lo, self.hi = float(lo), float(hi)
        if not self.lo < self.hi:
            raise ConfigError(f"expected lo < hi (the data box) for defense 'instahide', got {lo!r}, {hi!r}")

    def gradient(self, model, params, x, y, loss_fn, generator):
        if x.shape[0] < 2:
            raise ConfigError("defense instahide mixes images of the client's batch: it needs a batch of ≥ 2")
        return instahide_gradient(model, params, x, y, loss_fn, generator, k=self.k, cap=self.c,
                                  data_range=(self.lo, self.hi))

    def describe(self) -> dict[str, Any]:
        return {"mixed": self.k, "cap": self.c, "box": [self.lo, self.hi]}


__all__ = ["Soteria", "TopK", "MixUp", "InstaHide", "representation_layer", "soteria_scores", "soteria_mask",
           "soteria_gradient", "topk_sparsify", "topk_count", "error_feedback", "mixup_inputs", "mixup_gradient",
           "instahide_encode", "instahide_draw", "instahide_gradient", "soft_targets", "simplex_coefficients"]
