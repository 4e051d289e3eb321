"""A malicious server's imprint block on a text transformer's input vectors (Fowl et al., ICLR 2022, Sec. 3).

Fowl, Geiping, Czaja, Goldblum & Goldstein, "Robbing the Fed: Directly Obtaining Private Data in
Federated Learning with Modified Models" (ICLR 2022), applied to text as the first step of their
follow-up for language models (Fowl et al., "Decepticons: Corrupted Transformers Breach Privacy in
Federated Learning for Language Models", ICLR 2023), without its attention changes.

The server ships :func:`leakbench.models.malicious.imprint_text`: the block x ↦ x + V·ReLU(W x + b) on
every position's input vector h⁰_p = E[v_p] + P[t_p], W's K rows one query q, b = −c at equal-mass
quantiles of ⟨q, h⁰⟩ over public text, V's columns equal.  Each token position p is one "sample" of
the paper's Sec. 3 (g_p its upstream gradient), and for a position alone in bin k (c_k < ⟨q, h⁰_p⟩ ≤ c_{k+1})

    h⁰_p = (∇W_k − ∇W_{k+1}) / (∇b_k − ∇b_{k+1})        (∇W_K = ∇b_K = 0),

exactly (the image attack's identity, :mod:`leakbench.attacks.gradient.robbing_the_fed`).  The table
E[v] + P[t] is public, so the position's token *and* its position are read off the nearest table
entry.  **Certificate**: a bin of two or more positions returns their g-weighted blend, which lies
on no table entry; a bin is taken as lone when its vector is within ``tol`` (relative) of a table
entry, far below the distance between entries.  Positions without a loss gradient (padding, and an
end-of-sequence id whose target is padding) are invisible and come back as padding.

What this recovers is the batch's *bag of (token, position) pairs*.  For B = 1 that is the
sequence, flagged exact when no bin held a blend and the positions found run 0, 1, …, n−1 with one
token each.  For B > 1 the pairs at one position are not tied to their sequences: Decepticons adds
attention and position changes that tag every token with its sentence; those are not implemented,
so rows are filled in bin order and flagged not exact (``trace["pairs"]`` holds what is exact).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, NothingRecovered
from ..models.malicious import ImprintBlock
from ..models.transformers import TextTransformer
from ..threat import Observation
from .base import Attack, Reconstruction, register
from .observed import bin_differences, shared_gradient

__all__ = ["TextImprint", "TextImprintOptions"]


@dataclass
class TextImprintOptions:
    """Options of ``text-imprint``."""

    #: a bin is occupied when |∇b_k − ∇b_{k+1}| > threshold · max_k |…|.
    threshold: float = 1e-7
    #: a bin's vector counts as one table entry E[v] + P[t] when within tol · ‖h⁰‖ of it (float32 round-off of
    #: the bin difference is ~1e-6 of it; distinct entries lie ~1 apart, relative).
    tol: float = 1e-3

    def check(self) -> None:
        for name in ("threshold", "tol"):
            value = getattr(self, name)
            if not (isinstance(value, float) and 0 < value < 1):
                raise ConfigError(f"expected {name} in (0, 1), got {value!r} (option {name})")


@register
class TextImprint(Attack):
    """The server's imprint block on token+position vectors: exact (token, position) pairs, exact text at B = 1."""

    name = "text-imprint"
    modality = "text"
    Options = TextImprintOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        model = obs.model
        if not isinstance(model, TextTransformer) or not isinstance(model.pre, ImprintBlock):
            return ["text-imprint needs the server's imprint block on a text transformer's inputs: ship "
                    "leakbench.models.malicious.imprint_text(model, bins=K) and observe that model"]
        if obs.kind == "weights":
            return ["text-imprint needs a shared gradient or update, not trained weights"]
        block = model.pre
        if shared_gradient(obs, block.linear0.weight) is None or shared_gradient(obs, block.linear0.bias) is None:
            return ["the imprint block's first layer is not among the shared parameters"]
        return []

    def run(self, obs: Observation, *, seed: int = 0, callback=None, progress=None) -> Reconstruction:
        model: TextTransformer = obs.model
        block: ImprintBlock = model.pre
        opts = self.options
        grad_w = shared_gradient(obs, block.linear0.weight).detach().double()
        grad_b = shared_gradient(obs, block.linear0.bias).detach().double()
        diff_w, diff_b = bin_differences(grad_w, grad_b)
        size = diff_b.abs()
        top = float(size.max()) if size.numel() else 0.0
        if top == 0.0:
            raise NothingRecovered("text-imprint found no occupied bin: the imprint block's gradient is zero")
        occupied = (size > opts.threshold * top).nonzero().reshape(-1)
        vectors = diff_w[occupied] / diff_b[occupied, None]                    # n × d
        T = int(obs.input_shape[0])
        with torch.no_grad():
            emb = model.tok.weight.detach().double()
            pos = model.pos.weight.detach().double()[:T]
            best = torch.full((len(occupied),), float("inf"), dtype=torch.float64, device=vectors.device)
            token = torch.zeros(len(occupied), dtype=torch.int64, device=vectors.device)
            place = torch.zeros_like(token)
            for t in range(T):  # nearest E[v] + P[t]: T distance matrices n × V
                d = torch.cdist(vectors - pos[t], emb)
                value, idx = d.min(dim=1)
                better = value < best
                best, token, place = torch.where(better, value, best), torch.where(better, idx, token), \
                    torch.where(better, torch.full_like(place, t), place)
        rel = best / vectors.norm(dim=1).clamp_min(1e-300)
        lone = rel < opts.tol
        pairs = sorted((int(t), int(v)) for t, v, ok in zip(place, token, lone) if ok)
        B = obs.batch_size
        tokens = torch.full((B, T), model.pad_id, dtype=torch.int64)
        fill = [0] * T
        for t, v in pairs:
            if fill[t] < B:
                tokens[fill[t], t] = v
                fill[t] += 1
        blends = int((~lone).sum())
        positions = [t for t, _ in pairs]
        run_ok = positions == list(range(len(positions))) and len(positions) > 0
        exact = [B == 1 and blends == 0 and run_ok] + [False] * (B - 1)
        if progress is not None:
            progress(1, 1, 0.0)
        trace = {"modality": "text", "exact": exact, "bins": block.bins, "bins_occupied": int(len(occupied)),
                 "lone_bins": int(lone.sum()), "blend_bins": blends, "pairs": pairs,
                 "max_lone_distance": float(rel[lone].max()) if bool(lone.any()) else None,
                 "rows": "B = 1: the sequence; B > 1: (token, position) pairs in bin order, not tied to sequences"}
        return Reconstruction(images=tokens.to(obs.device),
                              confidence=torch.tensor(exact, dtype=torch.float32, device=obs.device), trace=trace)
