"""DAGER on Hugging Face models built from configs (random init, nothing downloaded): Llama and BERT.

Data: ``lb.load("text", split="test", context=16)`` (held-out standard-library sentences, the bundled
2 000-token BPE).  Models: ``LlamaForCausalLM`` and ``BertForSequenceClassification`` (3 labels, each
sentence labelled b mod 3), 2 layers, 4 heads, intermediate 2·width, width chosen so that B·T < width,
wrapped by ``lb.build`` (:class:`leakbench.models.huggingface.HFTextModel`).  DAGER reads q/k/v of blocks 1
and 2 through the span view: Llama's layer-1 candidates are one position-free set (rotary positions act
after the projection), placed by the greedy extension through block 2; BERT's are position-wise (learned
positions, LN_emb), and encoder batches of B > 1 go to the encoder search (:mod:`leakbench.attacks.text.dager_encoder`).
Chance: the originals' lengths drawn from the corpus's unigram distribution, scored the same way.

Needs the ``transformers`` extra; skipped without it.
"""
from __future__ import annotations

import torch

import leakbench as lb
from leakbench.metrics.text_metrics import unigram_chance

from .bench_text import dager_scored
from .common import console, table


def _model(family: str, vocab: int, width: int):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=width, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=2 * width, max_position_embeddings=64)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=4, **common)).eval()
    return transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=3, **common)).eval()


def _row(family: str, B: int, width: int, batches: int, device: str, unigram) -> list:
    data = lb.load("text", split="test", context=16)
    kw = dict(decode=data.tokenizer.decode, pad_id=data.pad_id, eos_id=data.tokenizer.eos_id)
    model = lb.build(_model(family, data.vocab_size, width), device=device)
    exact = flagged = 0
    acc = seconds = chance_acc = 0.0
    chance_exact = 0
    note = ""
    for k in range(batches):
        x, y = data.batch(B, seed=3000 + 17 * k)
        if family == "bert":
            y = torch.arange(B) % 3
        x, y = x.to(device), y.to(device)
        s, n_flag, took, why = dager_scored(lb.observe(model, x, y), x, kw)
        note = why or note
        seconds += took / batches
        exact += round(s["exact"] * B)
        flagged += n_flag
        acc += s["token_acc"] / batches
        c = unigram_chance(x.cpu(), unigram, **kw)
        chance_exact += round(c["exact"] * B)
        chance_acc += c["token_acc"] / batches
    n = B * batches
    return [family, B, width, f"{exact}/{n}", flagged, acc, seconds, f"{chance_exact}/{n}", chance_acc, note]


def run(quick: bool = False, device: str = "cpu") -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        console.print("[yellow]hf_text needs the transformers extra (pip install 'leakbench[transformers]')[/yellow]")
        return
    unigram = lb.load("text").unigram()
    cells = ((1, 64, 10), (4, 96, 5), (16, 320, 3))  # (B, width, batches)
    rows = [_row(family, B, width, 2 if quick else batches, device, unigram)
            for family in ("llama", "bert") for B, width, batches in cells]
    table("DAGER on Hugging Face models from configs (random init, T = 16, 2 layers)",
          ["model", "B", "width", "exact", "flagged", "token acc", "s/batch", "chance exact", "chance acc", "note"],
          rows, note="10 / 5 / 3 batches at B = 1 / 4 / 16 (n = B·batches sequences); chance: unigram draws")
