"""PRECODE: a variational bottleneck before the output layer (``precode[:k[,beta]]``).

Scheliga, Mäder & Seeland, "PRECODE – A Generic Model Extension to Prevent Deep Gradient Leakage", WACV 2022,
Sec. 3: the model is extended by a variational module between its feature extractor and its output layer.  The
feature vector h (the input of the output layer) is encoded to the statistics of a k-dimensional Gaussian,
(μ, log σ²) = E(h), a fully connected layer with bias to 2k outputs; a latent code is sampled by the
reparameterisation trick z = μ + σ ⊙ ε, ε ~ N(0, I) (fresh in every training forward pass); a fully connected
decoder D maps z back to the feature width, and the original output layer follows: ŷ = f_out(D(z)).  Training
minimises ℓ(ŷ, y) + β · KL(N(μ, σ²) ‖ N(0, I)), KL = ½ Σ_j (μ_j² + σ_j² − log σ_j² − 1) per sample (averaged over
the batch).  At inference the mean z = μ is used (the variational-information-bottleneck practice the authors'
code follows).  Defaults k = 256, β = 10⁻³ as in the authors' code (``VariationalBottleneck(K=256, beta=1e-3)``);
that code parameterises σ = softplus(s − 5), the paper states the Gaussian's μ and σ without fixing the map:
we use log σ², the standard VAE parameterisation.

The bottleneck is part of the model the server distributes: :func:`~.pipeline.extend_model` inserts it (seeded)
into the model of :func:`leakbench.observe` and of the utility training, so the shared gradient covers its
encoder and decoder; the client computes its step's gradient through it with ε drawn from the round's generator
(stage ``step``).  A model that already holds a bottleneck (one trained with PRECODE) is used as it is.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ..errors import ConfigError
from .base import check_positive, register
from .literature import _StepDefense

#: the largest latent width accepted (a spec must not size the model without bound)
MAX_LATENT = 65536


class PrecodeBottleneck(nn.Module):
    """h ↦ D(z), z = μ + σ ⊙ ε with (μ, log σ²) = E(h): ε from :attr:`noise` when set, z = μ otherwise."""

    def __init__(self, width: int, k: int, *, generator: torch.Generator, device=None, dtype=None) -> None:
        super().__init__()
        self.k = int(k)
        self.encoder = nn.Linear(width, 2 * k, device=device, dtype=dtype)
        self.decoder = nn.Linear(k, width, device=device, dtype=dtype)
        self.noise: torch.Generator | None = None
        with torch.no_grad():  # torch's default Linear init, U(±1/√fan_in), drawn from the seeded generator
            for layer in (self.encoder, self.decoder):
                bound = 1.0 / math.sqrt(layer.in_features)
                for p in (layer.weight, layer.bias):
                    p.copy_((torch.rand(p.shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound)

    def statistics(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ, log σ²) of the encoder's output u = E(h)."""
        return split_statistics(self.encoder(h), self.k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.statistics(h)
        if self.noise is None:
            return self.decoder(mu)
        eps = torch.randn(mu.shape, generator=self.noise, device=self.noise.device).to(mu)
        return self.decoder(mu + torch.exp(0.5 * logvar) * eps)


class PrecodeHead(nn.Module):
    """The bottleneck followed by the model's original output layer (what replaces that layer in the model)."""

    def __init__(self, bottleneck: PrecodeBottleneck, output: nn.Linear) -> None:
        super().__init__()
        self.bottleneck = bottleneck
        self.output = output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.bottleneck(h))


def split_statistics(u: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's 2k outputs as (μ, log σ²)."""
    return u[..., :k], u[..., k:]


def kl_to_standard(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(μ, σ²) ‖ N(0, I)) = ½ Σ_j (μ_j² + σ_j² − log σ_j² − 1), one value per sample (last axis summed)."""
    return 0.5 * (mu.pow(2) + logvar.exp() - logvar - 1.0).sum(-1)


def find_head(model: nn.Module) -> tuple[str, PrecodeHead] | None:
    """(name, head) of the model's PRECODE head, or None when it has none."""
    return next(((n, m) for n, m in model.named_modules() if isinstance(m, PrecodeHead)), None)


def insert_bottleneck(model: nn.Module, k: int, generator: torch.Generator) -> nn.Module:
    """``model`` with its last ``nn.Linear`` (the output layer) replaced, in place, by bottleneck + that layer."""
    found = find_head(model)
    if found is not None:
        if found[1].bottleneck.k != k:
            raise ConfigError(f"expected a PRECODE bottleneck of latent width {k} (defense precode:{k}), the model "
                              f"already holds one of width {found[1].bottleneck.k}: use precode:"
                              f"{found[1].bottleneck.k} or a model without a bottleneck")
        return model
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears or not linears[-1][0]:
        raise ConfigError("defense precode inserts its bottleneck before the model's output layer: it needs a model "
                          "whose last fully connected layer (nn.Linear) is inside it, after a feature extractor")
    name, output = linears[-1]
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    neck = PrecodeBottleneck(output.in_features, k, generator=generator, device=output.weight.device,
                             dtype=output.weight.dtype)
    setattr(parent, child, PrecodeHead(neck, output))
    return model


def bottleneck_of(model: nn.Module) -> PrecodeBottleneck:
    found = find_head(model)
    if found is None:
        raise ConfigError("defense precode computes the step through its bottleneck, which this model lacks: "
                          "leakbench.observe and the utility training insert it (defenses.pipeline.extend_model); "
                          "a model of your own must be extended the same way before the round")
    return found[1].bottleneck


def precode_gradient(model, params, x, y, loss_fn, generator, *, beta: float) -> list[torch.Tensor]:
    """∇θ [ℓ(f_out(D(μ + σ ⊙ ε)), y) + β · mean_b KL_b] with ε ~ N(0, I) drawn from ``generator``."""
    neck = bottleneck_of(model)
    seen: list[torch.Tensor] = []
    handle = neck.encoder.register_forward_hook(lambda _m, _a, out: seen.append(out))
    neck.noise = generator
    live = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    try:
        out = functional_call(model, live, (x,), strict=False)
    finally:
        handle.remove()
        neck.noise = None
    mu, logvar = split_statistics(seen[-1], neck.k)
    loss = loss_fn(out, y) + beta * kl_to_standard(mu, logvar).mean()
    return [g.detach() for g in torch.autograd.grad(loss, list(live.values()))]


@register("precode", help="PRECODE (Scheliga et al. 2022): a variational bottleneck of latent width k before the "
                          "output layer, z = μ + σ⊙ε sampled in every client step, β·KL added to the loss "
                          "(precode[:k[,beta]])")
class Precode(_StepDefense):
    def __init__(self, k: int = 256, beta: float = 1e-3) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_LATENT:
            raise ConfigError(f"expected the latent width k an int in 1..{MAX_LATENT} for defense 'precode', "
                              f"got {k!r}")
        self.k = k
        self.beta = check_positive(beta, "the KL weight beta", "precode", allow_zero=True)

    def extend(self, model: nn.Module, generator: torch.Generator) -> nn.Module:
        return insert_bottleneck(model, self.k, generator)

    def gradient(self, model, params, x, y, loss_fn, generator):
        return precode_gradient(model, params, x, y, loss_fn, generator, beta=self.beta)

    def describe(self) -> dict[str, Any]:
        return {"latent": self.k, "beta": self.beta,
                "layer": "a variational bottleneck (encoder to μ, log σ²; decoder) before the output layer"}


__all__ = ["Precode", "PrecodeBottleneck", "PrecodeHead", "insert_bottleneck", "precode_gradient", "kl_to_standard",
           "split_statistics", "find_head", "bottleneck_of", "MAX_LATENT"]
