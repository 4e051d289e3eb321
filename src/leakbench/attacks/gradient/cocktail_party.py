"""Cocktail Party Attack (Kariyappa, Guo, Hannun, Hajipour, Ramakrishnan & Bhatt, ICML 2023).

The weight gradient of a fully connected layer W (n×d) is ∇W = Σ_i δ_i z_iᵀ = Δ Z: every row is
a linear mixture of the B inputs z_i (Sec. 3 of the paper), a blind source separation problem.
CPA solves it by ICA (Sec. 4):

1. centre every row of ∇W over the d input coordinates and whiten to B components
   (PCA of the n mixtures; the whitened signals Ẑ, B×d, have identity covariance).
   Option ``domain="edges"`` (the default for image inputs) first applies one fixed linear filter
   to every row — horizontal and vertical pixel differences — which keeps the mixing matrix Δ
   but makes the sources far sparser and less correlated, the regime ICA needs: photos of a
   batch are correlated in pixel space (centred cosines of 0.8–0.9), not in their edges.  The
   unmixing learnt there is applied to the unfiltered mixtures.  This is our addition;
   ``domain="pixels"`` (preset ``paper``) unmixes the rows themselves as the paper does.
   The ``paper`` preset also turns on the paper's TV term (its objective is −J + λ_TV·TV + λ_MI·R_MI,
   and its ablation ranks TV the second most important term: LPIPS 0.081 → 0.368 without it);
   λ_TV = 10 on our TV (mean absolute neighbour difference of unit-variance sources), chosen on
   held-out CIFAR-10 batches (the sweep and the no-TV control are in docs/reproductions.md);
2. learn an unmixing matrix U (rows unit-normalised) with Adam on
   −J(UẐ) + λ_MI·R_MI(U) + λ_TV·TV(UẐ) [images] or + λ_NV·R_NV(UẐ) [embeddings], where
   J(s) = (E[G(s)] − E[G(ν)])² is the negentropy approximation with G = log cosh (ν ~ N(0, 1)),
   R_MI = mean_{i≠j} exp(T·|cos(u_i, u_j)|) − 1 the decorrelation penalty, TV the image prior
   and R_NV = mean_i min(‖ReLU(s_i)‖, ‖ReLU(−s_i)‖) the sign prior of embeddings.  The public
   code silently leaves the negentropy term out; here its weight is the explicit option
   ``negentropy`` (default 20: J of a unit-variance source is ~10⁻², so a weight of 1 leaves the
   decorrelation term in charge and Adam barely separates; measured on bundled photos);
3. resolve sign and scale.  Each source is s_i = (z_i − mean(z_i))/a_i up to the unmixing; with a
   bias the layer also shares ∇b = Δ 1, which fixes a_i and the means exactly by least squares
   (∇W Ŝ⁺ = Δ diag(a), ∇W 1/d = Δ c) — an analytic step we add to the paper's post-processing.
   Without a bias the means follow up to a common scale per source; the sign is the one that
   makes the input non-negative-valued where the data range is, and the image is min-max scaled
   to the data range (the paper's post-processing);
4. for a layer deeper in the model (CNN features), invert the recovered embeddings to images by
   feature inversion (1 − cos(f(x̂), ẑ) + TV), as CPA does.

Limits: n ≥ B outputs; ICA recovers the sources up to permutation.  The recovered (centred,
unit-variance) sources and the resolved inputs/embeddings are in ``trace``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import expect
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..solvers.objectives import total_variation
from ..solvers.feature_blocks import invert_features
from ..solvers.linalg import lstsq
from ..observed import attacker_model, block_input, shared_gradient

DOMAINS = ("edges", "pixels")

#: E[log cosh ν] for ν ~ N(0, 1): the Gaussian reference of the negentropy approximation.
GAUSSIAN_LOGCOSH = 0.3745672075


def first_linear(model: nn.Module) -> tuple[str, nn.Linear] | None:
    """Name and module of the first nn.Linear in ``model`` (the layer CPA attacks)."""
    return next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)), None)


def whitening(mixtures: torch.Tensor, components: int) -> torch.Tensor:
    """The whitening matrix K (components×n) of the row-centred mixtures (n×d): K·centred has
    identity covariance (K centred centredᵀ Kᵀ / d = I), from the top principal components."""
    centred = mixtures - mixtures.mean(dim=1, keepdim=True)
    u, s, _ = torch.linalg.svd(centred, full_matrices=False)
    return (u[:, :components] / s[:components].clamp_min(1e-300)).T * math.sqrt(mixtures.shape[1])


def edges(signals: torch.Tensor, image_shape: tuple[int, ...]) -> torch.Tensor:
    """Horizontal and vertical differences of each row seen as an image (a linear filter: the mixing is kept)."""
    im = signals.reshape(signals.shape[0], *image_shape)
    return torch.cat([(im[..., 1:] - im[..., :-1]).flatten(1), (im[..., 1:, :] - im[..., :-1, :]).flatten(1)], 1)


def negentropy(sources: torch.Tensor) -> torch.Tensor:
    """Σ_i (E[log cosh s_i] − E[log cosh ν])² over rows s_i (unit variance)."""
    logcosh = sources.abs() + torch.log1p(torch.exp(-2 * sources.abs())) - math.log(2.0)
    return (logcosh.mean(dim=1) - GAUSSIAN_LOGCOSH).pow(2).sum()


def decorrelation(unmixing: torch.Tensor, temperature: float) -> torch.Tensor:
    """mean_{i≠j} exp(T·|cos(u_i, u_j)|) − 1 for unit rows u_i."""
    b = unmixing.shape[0]
    if b < 2:
        return unmixing.new_zeros(())
    cos = (unmixing @ unmixing.T).abs()
    off = ~torch.eye(b, dtype=torch.bool, device=unmixing.device)
    return (torch.exp(temperature * cos[off]) - 1).mean()


@dataclass
class CPAOptions:
    """Options of ``cocktail-party`` (weights of the unmixing objective, budgets)."""

    iterations: int = 1000
    lr: float = 1e-2
    negentropy: float = 20.0     # weight of −J; the public code's silent 0 is negentropy=0
    decorrelation: float = 1.0
    temperature: float = 5.0
    tv: float = 0.0
    sign: float = 1.0            # λ_NV for embeddings
    domain: str = "edges"        # "pixels": unmix the gradient rows as in the paper; "edges": see below
    inversion_iterations: int = 1000
    inversion_lr: float = 0.1
    inversion_tv: float = 1e-2

    def check(self) -> None:
        expect(self.iterations >= 1 and self.inversion_iterations >= 0,
               f"expected iterations ≥ 1 and inversion_iterations ≥ 0, got {self.iterations}, "
               f"{self.inversion_iterations}")
        expect(self.lr > 0 and self.inversion_lr > 0, "expected lr > 0 and inversion_lr > 0")
        expect(self.domain in DOMAINS, f"expected domain in {DOMAINS}, got {self.domain!r} (option domain)")
        for name in ("negentropy", "decorrelation", "temperature", "tv", "sign", "inversion_tv"):
            expect(getattr(self, name) >= 0, f"expected {name} ≥ 0, got {getattr(self, name)} (option {name})")


def unmix(white: torch.Tensor, pixels: torch.Tensor, *, image_shape: tuple[int, ...] | None,
          options: CPAOptions, seed: int = 0, progress=None) -> torch.Tensor:
    """Learn the unmixing U of whitened signals ``white`` (B×d'); return U·``pixels`` (B×d) with
    unit-variance rows, where ``pixels`` are the same whitened mixtures before any filtering."""
    b = white.shape[0]
    gen = torch.Generator().manual_seed(int(seed))
    u = (torch.eye(b, dtype=white.dtype) + 0.01 * torch.randn((b, b), generator=gen, dtype=white.dtype))
    u = u.to(white.device).requires_grad_(True)
    opt = torch.optim.Adam([u], lr=options.lr)

    def pixel_sources(unit):
        src = unit @ pixels
        return src / src.std(dim=1, keepdim=True).clamp_min(1e-12)

    for step in range(options.iterations):
        unit = u / u.norm(dim=1, keepdim=True).clamp_min(1e-12)
        loss = options.decorrelation * decorrelation(unit, options.temperature)
        if options.negentropy:
            loss = loss - options.negentropy * negentropy(unit @ white)
        if image_shape is not None and options.tv:
            loss = loss + options.tv * total_variation(pixel_sources(unit).reshape(b, *image_shape))
        if image_shape is None and options.sign:
            src = pixel_sources(unit)
            loss = loss + options.sign * torch.minimum(torch.relu(src).norm(dim=1),
                                                       torch.relu(-src).norm(dim=1)).mean() / math.sqrt(src.shape[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if progress is not None and (step % 100 == 0 or step == options.iterations - 1):
            progress(step + 1, options.iterations, float(loss.detach()))
    with torch.no_grad():
        return pixel_sources(u / u.norm(dim=1, keepdim=True).clamp_min(1e-12))


def resolve_scale(sources: torch.Tensor, grad_w: torch.Tensor, grad_b: torch.Tensor | None,
                  *, nonnegative: bool) -> torch.Tensor:
    """Inputs z_i = a_i s_i + c_i from sources s_i (B×d, centred) and the layer's gradients.

    With ∇b: ∇W Ŝ⁺ = Δ diag(a) =: M, ∇b = Δ 1 = M (1/a), ∇W 1/d = Δ c: exact least squares.
    Without: c_i/a_i from ∇W 1/d = M (c/a); the remaining factor a_i is set to 1 and its sign makes
    the input mostly non-negative when ``nonnegative`` (callers rescale).
    """
    s = sources.double()
    gw = grad_w.double()
    mix = gw @ torch.linalg.pinv(s)                      # n×B = Δ diag(a)
    means = gw.mean(dim=1)                               # Δ c
    if grad_b is not None:
        inv_a = lstsq(mix, grad_b.double().reshape(-1, 1)).reshape(-1)
        delta = mix * inv_a[None, :]
        c = lstsq(delta, means.reshape(-1, 1)).reshape(-1)
        return (s / inv_a[:, None] + c[:, None]).to(sources.dtype)
    ratio = lstsq(mix, means.reshape(-1, 1)).reshape(-1)   # c / a
    z = s + ratio[:, None]
    if nonnegative:
        flip = (z.clamp_min(0).sum(1) < (-z).clamp_min(0).sum(1))
        z = torch.where(flip[:, None], -z, z)
    return z.to(sources.dtype)


@register
class CocktailParty(Attack):
    """Cocktail Party Attack: ICA unmixing of the first FC layer's weight gradient (+ feature inversion for CNNs)."""

    name = "cocktail-party"
    tags = ("gradient", "update")
    Options = CPAOptions
    presets = {"quick": {"iterations": 500, "inversion_iterations": 200}, "paper": {"domain": "pixels", "tv": 10.0}}

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["cocktail-party needs a shared gradient or update, not trained weights"]
        found = first_linear(obs.model)
        if found is None:
            return ["cocktail-party needs a fully connected (nn.Linear) layer to unmix"]
        _, layer = found
        if shared_gradient(obs, layer.weight) is None:
            return ["the first linear layer's weight is not among the shared parameters"]
        if layer.out_features < obs.batch_size:
            return [f"cocktail-party needs at least as many outputs as samples in the first linear layer "
                    f"(got {layer.out_features} < batch {obs.batch_size})"]
        if layer.in_features < obs.batch_size:
            return [f"batch {obs.batch_size} exceeds the layer's input dimension {layer.in_features}"]
        return []

    def _on_input(self, obs: Observation, layer: nn.Linear) -> bool:
        return layer.in_features == math.prod(obs.input_shape) and _sees_input(obs, layer)

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        o = self.options
        _, layer = first_linear(obs.model)
        grad_w = shared_gradient(obs, layer.weight)
        grad_b = shared_gradient(obs, layer.bias) if layer.bias is not None else None
        b = obs.batch_size
        on_input = self._on_input(obs, layer)
        image_shape = tuple(obs.input_shape) if on_input and len(obs.input_shape) == 3 else None
        mixtures = grad_w.double()
        centred = mixtures - mixtures.mean(dim=1, keepdim=True)
        if image_shape is not None and o.domain == "edges":
            filtered = edges(centred, image_shape)
            k = whitening(filtered, b)
            white = k @ (filtered - filtered.mean(dim=1, keepdim=True))
        else:
            k = whitening(mixtures, b)
            white = k @ centred
        sources = unmix(white, k @ centred, image_shape=image_shape, options=o, seed=seed,
                        progress=progress if on_input else None)
        lo, hi = obs.data_range
        z = resolve_scale(sources, grad_w, grad_b, nonnegative=(lo >= 0) or not on_input)
        trace = {"sources": sources.to(obs.dtype), "features": z.to(obs.dtype), "on_input": on_input}
        if on_input:
            if grad_b is None:  # scale unknown: the paper's min-max post-processing
                z = z - z.min(dim=1, keepdim=True).values
                z = lo + (hi - lo) * z / z.max(dim=1, keepdim=True).values.clamp_min(1e-12)
            images = z.clamp(lo, hi).reshape(b, *obs.input_shape).to(obs.dtype)
        else:
            images = invert_features(obs, layer, z.to(obs.dtype), iterations=o.inversion_iterations,
                                     lr=o.inversion_lr, tv=o.inversion_tv, squared=False, seed=seed,
                                     progress=progress)
        return Reconstruction(images=images, trace=trace)


def _sees_input(obs: Observation, layer: nn.Linear) -> bool:
    """True when ``layer``'s input is the flattened model input (only reshapes before it)."""
    model = attacker_model(obs)
    name = next(n for n, m in obs.model.named_modules() if m is layer)
    probe = torch.rand((2, *obs.input_shape), generator=torch.Generator().manual_seed(0)).to(obs.device, obs.dtype)
    with torch.no_grad():
        z = block_input(model, model.get_submodule(name), probe)
    return z.shape[1] == probe[0].numel() and torch.equal(z, probe.reshape(2, -1))
