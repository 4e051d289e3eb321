"""text-imprint: the malicious server's sentences at B = 1/4/8/16, with and without Decepticons' signature.

Data: held-out bundled sentences (``lb.load("text", split="test")``), T = 16.  The server ships
:func:`leakbench.models.malicious.imprint_text` built on the public training split: ``signature=8``
reserved dimensions (block 1's uniform attention writes the prefix mean of each token's value there) and
K imprint bins after that attention; ``signature=0`` is the block on the input vectors alone (pairs, not
sentences, at B > 1).  Columns: sentences recovered exactly (k of n, after Hungarian matching), of them
flagged exact, rows flagged but wrong (must be 0), token accuracy, mean blend bins per batch (collisions),
seconds per attack; beside them the unigram chance.  Then the utility the server gives up: held-out
next-token loss of a briefly trained decoder before and after the modification.

``--quick``: one batch per cell.
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.metrics.text_metrics import content, text_scores, unigram_chance
from leakbench.models.malicious import imprint_text

from .bench_text import _kw, _train
from .common import table


def _cell(data, shipped, B: int, batches: int, unigram, label: str, bins: int) -> list:
    exact = flagged = wrong = 0
    acc = blends = seconds = c_acc = c_exact = 0.0
    drop = [data.pad_id, data.tokenizer.eos_id]
    for k in range(batches):
        x, y = data.batch(B, seed=1000 + 17 * k)
        obs = lb.observe(shipped, x, y)
        start = time.perf_counter()
        rec = lb.attack("text-imprint", obs)
        seconds += (time.perf_counter() - start) / batches
        s = text_scores(rec.images.cpu(), x, **_kw(data))
        exact += round(s["exact"] * B)
        acc += s["token_acc"] / batches
        blends += rec.trace["blend_bins"] / batches
        originals = content(x, drop)
        for row, ok in zip(content(rec.images.cpu(), drop), rec.trace["exact"]):
            flagged += bool(ok)
            wrong += bool(ok) and row not in originals
        c = unigram_chance(x, unigram, **_kw(data))
        c_acc, c_exact = c_acc + c["token_acc"] / batches, c_exact + c["exact"] * B
    n = B * batches
    return [label, bins, B, batches, f"{exact}/{n}", f"{flagged}/{n}", wrong, acc, blends, seconds,
            f"{round(c_exact)}/{n}", c_acc]


def _loss(model, data, batches: int = 8) -> float:
    total = 0.0
    with torch.no_grad():
        for k in range(batches):
            x, y = data.batch(16, seed=500 + k)
            total += float(torch.nn.functional.cross_entropy(model(x).reshape(-1, data.vocab_size), y.reshape(-1)))
    return total / batches


def run(quick: bool = False) -> None:
    torch.manual_seed(0)
    batches = 1 if quick else 3
    unigram = lb.load("text").unigram()
    data = lb.load("text", split="test", context=16)
    public = lb.load("text", split="train", context=16).ids[:, :16]
    honest = lb.build("gpt:layers=2,width=64,heads=4", input_shape=data.shape, classes=data.vocab_size, seed=0)
    rows = []
    for bins in (4096, 16384):
        shipped = imprint_text(honest, bins=bins, seed=0, public=public, signature=8)
        for B in (1, 4, 8, 16, 32):
            rows.append(_cell(data, shipped, B, batches, unigram, "gpt, signature 8", bins))
    # many collisions, many batches: are the flags ever wrong?
    crowded = imprint_text(honest, bins=1024, seed=0, public=public, signature=8)
    rows.append(_cell(data, crowded, 16, 4 if quick else 20, unigram, "gpt, signature 8 (crowded)", 1024))
    plain = imprint_text(honest, bins=16384, seed=0, public=public)
    for B in (1, 4):
        rows.append(_cell(data, plain, B, batches, unigram, "gpt, no signature", 16384))
    cls = lb.load("text", split="test", context=16, task="classify")
    enc = lb.build(f"bert:layers=2,width=64,heads=4,vocab={cls.vocab_size}", input_shape=cls.shape, classes=21, seed=0)
    shipped = imprint_text(enc, bins=16384, seed=0, public=public, signature=8)
    for B in (4, 8):
        rows.append(_cell(cls, shipped, B, batches, unigram, "bert, signature 8", 16384))
    trained = lb.build("gpt:layers=2,width=64,heads=4", input_shape=data.shape, classes=data.vocab_size, seed=0)
    _train(trained, 16, "cpu", steps=50)
    shipped = imprint_text(trained, bins=16384, seed=0, public=public, signature=8)
    rows.append(_cell(data, shipped, 8, batches, unigram, "gpt trained 50 steps, signature 8", 16384))
    table("text-imprint (width 64, 2 blocks, T = 16) on held-out bundled sentences",
          ["model", "bins", "B", "batches", "exact", "flagged", "wrong flags", "token acc", "blend bins",
           "s/attack", "chance exact", "chance acc"], rows,
          note="n = B·batches sentences; chance: unigram draws of the originals' lengths, scored the same way")
    before, after = _loss(trained, data), _loss(shipped, data)
    table("What the modification costs (gpt:layers=2,width=64 trained 50 Adam steps, lr 1e-3)",
          ["model", "held-out next-token loss (8 batches of 16)"],
          [["as trained", before], ["as the server ships it (signature 8, 16 384 bins)", after],
           ["uniform over the vocabulary", float(torch.log(torch.tensor(float(data.vocab_size))))]])
