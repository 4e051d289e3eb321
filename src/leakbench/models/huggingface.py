"""Hugging Face language models handed over as leakbench text models (the optional ``transformers`` extra).

**Any causal LM or encoder classifier: :class:`HFTextModel`.**  A ``*ForCausalLM`` (next-token logits) or
an encoder's ``*ForSequenceClassification`` (BERT-style: one class per sequence), built from a config,
is wrapped — its modules are the wrapper's, under the same parameter names — and gives leakbench's text
interface (:mod:`.text_model`) through ``inputs_embeds=`` / ``attention_mask=`` /
``get_input_embeddings()``: ``observe``, the gradient defenses, TAG and LAMP take it.  DAGER's span view
(Petrov et al. 2024, Sec. 4–5) reads block i's attention input projections, found by name:

- BERT layout, ``….layer.{i}.attention.self.{query,key,value}`` (BERT, Devlin et al. 2019: post-LN,
  token-type embeddings, an embedding LayerNorm): block 1 multiplies LN_emb(E[v] + P[t] + T[0]),
  block i > 1 the post-LN output of block i − 1;
- Llama layout, ``….layers.{i}.self_attn.{q,k,v}_proj`` (Llama, Touvron et al. 2023: RMSNorm, rotary
  positions, SwiGLU): block i multiplies RMSNorm(h); the rotary positions act after the projection, so
  block 1's input RMSNorm(E[v]) does not depend on the position (``position_free``, probed on two
  positions at construction: DAGER's layer-1 candidates are one set, placed by the greedy extension
  through block 2, as the paper does for LLaMa-2).

What a projection multiplies is read, not re-implemented: a forward pre-hook on block i's query
projection takes its input and stops the forward there (block 1's inputs of every token at position t:
V sequences with the token at t; block 2's inputs of prefix + option sequences: the prefixes and options
run together, in chunks).  The concatenated q, k, v gradients (all multiply the same inputs) give the span.

**GPT-2: the exact conversion.**  A client that fine-tunes a GPT-2-family model (``transformers.GPT2LMHeadModel``, built from a
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

import contextlib
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .text_model import EXTENSION_CHUNK, TextModel
from .transformers import TextTransformer

__all__ = ["is_gpt2", "from_gpt2", "is_hf_model", "HFTextModel"]

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


# --------------------------------------------------------------------------- any causal LM / encoder classifier

#: block i's attention input projections by layout: a regex on module names (group i the block) and the layout.
SPAN_LAYOUTS = (
    ("bert", r"^(?:.+\.)?layer\.(\d+)\.attention\.self\.(query|key|value)$"),
    ("llama", r"^(?:.+\.)?layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj)$"),
)
SUPPORTED = ("*ForCausalLM (any family), an encoder's *ForSequenceClassification (BERT layout), GPT2LMHeadModel "
             "(converted)")


def is_hf_model(model: Any) -> bool:
    """True for a module defined by ``transformers`` (checked without importing it)."""
    return type(model).__module__.startswith("transformers.")


def _math_attention():
    """PyTorch's math attention kernel (differentiable twice), where torch has the switch (2.3 and later)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch 2.2: the default kernels
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


class _Stop(Exception):
    """Raised by the capture hook: the rest of the forward is not needed."""


class HFTextModel(TextModel):
    """A Hugging Face causal LM or encoder classifier with leakbench's text interface (module docstring).

    ``model``: the ``transformers`` model (its modules become this wrapper's; the wrapper and the model
    share parameters).  ``pad_id``: the token the batches pad with (leakbench's tokenizer: 0).
    """

    def __init__(self, model: nn.Module, *, pad_id: int = 0) -> None:
        super().__init__()
        name = type(model).__name__
        if not is_hf_model(model):
            raise ConfigError(f"expected a transformers model ({SUPPORTED}), got {name} (argument model)")
        causal = name.endswith("ForCausalLM") or name == "GPT2LMHeadModel"
        if not causal and not name.endswith("ForSequenceClassification"):
            raise ConfigError(f"{name} is not a model leakbench's text side serves; supported: {SUPPORTED} "
                              "(argument model)")
        cfg = model.config
        if getattr(cfg, "is_encoder_decoder", False):
            raise ConfigError(f"{name} is an encoder-decoder; supported: {SUPPORTED} (argument model)")
        emb = model.get_input_embeddings()
        if not isinstance(emb, nn.Embedding):
            raise ConfigError(f"{name}'s input embeddings are a {type(emb).__name__}, not an nn.Embedding (argument model)")
        layout, spans = _span_layout(model)
        if not causal and layout != "bert":
            raise ConfigError(f"{name}: sequence classifiers are served for encoders with the BERT layout "
                              "(layer.i.attention.self.query); a decoder's classifier pools the last non-padding token "
                              f"it finds in the ids, which embeddings do not carry; supported: {SUPPORTED} (argument model)")
        hidden = int(getattr(cfg, "hidden_size", emb.embedding_dim))
        if emb.embedding_dim != hidden:
            raise ConfigError(f"{name} embeds in {emb.embedding_dim} dimensions but its blocks are {hidden} wide "
                              "(a factorised embedding); not supported (argument model)")
        context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if not isinstance(context, int) or context < 1:
            raise ConfigError(f"{name}'s config states no max_position_embeddings (config)")
        vocab = emb.num_embeddings
        if not (isinstance(pad_id, int) and 0 <= pad_id < vocab):
            raise ConfigError(f"expected pad_id in 0..{vocab - 1}, got {pad_id!r} (argument pad_id)")
        if model._parameters or model._buffers:
            raise ConfigError(f"{name} holds parameters outside its submodules; not supported (argument model)")
        for child, module in model.named_children():
            self.add_module(child, module)
        object.__setattr__(self, "hf", model)  # not a submodule: its modules are this wrapper's
        self.vocab, self.context, self.width, self.causal, self.pad_id = vocab, int(context), hidden, causal, pad_id
        self.layout = layout
        self._spans = spans
        self._outputs = vocab if causal else int(cfg.num_labels)
        self.token_table = next(n for n, p in self.named_parameters() if p is emb.weight)
        self.position_free = False
        self._packs: bool | None = None  # extension_inputs packs the options behind each prefix (None: not checked)
        self.span_unsupported = None if spans else (
            f"DAGER reads block i's attention input projection by name; {name} has neither the BERT layout "
            "(layer.i.attention.self.query) nor the Llama layout (layers.i.self_attn.q_proj)")
        self.train(model.training)
        if spans:
            self.position_free = self._probe_position_free()

    def _probe_position_free(self) -> bool:
        """Whether block 1's input of a token is the same at positions 0 and 1 (rotary positions: they act after
        the projection; learned or sinusoidal positions are added before it)."""
        was = self.training
        self.eval()
        try:
            with torch.no_grad():
                ids = torch.tensor([[1, 1], [2, 2]], device=self.tok.weight.device)
                z = self.layer_inputs(0, (ids + self.pad_id) % self.vocab)
        finally:
            self.train(was)
        return bool(torch.allclose(z[:, 0], z[:, 1], rtol=1e-5, atol=1e-6 * float(z.abs().max())))

    def train(self, mode: bool = True) -> HFTextModel:
        super().train(mode)
        self.hf.training = mode  # the top-level flag (its modules are this wrapper's)
        return self

    # ------------------------------------------------------------------ the text interface
    @property
    def tok(self) -> nn.Embedding:
        return self.hf.get_input_embeddings()

    @property
    def outputs(self) -> int:
        return self._outputs

    @property
    def depth(self) -> int:
        return len(self._spans) if self._spans else int(getattr(self.hf.config, "num_hidden_layers", 0))

    def forward_embeddings(self, emb: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The Hugging Face model's logits for ``inputs_embeds=emb`` (encoders: ``attention_mask=keep``).

        Attention runs in PyTorch's math kernel: TAG and LAMP differentiate the gradient again, which
        the fused CPU kernel does not support.
        """
        mask = None if self.causal or keep is None else keep.to(torch.long)
        with _math_attention():
            return self.hf(inputs_embeds=emb, attention_mask=mask).logits

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward_embeddings(self.tok(tokens), tokens != self.pad_id)

    # ------------------------------------------------------------------ the span view
    def span_weights(self, layer: int) -> list[str]:
        """Block ``layer``'s query, key and value weights (all multiply the same inputs)."""
        return [f"{m}.weight" for m in self._spans[layer]]

    def layer_inputs(self, layer: int, tokens: torch.Tensor) -> torch.Tensor:
        """The input of block ``layer``'s query projection for the ids ``tokens`` (B × T × width)."""
        keep = tokens != self.pad_id
        return self._capture(layer, lambda: self.forward_embeddings(self.tok(tokens), keep))

    def _capture(self, layer: int, run) -> torch.Tensor:
        """The input of block ``layer``'s query projection in the forward ``run()`` (stopped there)."""
        query = self.get_submodule(self._spans[layer][0])
        box: dict[str, torch.Tensor] = {}

        def hook(_module, args):
            box["x"] = args[0]
            raise _Stop

        handle = query.register_forward_pre_hook(hook)
        try:
            run()
        except _Stop:
            pass
        finally:
            handle.remove()
        return box["x"]

    def extension_inputs(self, prefixes: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        """Block 2's input at position t for every prefix then every option (P × O × width).

        Llama layout: each prefix runs once with all O options behind it, every option at position t and
        attending to the prefix and itself only (a 4-D attention mask and ``position_ids``), t + O tokens
        per prefix instead of O·(t + 1).  Checked against the plain sequences on the first call; a model
        (or transformers version) where they differ gets the plain sequences (:class:`.text_model.TextModel`).
        """
        if self.layout != "llama" or not self.causal or self._packs is False:
            return super().extension_inputs(prefixes, options)
        if self._packs is None:
            few_p, few_o = prefixes[:2], options[:8]
            want = super().extension_inputs(few_p, few_o)
            try:
                got = self._packed(few_p, few_o)
                gap = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
            except Exception:  # noqa: BLE001 (a transformers version that refuses a 4-D mask: plain sequences)
                gap = float("inf")
            self._packs = gap < 1e-4
            if not self._packs:
                return super().extension_inputs(prefixes, options)
        n_p, t = prefixes.shape
        step = max(1, EXTENSION_CHUNK // (t + options.shape[0]))
        return torch.cat([self._packed(prefixes[i:i + step], options) for i in range(0, n_p, step)])

    def _packed(self, prefixes: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        n_p, t = prefixes.shape
        n_o, device = options.shape[0], options.device
        length = t + n_o
        ids = torch.cat([prefixes, options.expand(n_p, -1)], dim=1)
        pos = torch.cat([torch.arange(t, device=device), torch.full((n_o,), t, device=device)])
        allowed = torch.zeros(length, length, dtype=torch.bool, device=device)
        allowed[:t, :t] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        allowed[t:, :t] = True
        allowed[t:, t:] = torch.eye(n_o, dtype=torch.bool, device=device)
        emb = self.tok(ids)
        mask = torch.zeros(length, length, dtype=emb.dtype, device=device)
        mask = mask.masked_fill(~allowed, torch.finfo(emb.dtype).min)[None, None].expand(n_p, 1, -1, -1)

        def run():
            with _math_attention():
                self.hf(inputs_embeds=emb, attention_mask=mask, position_ids=pos[None].expand(n_p, -1))

        return self._capture(1, run)[:, t:]

    def vocab_inputs(self, position: int) -> torch.Tensor:
        """Block 1's input of every token at ``position`` (V × width): V sequences, the token at ``position``."""
        if self.position_free:
            position = 0
        device = self.tok.weight.device
        out = []
        for start in range(0, self.vocab, EXTENSION_CHUNK):
            rows = torch.arange(start, min(start + EXTENSION_CHUNK, self.vocab), device=device)
            ids = torch.full((rows.shape[0], position + 1), self.pad_id, dtype=torch.int64, device=device)
            ids[:, position] = rows
            out.append(self.layer_inputs(0, ids)[:, position])
        return torch.cat(out)


def _span_layout(model: nn.Module) -> tuple[str | None, list[list[str]]]:
    """The layout and, per block, the module names of its q, k, v projections ([] when no layout matches)."""
    import re

    for layout, pattern in SPAN_LAYOUTS:
        found: dict[int, dict[str, str]] = {}
        for name, module in model.named_modules():
            m = re.match(pattern, name)
            if m and isinstance(module, nn.Linear):
                found.setdefault(int(m.group(1)), {})[m.group(2)] = name
        if found and sorted(found) == list(range(len(found))) and all(len(v) == 3 for v in found.values()):
            order = ("query", "key", "value") if layout == "bert" else ("q_proj", "k_proj", "v_proj")
            return layout, [[found[i][k] for k in order] for i in range(len(found))]
    return None, []
