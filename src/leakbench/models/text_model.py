"""The interface the text side reads from a language model, and the *span view* DAGER reads.

``observe``, the text metrics and the optimisation attacks (TAG, LAMP) need of a text model only:
``takes_tokens``, ``vocab`` (the embedding table's rows), ``context`` (the longest sequence),
``width`` (the embedding width), ``causal`` (next-token logits B × T × V, else one class per
sequence B × K), ``outputs`` (V or K), ``pad_id``, ``tok`` (the token-embedding module) and
``token_table`` (its weight's parameter name, left out of the gradient matching), ``modified``
(whether a server placed a module on the residual stream, :func:`~.malicious.imprint_text`),
:meth:`check_tokens`, :meth:`embed` and :meth:`forward_embeddings`.

DAGER (Petrov et al. 2024, Sec. 4–5) reads, per block, the weight whose gradient spans the block's
attention inputs and what that weight multiplies — the *span view*:

- :meth:`span_weights` (layer i): the parameter names of block i's attention input projection(s)
  (all multiply the same inputs, so their gradients' rows share one span);
- :meth:`layer_inputs` (layer i, ids): what those projections multiply (B × T × width);
- :meth:`vocab_inputs` (position t): block 1's input for every vocabulary token at position t
  (V × width); ``position_free`` when it does not depend on t (rotary positions act after the
  projection);
- :meth:`extension_inputs`: block 2's input at position t for every prefix followed by every
  option (decoders' greedy extension, Sec. 5.2); the default runs :meth:`layer_inputs` on the
  P·O sequences in chunks.

:class:`~.transformers.TextTransformer` (``gpt:``/``bert:``) and
:class:`~.huggingface.HFTextModel` (Hugging Face models) implement it.
"""
from __future__ import annotations

import abc

import torch
from torch import nn

from ..errors import expect

__all__ = ["TextModel"]

#: sequences run at once by the default :meth:`TextModel.extension_inputs` (a bound on memory).
EXTENSION_CHUNK = 4096


class TextModel(nn.Module, metaclass=abc.ABCMeta):
    """Base of leakbench's text models: the attributes and methods above (module docstring); the abstract ones
    are what each model implements."""

    takes_tokens = True
    #: the parameter name of the token-embedding table.
    token_table = "tok.weight"
    #: block 1's inputs do not depend on the position (:meth:`vocab_inputs` is the same for every t).
    position_free = False
    #: None when the span view is implemented, else why DAGER cannot read this model.
    span_unsupported: str | None = None

    vocab: int
    context: int
    width: int
    causal: bool
    pad_id: int

    # ------------------------------------------------------------------ shapes
    def check_tokens(self, tokens: torch.Tensor, field: str = "x") -> None:
        """Refuse ids that are not an int batch B × T with T ≤ context and every id in the vocabulary."""
        expect(isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and not tokens.is_floating_point()
               and tokens.dtype != torch.bool,
               f"expected token ids as an integer tensor B × T, got "
               f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))} (argument {field})")
        expect(tokens.shape[1] <= self.context, f"expected sequences of at most {self.context} tokens (the model's "
               f"context), got {tokens.shape[1]} (argument {field}); cut them or build with a longer context")
        if tokens.numel():
            lo, hi = int(tokens.min()), int(tokens.max())
            expect(lo >= 0 and hi < self.vocab, f"expected token ids in 0..{self.vocab - 1} (the model's vocabulary), "
                   f"got range {lo}..{hi} (argument {field}); the tokenizer does not match the model")

    @property
    def modified(self) -> bool:
        """Whether a server placed a module on the residual stream (only a TextTransformer takes one)."""
        return False

    @property
    @abc.abstractmethod
    def outputs(self) -> int:
        """Logits per position (decoder: the vocabulary) or per sequence (classes)."""

    @property
    @abc.abstractmethod
    def depth(self) -> int:
        """The number of transformer blocks."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """E[v_t]: the token embeddings B × T × width (no position)."""
        return self.tok(tokens)

    @abc.abstractmethod
    def forward_embeddings(self, emb: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The logits for token embeddings ``emb`` (B × T × width); ``keep`` (B × T bool) marks non-padding."""

    # ------------------------------------------------------------------ the span view (DAGER)
    @abc.abstractmethod
    def span_weights(self, layer: int) -> list[str]:
        """Parameter names of block ``layer``'s attention input projection(s)."""

    @abc.abstractmethod
    def layer_inputs(self, layer: int, tokens: torch.Tensor) -> torch.Tensor:
        """What block ``layer``'s attention input projection multiplies for the ids ``tokens`` (B × T × width)."""

    @abc.abstractmethod
    def vocab_inputs(self, position: int) -> torch.Tensor:
        """Block 1's attention input for every vocabulary token at ``position`` (V × width)."""

    def extension_inputs(self, prefixes: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        """Block 2's attention input at position t for every prefix (P × t ids) then every option (O ids): P × O × d.

        The default runs :meth:`layer_inputs` on the P·O sequences (causal attention: position t sees the
        prefix and itself), at most ``EXTENSION_CHUNK`` at a time.
        """
        n_p, t = prefixes.shape
        n_o = options.shape[0]
        seqs = torch.cat([prefixes.repeat_interleave(n_o, 0), options.repeat(n_p)[:, None]], dim=1)
        out = [self.layer_inputs(1, seqs[i:i + EXTENSION_CHUNK])[:, t] for i in range(0, seqs.shape[0], EXTENSION_CHUNK)]
        return torch.cat(out).reshape(n_p, n_o, -1)
