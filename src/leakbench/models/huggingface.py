"""Hugging Face GPT-2 models handed over as leakbench text transformers (the optional ``transformers`` extra).

A client that fine-tunes a GPT-2-family model (``transformers.GPT2LMHeadModel``, built from a
``GPT2Config`` — nothing is downloaded) gives it to :func:`leakbench.build`, which returns the same
function as a :class:`~leakbench.models.transformers.TextTransformer`, so ``observe`` and the text attacks
(DAGER reads ``blocks[i].attn.qkv``) take it as they take ``gpt:`` specs.

GPT-2 (Radford et al. 2019) is the pre-LN decoder :mod:`.transformers` implements: token and learned
position embeddings, per block h + c_proj(Attn(c_attn(ln_1 h))) and h + MLP(ln_2 h), a final ``ln_f``
and the head tied to the token embedding.  The weights are copied, not shared: ``Conv1D`` stores
W as in × out, ``nn.Linear`` as out × in (transposed here); the MLP's activation is GPT-2's
``gelu_new`` (tanh-approximated GELU); the head gets the token embedding's values and a zero bias
(untied: its gradient is the head's alone, as for ``gpt:`` models).  Dropout is not copied (the
attacked round is one deterministic gradient).  :func:`from_gpt2` checks the copy by comparing logits.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .transformers import TextTransformer

__all__ = ["is_gpt2", "from_gpt2"]

#: GPT-2's activations (``config.activation_function``) and the torch module of each
ACTIVATIONS = {"gelu_new": lambda: nn.GELU(approximate="tanh"), "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
               "gelu": nn.GELU, "relu": nn.ReLU}


def is_gpt2(model: Any) -> bool:
    """True for a ``transformers`` GPT-2 language model (``GPT2LMHeadModel``), checked without importing it."""
    return type(model).__name__ == "GPT2LMHeadModel" and type(model).__module__.startswith("transformers.")


def from_gpt2(model: nn.Module, *, pad_id: int = 0, check: bool = True) -> TextTransformer:
    """The :class:`TextTransformer` computing what the GPT-2 ``model`` computes (module docstring).

    ``pad_id``: the token the batches pad with (GPT-2 has none; leakbench's tokenizer uses 0).  With
    ``check``, the logits of both models on a seeded batch must agree to 1e-4 (relative to their scale).
    """
    if not is_gpt2(model):
        raise ConfigError(f"expected a transformers GPT2LMHeadModel, got {type(model).__name__} (argument model)")
    cfg = model.config
    act = ACTIVATIONS.get(getattr(cfg, "activation_function", "gelu_new"))
    if act is None:
        raise ConfigError(f"GPT-2 activation {cfg.activation_function!r} is not one of {sorted(ACTIVATIONS)} "
                          "(config.activation_function)")
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False) \
            or not getattr(cfg, "scale_attn_weights", True) or getattr(cfg, "add_cross_attention", False):
        raise ConfigError("expected GPT-2's standard attention (scale_attn_weights, no inverse-layer scaling, no "
                          "cross-attention) (config)")
    if abs(float(cfg.layer_norm_epsilon) - 1e-5) > 1e-12:
        raise ConfigError(f"expected layer_norm_epsilon 1e-5, got {cfg.layer_norm_epsilon} (config)")
    t = model.transformer
    ours = TextTransformer(int(cfg.vocab_size), int(cfg.n_positions), int(cfg.vocab_size), layers=int(cfg.n_layer),
                           width=int(cfg.n_embd), heads=int(cfg.n_head), causal=True, pad_id=int(pad_id), act=act)
    ours.to(device=t.wte.weight.device, dtype=t.wte.weight.dtype)
    with torch.no_grad():
        ours.tok.weight.copy_(t.wte.weight)
        ours.pos.weight.copy_(t.wpe.weight)
        for mine, theirs in zip(ours.blocks, t.h):
            for a, b in ((mine.ln1, theirs.ln_1), (mine.ln2, theirs.ln_2)):
                a.weight.copy_(b.weight)
                a.bias.copy_(b.bias)
            for lin, conv in ((mine.attn.qkv, theirs.attn.c_attn), (mine.attn.proj, theirs.attn.c_proj),
                              (mine.mlp[0], theirs.mlp.c_fc), (mine.mlp[2], theirs.mlp.c_proj)):
                lin.weight.copy_(conv.weight.t())  # Conv1D: in × out
                lin.bias.copy_(conv.bias)
        ours.ln_f.weight.copy_(t.ln_f.weight)
        ours.ln_f.bias.copy_(t.ln_f.bias)
        ours.head.weight.copy_(model.lm_head.weight)
        if getattr(model.lm_head, "bias", None) is not None:
            ours.head.bias.copy_(model.lm_head.bias)
        else:
            ours.head.bias.zero_()
    if check:
        _check_same(model, ours)
    return ours


def _check_same(model: nn.Module, ours: TextTransformer) -> None:
    gen = torch.Generator().manual_seed(0)
    T = min(8, ours.context)
    ids = torch.randint(0, ours.vocab, (2, T), generator=gen).to(ours.tok.weight.device)
    was = model.training
    model.eval()
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
        mine = ours(ids)
    model.train(was)
    scale = float(theirs.abs().max().clamp_min(1e-6))
    gap = float((theirs - mine).abs().max())
    if gap > 1e-4 * scale:
        raise ConfigError(f"the GPT-2 model could not be copied faithfully (logits differ by {gap:.3g}); a GPT-2 "
                          "variant leakbench does not model (argument model)")
