"""``precode-adaptive``: the attack that knows PRECODE's bottleneck (:mod:`leakbench.defenses.precode`).

PRECODE's encoder is a fully connected layer with bias whose input is the feature vector h_b of each sample
(the output of the known layers before it) and whose output u_b = W_enc h_b + b_enc holds (μ, log σ²).  Its
shared gradients are ∂W_enc = Σ_b δ_b h_bᵀ and ∂b_enc = Σ_b δ_b with δ_b = ∂L/∂u_b (the loss and the KL term
both act through u_b).  At B = 1 the feature vector is read off exactly, h = ∂W_encᵀ ∂b_enc / ‖∂b_enc‖² (the
bias trick of Phong et al. 2017 and Geiping et al. 2020, Sec. 3, applied to the bottleneck's input:
:func:`bottleneck_input`); the sampled ε enters only through δ_b.

Scheliga, Mäder & Seeland (2023, "Privacy Preserving Federated Learning with Convolutional Variational
Bottlenecks", Sec. 4; arXiv 2208.04767) show that PRECODE protects because the gradients of the bottleneck and
of the layers after it are stochastic, and break it by matching only the layers before the bottleneck.  We go
one step further and make that matching exact: for candidate inputs x with features H = [h_b] (B × d) the
encoder's gradient must equal Δ [H, 1] for some Δ = [δ_b] (2k × B); the least-squares Δ̂ = G Aᵀ(A Aᵀ)⁻¹ with
A = [H, 1] and G = [∂W_enc, ∂b_enc] absorbs the unknown ε (and the labels), and the layers before the bottleneck
then have the gradient Σ_b J_θ(h_b)ᵀ W_encᵀ δ̂_b — the vector-Jacobian product with the cotangent ∂L/∂h_b =
W_encᵀ δ_b, since h feeds only the encoder.  Inverting Gradients' objective (Geiping et al. 2020, eq. 4: cosine
distance, TV prior) is run on [those layers, Δ̂ A]; the decoder's and output layer's gradients, which depend on
ε, are left out (Scheliga et al.'s omission).  At the true batch the distance is exactly 0 for any ε, for
B ≤ d + 1 with distinct features.
"""
from __future__ import annotations

import dataclasses

import torch

from ...defenses.precode import find_head
from ...errors import ConfigError
from ...threat import Observation
from ..base import Reconstruction, register
from ..labels import recover_labels
from ..solvers.gradient_matching import GradientMatcher
from ..solvers.matching_settings import MatchingSettings
from ..solvers.objectives import GradientDistance, layer_weights
from ..solvers.adaptive_base import MATCH_PRESETS, AdaptiveAttack


def head_names(obs: Observation) -> tuple[str, list[str]]:
    """(PRECODE head's name, the observation's parameter names inside it); a clear error without one."""
    found = find_head(obs.model)
    if found is None:
        raise ConfigError("precode-adaptive needs the observation's model with its PRECODE bottleneck "
                          "(leakbench.observe(..., defense='precode:k') inserts it)")
    name = found[0]
    return name, [n for n in obs.param_names if n.startswith(name + ".")]


def bottleneck_input(obs: Observation) -> torch.Tensor:
    """The feature vector h entering the bottleneck, h = ∂W_encᵀ ∂b_enc / ‖∂b_enc‖² (exact at B = 1), as 1 × d."""
    if obs.batch_size != 1:
        raise ConfigError(f"the bottleneck's input is read off exactly at batch size 1, got {obs.batch_size} "
                          "(precode-adaptive matches a batch instead)")
    name, _ = head_names(obs)
    grads = dict(zip(obs.param_names, obs.gradients))
    gw, gb = grads[f"{name}.bottleneck.encoder.weight"], grads[f"{name}.bottleneck.encoder.bias"]
    return (gb @ gw / gb.pow(2).sum().clamp_min(1e-30))[None]


class BottleneckMatcher(GradientMatcher):
    """Gradient matching on the layers before PRECODE's bottleneck and its encoder, with δ_b solved in closed form."""

    def __init__(self, obs: Observation, settings: MatchingSettings) -> None:
        super().__init__(obs, dataclasses.replace(settings, factorise="off"))
        name, inside = head_names(obs)
        self.enc_w, self.enc_b = f"{name}.bottleneck.encoder.weight", f"{name}.bottleneck.encoder.bias"
        self.before = [n for n in self.names if n not in inside]
        grads = dict(zip(self.names, obs.gradients))
        self.g = torch.cat([grads[self.enc_w], grads[self.enc_b][:, None]], 1)  # G = [∂W_enc, ∂b_enc]
        kept = set(self.before) | {self.enc_w, self.enc_b}
        target = [t if n in kept else torch.zeros_like(t) for n, t in zip(self.names, obs.gradients)]
        self.distance = GradientDistance(target, kind=self.s.distance,
                                         weights=layer_weights(self.s.weights, [obs.params()[n] for n in self.names]))
        self._h: torch.Tensor | None = None
        dict(self.model.named_modules())[f"{name}.bottleneck"].register_forward_pre_hook(self._record)

    def _record(self, _module, args) -> None:
        self._h = args[0]

    def shared_of(self, x, target):
        self.forward(self.params, x)
        h = self._h
        b = h.shape[0]
        a = torch.cat([h.reshape(b, -1), torch.ones(b, 1, dtype=h.dtype, device=h.device)], 1)  # A = [H, 1]
        gram = a @ a.T  # a small ridge keeps identical candidates (the grey image) solvable
        ridge = (1e-7 * gram.diagonal().mean() + 1e-12) * torch.eye(b, dtype=a.dtype, device=a.device)
        delta = torch.linalg.solve(gram + ridge, a @ self.g.T).T  # Δ̂ = G Aᵀ (A Aᵀ)⁻¹, 2k × B
        cot = (self.params[self.enc_w].T @ delta).T.reshape(h.shape)  # ∂L/∂h_b = W_encᵀ δ̂_b
        before = torch.autograd.grad(h, [self.params[n] for n in self.before], grad_outputs=cot, create_graph=True,
                                     allow_unused=True)
        sim = {n: torch.zeros_like(self.params[n]) if g is None else g for n, g in zip(self.before, before)}
        fitted = delta @ a
        sim[self.enc_w], sim[self.enc_b] = fitted[:, :-1], fitted[:, -1]
        return [sim.get(n, torch.zeros_like(self.params[n])) for n in self.names]


@register
class PrecodeAdaptive(AdaptiveAttack):
    """PRECODE's bottleneck input matched exactly (δ_b in closed form), the ε-dependent layers left out."""

    name = "precode-adaptive"
    tags = ("gradient", "labels", "adaptive")
    adapts_to = ("precode",)
    Options = MatchingSettings
    presets = MATCH_PRESETS

    def requirements(self, obs: Observation) -> list[str]:
        reasons = super().requirements(obs)
        if not reasons and find_head(obs.model) is None:
            reasons.append("precode-adaptive needs the model with its PRECODE bottleneck (observe(..., "
                           "defense='precode:k') inserts it)")
        elif not reasons:
            width = find_head(obs.model)[1].output.in_features
            if obs.batch_size > width + 1:
                reasons.append(f"precode-adaptive solves one δ per sample from the encoder's {width + 1} columns: "
                               f"it needs a batch of at most {width + 1}, got {obs.batch_size}")
        return reasons

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        labels = recover_labels(obs, seed=seed)  # reported beside the images; the objective does not use them
        matcher = BottleneckMatcher(obs, self.options)
        result = matcher.run(labels, seed=seed, callback=callback, progress=progress)
        trace = dict(result.trace, matched="the layers before the bottleneck and its encoder (δ_b solved)")
        if obs.batch_size == 1:
            with torch.no_grad():
                read = bottleneck_input(obs)
                matcher.forward(matcher.params, result.images.to(obs.device, obs.dtype))
                trace["feature_error"] = float((matcher._h.reshape(1, -1) - read).norm() / read.norm().clamp_min(1e-30))
        return Reconstruction(images=result.images, labels=result.labels, trace=trace)


__all__ = ["PrecodeAdaptive", "BottleneckMatcher", "bottleneck_input", "head_names"]
