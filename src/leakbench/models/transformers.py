"""Small transformers for text: a causal decoder (GPT-style) and an encoder with a classification head (BERT-style).

Both are pre-LN stacks (Radford et al. 2019, GPT-2, Sec. 2.3; Xiong et al. 2020):
h⁰_t = E[v_t] + P[t] (token and learned position embeddings), then per block
h ← h + W_o·Attn(LN₁(h)) and h ← h + MLP(LN₂(h)), with one fused projection
[Q; K; V] = W_qkv·LN₁(h) + b (GPT-2's ``c_attn``), scaled dot-product attention
softmax(QKᵀ/√d_h) over ``heads`` heads (Vaswani et al. 2017, Eq. 1), a ReLU MLP of 4·width
(the original Transformer's), and a final LN.

- :class:`TextTransformer` with ``causal=True`` (``gpt:``) maps ids B × T to next-token logits
  B × T × V; position t attends to positions ≤ t.
- ``causal=False`` (``bert:``) attends to every non-padding position and maps the mean of the
  final states over non-padding positions to ``classes`` logits B × K.

The attacks read the first blocks' inputs through :meth:`TextTransformer.block_input`; the
fused ``blocks[i].attn.qkv`` is the layer whose weight gradient DAGER takes apart.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError, expect
from .text_model import TextModel

__all__ = ["TextTransformer", "Block", "Attention", "MAX_WIDTH", "MAX_LAYERS"]

MAX_WIDTH = 8192
MAX_LAYERS = 64


class Attention(nn.Module):
    """Multi-head self-attention with a fused [Q; K; V] projection (``qkv``) and an output projection."""

    def __init__(self, width: int, heads: int, *, causal: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.heads, self.causal = heads, causal

    def forward(self, h: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(h).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        if self.causal:
            allowed = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
        if keep is not None:  # padding: no position attends to a padded key
            scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LN transformer block: h + Attn(LN₁ h), then + MLP(LN₂ h).

    ``mid`` (None in an honest model) is a module a malicious server places on the residual stream
    between the two halves, applied to every position's vector (rows of width ``width``):
    h ← h + Attn(LN₁ h); h ← mid(h); h ← h + MLP(LN₂ h)
    (:func:`leakbench.models.malicious.imprint_text` with ``signature=r`` puts its imprint block there in block 1).
    """

    def __init__(self, width: int, heads: int, *, causal: bool, act: nn.Module) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, causal=causal)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), act, nn.Linear(4 * width, width))
        self.mid: nn.Module | None = None

    def attend(self, h: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after the attention half: h + Attn(LN₁ h) (what ``mid`` receives)."""
        return h + self.attn(self.ln1(h), keep)

    def forward(self, h: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attend(h, keep)
        if self.mid is not None:
            h = self.mid(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        return h + self.mlp(self.ln2(h))


class TextTransformer(TextModel):
    """Token + position embeddings, ``layers`` pre-LN blocks, final LN and a linear head (see the module docstring)."""

    default_init = "gpt"

    def __init__(self, vocab: int, context: int, classes: int, *, layers: int = 2, width: int = 64, heads: int = 4,
                 causal: bool = True, pad_id: int = 0, act: type[nn.Module] | None = None) -> None:
        super().__init__()
        for name, value, low, high in (("vocab", vocab, 2, 1 << 20), ("context", context, 1, 1 << 16),
                                       ("layers", layers, 1, MAX_LAYERS), ("width", width, 1, MAX_WIDTH),
                                       ("heads", heads, 1, MAX_WIDTH)):
            expect(isinstance(value, int) and low <= value <= high,
                   f"expected {name} in {low}..{high}, got {value!r} (field {name})")
        if width % heads:
            raise ConfigError(f"expected width divisible by heads, got width={width}, heads={heads} (field heads)")
        expect(0 <= pad_id < vocab, f"expected pad_id in 0..{vocab - 1}, got {pad_id} (field pad_id)")
        make_act = act or nn.ReLU
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, causal=causal, act=make_act()) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)
        self.vocab, self.context, self.width, self.heads = vocab, context, width, heads
        self.causal, self.pad_id = causal, pad_id
        #: a module a malicious server places on h⁰ = E[v] + P[t] (:func:`leakbench.models.malicious.imprint_text`),
        #: applied to every position's vector (rows of width ``width``); None: the honest model.
        self.pre: nn.Module | None = None

    # ------------------------------------------------------------------ forward
    @property
    def outputs(self) -> int:
        return self.head.out_features

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def forward_embeddings(self, emb: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The logits for token embeddings ``emb`` (B × T × width); ``keep`` (B × T bool) marks non-padding."""
        h = self._pre(emb + self.pos.weight[: emb.shape[1]])
        for block in self.blocks:
            h = block(h, None if self.causal else keep)
        h = self.ln_f(h)
        if self.causal:
            return self.head(h)
        if keep is None:
            return self.head(h.mean(1))
        w = keep.to(h.dtype).unsqueeze(-1)
        return self.head((h * w).sum(1) / w.sum(1).clamp_min(1))

    def _pre(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.pre is None else self.pre(h.reshape(-1, h.shape[-1])).reshape(h.shape)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward_embeddings(self.tok(tokens), tokens != self.pad_id)

    @property
    def modified(self) -> bool:
        """Whether a server placed a module on the residual stream (``pre``, or a block's ``mid``)."""
        return self.pre is not None or any(getattr(b, "mid", None) is not None for b in self.blocks)

    # ------------------------------------------------------------------ for the attacks (the span view, .text_model)
    def attended(self, tokens: torch.Tensor) -> torch.Tensor:
        """Block 1's residual stream after its attention half, h⁰ + Attn(LN₁ h⁰) (B × T × width): block 1's ``mid`` input."""
        keep = tokens != self.pad_id
        h = self._pre(self.tok(tokens) + self.pos.weight[: tokens.shape[1]])
        return self.blocks[0].attend(h, None if self.causal else keep)

    def block_input(self, layer: int, tokens: torch.Tensor) -> torch.Tensor:
        """LN₁ of block ``layer``'s input (B × T × width): what its ``attn.qkv`` multiplies."""
        keep = tokens != self.pad_id
        h = self._pre(self.tok(tokens) + self.pos.weight[: tokens.shape[1]])
        for block in self.blocks[:layer]:
            h = block(h, None if self.causal else keep)
        return self.blocks[layer].ln1(h)

    def layer_inputs(self, layer: int, tokens: torch.Tensor) -> torch.Tensor:
        return self.block_input(layer, tokens)

    def span_weights(self, layer: int) -> list[str]:
        """The fused [Q; K; V] projection of block ``layer``."""
        return [f"blocks.{layer}.attn.qkv.weight"]

    def vocab_inputs(self, position: int) -> torch.Tensor:
        """LN₁(E[v] + P[t]) for every token v at position t (V × width)."""
        return self.blocks[0].ln1(self.tok.weight + self.pos.weight[position])

    def extension_inputs(self, prefixes: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        """Block 2's LN₁ input at position t for every prefix (P × t ids) followed by every option (O ids): P × O × d.

        Equals ``self.block_input(1, prefix + [v])[:, t]`` (tested) but computes block 1's keys and values
        of a prefix once: causal attention makes them independent of what follows.
        """
        block, attn = self.blocks[0], self.blocks[0].attn
        n_p, t = prefixes.shape
        d, heads = self.width, attn.heads
        dh = d // heads
        h_new = self.tok(options) + self.pos.weight[t]  # O × d
        q, k, v = attn.qkv(block.ln1(h_new)).split(d, dim=-1)  # O × d each
        q, k, v = (z.reshape(-1, heads, dh) for z in (q, k, v))
        own = (q * k).sum(-1) / dh**0.5  # O × H
        if t:
            h_prev = self.tok(prefixes) + self.pos.weight[:t]  # P × t × d
            _, kp, vp = attn.qkv(block.ln1(h_prev)).split(d, dim=-1)
            kp, vp = (z.reshape(n_p, t, heads, dh) for z in (kp, vp))
            past = torch.einsum("ohd,pshd->pohs", q, kp) / dh**0.5  # P × O × H × t
            scores = torch.cat([past, own.expand(n_p, -1, -1).unsqueeze(-1)], dim=-1)
            w = torch.softmax(scores, dim=-1)
            out = torch.einsum("pohs,pshd->pohd", w[..., :t], vp) + w[..., t:] * v.unsqueeze(0)
        else:
            out = v.unsqueeze(0).expand(n_p, -1, -1, -1)
        h = h_new + attn.proj(out.reshape(n_p, -1, d))  # P × O × d
        h = h + block.mlp(block.ln2(h))
        return self.blocks[1].ln1(h)
