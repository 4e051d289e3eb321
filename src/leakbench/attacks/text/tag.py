"""TAG: gradient matching on transformer inputs (Deng et al., Findings of EMNLP 2021).

Deng, Wang, Wang, Liu, Ding, Jiang & Xu, "TAG: Gradient Attack on Transformer-based Language
Models" (arXiv:2103.06819).  Like DLG (Zhu et al. 2019) for images, TAG optimises dummy inputs —
for text, continuous input embeddings x' (B × T × width) — and, when the labels are unknown,
dummy soft labels y' so that the gradient they produce matches the shared one; its distance
(Sec. 3, the objective) adds an L1 term to DLG's L2:

    L(x', y') = Σ_W ‖∇W(x', y') − ∇W‖₂² + α Σ_W ‖∇W(x', y') − ∇W‖₁,

summed over the model's weights W (α = ``alpha``, 0.01 by default).  The token-embedding table is left
out of the sum: the dummy embeddings enter after it, so it gets no dummy gradient.  After Adam steps
each position is projected to the vocabulary token whose embedding is nearest (L2), and the
recovered ids are returned.  Dummy labels: next-token soft targets (B × T × V) for a decoder, one soft
class per sequence for an encoder; ``softmax`` of free logits, as DLG.

Grants used: the vocabulary (the model's embedding table), the padded length T and each sequence's
length (``extras["text"]["lengths"]``: the positions that carry a loss — all but the end-of-sequence
id of a padded sentence — and, for encoders, the attention mask); the labels when granted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ...models.text_model import TextModel
from ...threat import Observation
from ..base import Attack, Reconstruction, register

__all__ = ["Tag", "TagOptions"]


@dataclass
class TagOptions:
    """Options of ``tag``."""

    #: Adam steps on the dummy embeddings (and labels).
    iterations: int = 500
    #: Adam's step size.
    lr: float = 0.01
    #: weight α of the L1 term (Deng et al.'s L2 + α·L1 distance).
    alpha: float = 0.01

    def check(self) -> None:
        if not (isinstance(self.iterations, int) and 1 <= self.iterations <= 1_000_000):
            raise ConfigError(f"expected iterations in 1..1000000, got {self.iterations!r} (option iterations)")
        for name in ("lr", "alpha"):
            value = getattr(self, name)
            if not (isinstance(value, float) and value >= 0 and (name == "alpha" or value > 0)):
                raise ConfigError(f"expected a {'non-negative' if name == 'alpha' else 'positive'} {name}, "
                                  f"got {value!r} (option {name})")


@register
class Tag(Attack):
    """TAG (Deng et al. 2021): match the gradient with dummy input embeddings (L2 + α·L1), project to tokens."""

    name = "tag"
    tags = ("gradient", "labels")
    modality = "text"
    Options = TagOptions
    presets = {"quick": {"iterations": 200, "lr": 0.02}}
    matching = True

    def requirements(self, obs: Observation) -> list[str]:
        if not isinstance(obs.model, TextModel):
            return ["TAG feeds embeddings to leakbench's text transformers (gpt:/bert: specs, Hugging Face models); "
                    f"got a {type(obs.model).__name__}"]
        if obs.kind != "gradient" and obs.local_steps != 1:
            return [f"TAG matches the gradient of one step, got an update after {obs.local_steps} steps"]
        return []

    def run(self, obs: Observation, *, seed: int = 0, callback=None, progress=None) -> Reconstruction:
        model: TextModel = obs.model
        opts = self.options
        B, T, device = obs.batch_size, int(obs.input_shape[0]), obs.device
        lengths = (obs.extras.get("text") or {}).get("lengths") or [T] * B
        length = torch.tensor(lengths, device=device)
        pos = torch.arange(T, device=device)
        keep = pos[None] < length[:, None]  # non-padding positions
        has_loss = keep & ((pos[None] < length[:, None] - 1) | (length[:, None] == T))
        names = [n for n in obs.param_names if n != model.token_table]
        named = dict(model.named_parameters())
        params = [named[n] for n in names]
        target = [g for n, g in zip(obs.param_names, obs.gradients) if n != model.token_table]

        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        table = model.tok.weight.detach()
        emb = (torch.randn(B, T, model.width, generator=gen) * float(table.std())).to(device).requires_grad_(True)
        variables = [emb]
        labels = obs.labels
        if labels is None:
            shape = (B, T, model.outputs) if model.causal else (B, model.outputs)
            label_logits = torch.randn(*shape, generator=gen).to(device).requires_grad_(True)
            variables.append(label_logits)
        opt = torch.optim.Adam(variables, lr=opts.lr)
        losses = []
        for step in range(opts.iterations):
            opt.zero_grad()
            logits = model.forward_embeddings(emb, keep)
            if labels is not None:
                task = _known_loss(logits, labels, model.causal)
            else:
                task = _soft_loss(logits, torch.softmax(label_logits, -1), has_loss, model.causal)
            grads = torch.autograd.grad(task, params, create_graph=True)
            dist = sum(((g - t) ** 2).sum() + opts.alpha * (g - t).abs().sum() for g, t in zip(grads, target))
            dist.backward()
            opt.step()
            losses.append(float(dist.detach()))
            if progress is not None:
                progress(step + 1, opts.iterations, losses[-1])
        with torch.no_grad():
            tokens = torch.cdist(emb.detach(), table.unsqueeze(0).expand(B, -1, -1)).argmin(-1)
            tokens[~keep] = model.pad_id
        return Reconstruction(images=tokens, trace={"modality": "text", "loss": losses})


def _known_loss(logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> torch.Tensor:
    if causal:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)
    return torch.nn.functional.cross_entropy(logits, labels)


def _soft_loss(logits: torch.Tensor, soft: torch.Tensor, has_loss: torch.Tensor, causal: bool) -> torch.Tensor:
    """Cross-entropy against soft targets, the mean over the positions that carry a loss (decoder) or sequences."""
    logp = torch.log_softmax(logits, -1)
    if not causal:
        return -(soft * logp).sum(-1).mean()
    per = -(soft * logp).sum(-1)
    return (per * has_loss).sum() / has_loss.sum().clamp_min(1)
