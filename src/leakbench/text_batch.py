"""Token batches for :func:`~leakbench.threat.observe` and the captured observations: checks and grants.

A text client trains on ids ``x`` (B × T, int64) with targets ``y``: the next token of every
position (B × T; −100 where there is none, as padding) for a decoder, or one class per sequence
(B,) for an encoder.  What the server is granted besides the gradient (``extras["text"]``): the
tokenizer and vocabulary (the model's embedding table is public), the padded sequence length T,
the padding id, and each sequence's length (the attention mask a client sends with its batch
size); the labels only when ``labels_known``.
"""
from __future__ import annotations

import torch
from torch import nn

from .errors import expect

__all__ = ["takes_tokens", "check_token_batch", "check_token_labels", "text_grants", "IGNORE"]

IGNORE = -100


def takes_tokens(model: nn.Module) -> bool:
    """True for a model that reads token ids: one with ``takes_tokens = True`` or an ``nn.Embedding`` first."""
    if getattr(model, "takes_tokens", False):
        return True
    first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
    return isinstance(first, nn.Embedding)


def _vocab(model: nn.Module) -> int | None:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return getattr(model, "vocab", None) or (emb.num_embeddings if emb is not None else None)


def check_token_batch(model: nn.Module, x: torch.Tensor) -> None:
    """Refuse token ids that are not B × T integers, an empty batch, T past the context, ids past the vocabulary."""
    expect(x.dim() == 2, f"expected token ids B × T, got shape {tuple(x.shape)} (argument x)")
    expect(x.shape[0] > 0 and x.shape[1] > 0, f"expected a non-empty batch of sequences, got shape {tuple(x.shape)} "
           "(argument x); give at least one token")
    check = getattr(model, "check_tokens", None)
    if callable(check):
        check(x)
        return
    vocab = _vocab(model)
    lo, hi = int(x.min()), int(x.max())
    expect(lo >= 0 and (vocab is None or hi < vocab), f"expected token ids in 0..{(vocab or 0) - 1} (the model's "
           f"vocabulary), got range {lo}..{hi} (argument x); the tokenizer does not match the model")


def check_token_labels(y: torch.Tensor, x: torch.Tensor, outputs: int) -> None:
    """Next-token targets B × T (ids or −100) or one class per sequence (B,), all below ``outputs``."""
    expect(not y.is_floating_point() and y.dtype != torch.bool,
           f"expected integer targets, got dtype {y.dtype} (argument y); pass y.long()")
    expect(y.shape == x.shape or y.shape == x.shape[:1],
           f"expected next-token targets of shape {tuple(x.shape)} or one class per sequence ({x.shape[0]},), "
           f"got {tuple(y.shape)} (argument y)")
    real = y[y != IGNORE]
    expect(real.numel() > 0, "expected at least one target that is not −100 (argument y): nothing is trained on")
    lo, hi = int(real.min()), int(real.max())
    expect(lo >= 0 and hi < outputs, f"expected targets in 0..{outputs - 1} (the model's outputs) or −100, got "
           f"range {lo}..{hi} (argument y)")


def text_grants(model: nn.Module, seq_len: int, x: torch.Tensor | None = None) -> dict:
    """``extras["text"]``: what the threat model grants the server about a token batch (module docstring).

    Each sequence's length comes from the batch ``x`` when the client's batch is at hand (``observe``);
    a captured gradient grants none (``lengths`` None)."""
    pad = int(getattr(model, "pad_id", 0))
    return {
        "vocab_size": _vocab(model),
        "seq_len": int(seq_len),
        "pad_id": pad,
        "lengths": None if x is None else (x != pad).sum(1).tolist(),
        "grants": "tokenizer and vocabulary known; padded length T known"
                  + ("; each sequence's length known" if x is not None else ""),
    }
