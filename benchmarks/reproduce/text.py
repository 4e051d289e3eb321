"""Text gradient inversion: TAG, LAMP and DAGER against batch size, beside the published ordering.

Claims (none of the three papers is in ../shared/papers; the orderings are quoted from their abstracts
and result tables, no number is):

* DAGER (Petrov et al., NeurIPS 2024, arXiv:2405.15586): exact recovery of whole batches, ROUGE-1/2
  > 0.99, up to B = 128 on GPT-2 (width 768, 12 blocks) and LLaMa-2 7B; far above TAG and LAMP at every B.
* LAMP (Balunović et al., NeurIPS 2022, arXiv:2202.08827): above TAG in ROUGE-1/2 on BERT-base, TinyBERT
  and BERT-large, both falling with B (B ≤ 8 there).
* TAG (Deng et al., EMNLP Findings 2021): partial recovery (a fraction of tokens) at small B.

The ordering DAGER ≫ LAMP > TAG is what we check.

Ours: held-out bundled sentences (``lb.load("text", split="test")``), T = 16 (T = 8 at B = 64), batches
of seeds 3000, 3017, … (4 at B = 1, 2 at B = 4, 1 at B = 16 and 64: n = 4, 8, 16, 64 sequences), untrained
``gpt:layers=2,heads=4`` decoders whose width keeps B·T < width (DAGER's condition): 64, 128, 320, 544 at
B = 1, 4, 16, 64 (the papers: width 768–4096, 12–32 blocks, a 50k vocabulary against our 2 000).  B = 64 at
T = 16 needs width > 1024, where DAGER's extension through block 2 takes minutes on 2 CPU cores (it ran over
3 minutes there before we stopped it).  TAG and LAMP (labels unknown) on the same model and batch, with Adam
iterations cut as B grows to keep the run to minutes on 2 CPU cores: 300 / 200 / 100 / 50 at B = 1 / 4 /
16 / 64 (the papers: thousands of steps).  LAMP's prior (``gpt:layers=2,width=64``, trained on the
training split) is trained once before any clock starts.  Chance: sequences of the originals' lengths
drawn from the bundled unigram distribution (8 draws), scored the same way.  ``--full`` doubles the TAG/LAMP
iterations.
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.errors import LeakbenchError
from leakbench.metrics.text_metrics import text_scores, unigram_chance

from .common import table

#: B → (sequence length T, decoder width, TAG/LAMP iterations, batches: n = B · batches sequences)
PLAN = {1: (16, 64, 300, 4), 4: (16, 128, 200, 2), 16: (16, 320, 100, 1), 64: (8, 544, 50, 1)}
ORDERING = ("published: DAGER ≫ LAMP > TAG in ROUGE-1/2; DAGER exact (ROUGE > 0.99) up to B = 128 on GPT-2 / "
            "LLaMa-2 7B; LAMP and TAG fall with B")


def _kw(data):
    return dict(decode=data.tokenizer.decode, pad_id=data.pad_id, eos_id=data.tokenizer.eos_id)


def rows(*, full: bool = False, batches=(1, 4, 16, 64), iterations: int | None = None) -> list[list]:
    """One row per attack and B, then the chance row; ``iterations`` overrides TAG's and LAMP's (tests)."""
    unigram = lb.load("text").unigram()
    out = []
    for B in batches:
        T, width, steps, count = PLAN[B]
        steps = iterations or steps * (2 if full else 1)
        data = lb.load("text", split="test", context=T)
        model = lb.build(f"gpt:layers=2,width={width},heads=4", input_shape=data.shape, classes=data.vocab_size,
                         seed=0)
        pairs = [data.batch(B, seed=3000 + 17 * k) for k in range(count)]
        n = B * count
        for name, opts in (("tag", {"iterations": steps, "lr": 0.02}),
                           ("lamp", {"iterations": steps, "lr": 0.02, "every": 50 if iterations is None else max(1, iterations // 2)}),
                           ("dager", {})):
            r1 = r2 = exact = seconds = 0.0
            for k, (x, y) in enumerate(pairs):
                obs = lb.observe(model, x, y)
                if name == "lamp" and k == 0:
                    lb.attack("lamp", obs, iterations=1)  # trains the prior once per process, before the clock starts
                start = time.perf_counter()
                try:
                    tokens = lb.attack(name, obs, seed=k, **opts).images
                except LeakbenchError:  # nothing recovered: scored as all padding
                    tokens = torch.zeros_like(x)
                seconds += (time.perf_counter() - start) / count
                s = text_scores(tokens, x, **_kw(data))
                r1, r2, exact = r1 + s["rouge1"] / count, r2 + s["rouge2"] / count, exact + s["exact"] * B
            out.append([name.upper() if name != "dager" else "DAGER", B, T, width,
                        steps if name != "dager" else "-", r1, r2, f"{round(exact)}/{n}", seconds])
        c = [unigram_chance(x, unigram, **_kw(data)) for x, _ in pairs]
        out.append(["chance (unigram)", B, T, width, "-", sum(v["rouge1"] for v in c) / count,
                    sum(v["rouge2"] for v in c) / count, f"{round(sum(v['exact'] for v in c) * B)}/{n}", 0.0])
    return out


def run(full: bool = False, batches=(1, 4, 16, 64)) -> None:
    table("TAG, LAMP, DAGER on held-out bundled sentences (untrained gpt:layers=2; n = 4, 8, 16, 64 sequences)",
          ["attack", "B", "T", "width", "iterations", "ROUGE-1", "ROUGE-2", "exact sequences", "seconds"],
          rows(full=full, batches=batches),
          note=f"{ORDERING}.  Ours: widths 64–544 and 2 blocks, T = 8 at B = 64, a 2 000-token BPE, TAG/LAMP at 50–300 steps "
               "(the papers: GPT-2/BERT-base and larger, thousands of steps); seconds per batch")
