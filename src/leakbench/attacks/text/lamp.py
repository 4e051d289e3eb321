"""LAMP: gradient matching on embeddings alternated with discrete token moves ranked by a language-model prior.

Balunović, Dimitrov, Jovanović & Vechev, "LAMP: Extracting Text from Gradients with Language Model
Priors" (NeurIPS 2022, arXiv:2202.08827).  Continuous steps (Sec. 4.1) optimise input embeddings
x (B × T × width) against

    L_rec(x) = Σ_W ‖∇W(x) − ∇W‖₂² + α Σ_W ‖∇W(x) − ∇W‖₁     (LAMP_{L1+L2}; TAG's distance)
             + α_reg · (mean_t ‖x_t‖ − mean_v ‖E_v‖)²        (the embedding-length regulariser),

and every ``every`` steps a discrete step (Sec. 4.2) proposes ``candidates`` transformations of
each sequence — a swap of two tokens, a token moved, a prefix moved to the end — applied to the
continuous embeddings as position permutations, and keeps, per sequence, the one with the lowest

    L_rec(x') / L_rec(x) + α_lm · L_lm(tokens(x'))   (L_lm: the prior's mean next-token negative log-likelihood);

the reconstruction loss enters relative to the current one, so that α_lm weighs the prior against a
fractional change of the gradient distance whatever its scale (the paper's cosine distance is ~1;
the L2 distance here is not).

The prior is part of the threat model: a small ``gpt:layers=2,width=64`` decoder trained for
``prior_steps`` Adam steps on the bundled corpus's training split (public text; the paper uses
GPT-2), so LAMP applies to models whose tokenizer is the bundled one (same vocabulary size; the
requirement says so otherwise).  It is trained once per process and setting.  Labels: known ones,
or soft labels optimised as in TAG; projection to tokens: nearest embedding (L2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...data import load
from ...errors import ConfigError
from ...models.spec import build
from ...models.text_model import TextModel
from ...models.transformers import TextTransformer
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from .tag import _known_loss, _soft_loss

__all__ = ["Lamp", "LampOptions", "language_prior"]

_PRIORS: dict[tuple, TextTransformer] = {}


def language_prior(vocab: int, context: int, steps: int, seed: int = 0) -> TextTransformer:
    """The public prior: ``gpt:layers=2,width=64`` trained ``steps`` Adam steps on the bundled training split."""
    key = (vocab, context, steps, seed)
    if key not in _PRIORS:
        data = load("text", split="train", context=context, vocab=vocab)
        model = build("gpt:layers=2,width=64,heads=4", input_shape=data.shape, classes=data.vocab_size, seed=seed)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        with torch.enable_grad():
            for step in range(steps):
                x, y = data.batch(32, seed=seed * 100_003 + step)
                loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, data.vocab_size), y.reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
        _PRIORS[key] = model.eval().requires_grad_(False)
    return _PRIORS[key]


@dataclass
class LampOptions:
    """Options of ``lamp``."""

    #: continuous Adam steps in all.
    iterations: int = 500
    #: Adam's step size.
    lr: float = 0.01
    #: weight of the L1 term of the gradient distance.
    alpha: float = 0.01
    #: weight of the embedding-length regulariser.
    alpha_reg: float = 1.0
    #: weight of the prior's negative log-likelihood in the discrete step.
    alpha_lm: float = 0.2
    #: continuous steps between discrete steps.
    every: int = 50
    #: transformations tried per sequence in a discrete step.
    candidates: int = 30
    #: Adam steps that train the prior (public text).
    prior_steps: int = 300

    def check(self) -> None:
        for name in ("iterations", "every", "candidates", "prior_steps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and 1 <= value <= 1_000_000):
                raise ConfigError(f"expected {name} in 1..1000000, got {value!r} (option {name})")
        for name in ("lr", "alpha", "alpha_reg", "alpha_lm"):
            value = getattr(self, name)
            if not (isinstance(value, float) and value >= 0 and (name != "lr" or value > 0)):
                raise ConfigError(f"expected a non-negative {name} (lr positive), got {value!r} (option {name})")


@register
class Lamp(Attack):
    """LAMP (Balunović et al. 2022): TAG's continuous steps alternated with token moves ranked by an LM prior."""

    name = "lamp"
    tags = ("gradient", "labels")
    modality = "text"
    Options = LampOptions
    presets = {"quick": {"iterations": 200, "lr": 0.02, "every": 40, "candidates": 20, "prior_steps": 150}}
    matching = True

    def requirements(self, obs: Observation) -> list[str]:
        if not isinstance(obs.model, TextModel):
            return ["LAMP feeds embeddings to leakbench's text transformers (gpt:/bert: specs, Hugging Face models); "
                    f"got a {type(obs.model).__name__}"]
        reasons = []
        if obs.kind != "gradient" and obs.local_steps != 1:
            reasons.append(f"LAMP matches the gradient of one step, got an update after {obs.local_steps} steps")
        if not 300 <= obs.model.vocab <= 65_536:
            reasons.append(f"LAMP's prior is trained with the bundled tokenizer; a vocabulary of {obs.model.vocab} "
                           "tokens is not one of its sizes (300..65536)")
        return reasons

    def run(self, obs: Observation, *, seed: int = 0, callback=None, progress=None) -> Reconstruction:
        model: TextModel = obs.model
        opts = self.options
        B, T, device = obs.batch_size, int(obs.input_shape[0]), obs.device
        prior = language_prior(model.vocab, T, opts.prior_steps).to(device)
        lengths = (obs.extras.get("text") or {}).get("lengths") or [T] * B
        length = torch.tensor(lengths, device=device)
        pos = torch.arange(T, device=device)
        keep = pos[None] < length[:, None]
        has_loss = keep & ((pos[None] < length[:, None] - 1) | (length[:, None] == T))
        names = [n for n in obs.param_names if n != model.token_table]
        named = dict(model.named_parameters())
        params = [named[n] for n in names]
        target = [g for n, g in zip(obs.param_names, obs.gradients) if n != model.token_table]
        table = model.tok.weight.detach()
        mean_norm = float(table.norm(dim=-1).mean())

        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        emb = (torch.randn(B, T, model.width, generator=gen) * float(table.std())).to(device).requires_grad_(True)
        variables = [emb]
        label_logits = None
        if obs.labels is None:
            shape = (B, T, model.outputs) if model.causal else (B, model.outputs)
            label_logits = torch.randn(*shape, generator=gen).to(device).requires_grad_(True)
            variables.append(label_logits)

        def rec_loss(x: torch.Tensor, create_graph: bool) -> torch.Tensor:
            logits = model.forward_embeddings(x, keep)
            if obs.labels is not None:
                task = _known_loss(logits, obs.labels, model.causal)
            else:
                task = _soft_loss(logits, torch.softmax(label_logits, -1), has_loss, model.causal)
            grads = torch.autograd.grad(task, params, create_graph=create_graph)
            dist = sum(((g - t) ** 2).sum() + opts.alpha * (g - t).abs().sum() for g, t in zip(grads, target))
            norms = x.norm(dim=-1)[keep].mean()
            return dist + opts.alpha_reg * (norms - mean_norm) ** 2

        opt = torch.optim.Adam(variables, lr=opts.lr)
        losses, moves = [], 0
        for step in range(opts.iterations):
            opt.zero_grad()
            loss = rec_loss(emb, True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if (step + 1) % opts.every == 0 and step + 1 < opts.iterations:
                moves += _discrete_step(emb, rec_loss, prior, table, lengths, opts, gen)
            if progress is not None:
                progress(step + 1, opts.iterations, losses[-1])
        with torch.no_grad():
            tokens = _project(emb.detach(), table)
            tokens[~keep] = model.pad_id
        return Reconstruction(images=tokens, trace={"modality": "text", "loss": losses, "moves": moves})


def _project(emb: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return torch.cdist(emb, table.unsqueeze(0).expand(emb.shape[0], -1, -1)).argmin(-1)


def _lm_nll(prior: TextTransformer, tokens: torch.Tensor, n: int) -> torch.Tensor:
    """The prior's mean next-token NLL of each row of ``tokens`` over its first ``n`` tokens (R,)."""
    logp = torch.log_softmax(prior(tokens[:, :n]), -1)[:, :-1]
    return -logp.gather(-1, tokens[:, 1:n, None]).squeeze(-1).mean(-1) if n > 1 else tokens.new_zeros(
        tokens.shape[0], dtype=logp.dtype)


def _permutations(n: int, count: int, gen: torch.Generator) -> list[list[int]]:
    """``count`` random LAMP transformations of positions 0..n−1: swap two, move one, rotate a prefix to the end."""
    out = []
    for _ in range(count):
        order = list(range(n))
        kind = int(torch.randint(3, (1,), generator=gen))
        i, j = (int(v) for v in torch.randint(n, (2,), generator=gen))
        if kind == 0:
            order[i], order[j] = order[j], order[i]
        elif kind == 1:
            order.insert(j, order.pop(i))
        else:
            k = max(i, 1)
            order = order[k:] + order[:k]
        out.append(order)
    return out


@torch.no_grad()
def _discrete_step(emb, rec_loss, prior, table, lengths, opts, gen) -> int:
    """Per sequence, the transformation of lowest L_rec + α_lm·L_lm (the current order included); returns moves."""
    moves = 0
    for b, n in enumerate(lengths):
        n = int(n)
        if n < 2:
            continue
        orders = [list(range(n))] + _permutations(n, opts.candidates, gen)
        tokens = _project(emb.detach()[b:b + 1], table)[0]
        cand_tokens = torch.stack([torch.cat([tokens[o], tokens[n:]]) for o in orders])
        lm = _lm_nll(prior, cand_tokens, n)
        recs = []
        for order in orders:
            trial = emb.detach().clone()
            trial[b, :n] = trial[b, order]
            with torch.enable_grad():
                recs.append(float(rec_loss(trial, False)))
        scores = [r / max(recs[0], 1e-30) + opts.alpha_lm * float(l) for r, l in zip(recs, lm)]
        best = min(range(len(orders)), key=scores.__getitem__)
        if best:
            emb[b, :n] = emb[b, orders[best]]
            moves += 1
    return moves
