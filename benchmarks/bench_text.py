"""Text: DAGER's exact recovery and TAG's token accuracy on held-out bundled sentences, beside the chance level.

Data: ``lb.load("text", split="test")`` — every 10th standard-library docstring sentence (held out of
any training here), byte-level BPE of 2 000 tokens, T = the context.  Chance: sequences of the
originals' lengths drawn from the bundled corpus's unigram distribution, scored the same way (8 draws).

1. DAGER on untrained ``gpt:layers=2`` decoders, width chosen so that B·T < width (the span
   must not be full), at several (B, T); and on decoders trained briefly (Adam, lr 1e-3: 50 steps at
   width 64/128, 200 at width 320) on the training split.  Columns: sequences recovered exactly (k of n), of them flagged exact, token
   accuracy, ROUGE-1/2, seconds per batch.
2. DAGER on ``bert:layers=2`` encoders (module labels, 21 classes) at B = 1/4/8 (B = 16 with ``--device cuda``),
   untrained and trained briefly (Adam lr 1e-4, 100 steps on the training split; at lr 1e-3 block 2's gradient
   loses its per-token directions, docs/text.md); the encoder search is bounded to ``ENCODER_SECONDS`` per batch.
3. TAG and LAMP at B = 1 on ``gpt:layers=1,width=64`` (labels unknown: soft next-token targets optimised
   too), on the same sentences.

``--quick``: fewer batches; ``--device cuda`` adds B = 64 (width 1088), too slow on 2 CPU cores.
"""
from __future__ import annotations

import time

import torch

import leakbench as lb
from leakbench.errors import LeakbenchError
from leakbench.metrics.text_metrics import text_scores, unigram_chance

from .common import table


def _kw(data):
    return dict(decode=data.tokenizer.decode, pad_id=data.pad_id, eos_id=data.tokenizer.eos_id)


def _train(model, context: int, device: str, steps: int = 50, lr: float = 1e-3) -> None:
    """Brief training: ``steps`` Adam steps on batches of 16 from the training split (docs/text.md on lr 5e-3)."""
    train = lb.load("text", split="train", context=context)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        xb, yb = train.batch(16, seed=step)
        xb, yb = xb.to(device), yb.to(device)
        loss = torch.nn.functional.cross_entropy(model(xb).reshape(-1, train.vocab_size), yb.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def dager_scored(obs, x: torch.Tensor, kw: dict) -> tuple[dict, int, float, str]:
    """DAGER on ``obs``: the text scores against ``x``, sequences flagged exact, seconds, and the error's name when
    it recovered nothing (scored as all padding)."""
    start = time.perf_counter()
    note = ""
    try:
        rec = lb.attack("dager", obs)
        tokens, n_flag = rec.images, int(sum(rec.trace["exact"]))
    except LeakbenchError as err:
        tokens, n_flag, note = torch.zeros_like(x), 0, type(err).__name__
    took = time.perf_counter() - start
    return text_scores(tokens.cpu(), x.cpu(), **kw), n_flag, took, note


def _dager_row(label: str, B: int, T: int, width: int, batches: int, device: str, unigram, trained=0):
    data = lb.load("text", split="test", context=T)
    model = lb.build(f"gpt:layers=2,width={width},heads=4", input_shape=data.shape, classes=data.vocab_size,
                     seed=0, device=device)
    if trained:
        _train(model, T, device, steps=trained)
    exact = flagged = 0
    acc = r1 = r2 = seconds = 0.0
    chance = dict.fromkeys(("token_acc", "rouge1", "exact"), 0.0)
    for k in range(batches):
        x, y = data.batch(B, seed=1000 + 17 * k)
        x, y = x.to(device), y.to(device)
        s, n_flag, took, _ = dager_scored(lb.observe(model, x, y), x, _kw(data))
        seconds += took / batches
        exact += round(s["exact"] * B)
        flagged += n_flag
        acc, r1, r2 = acc + s["token_acc"] / batches, r1 + s["rouge1"] / batches, r2 + s["rouge2"] / batches
        c = unigram_chance(x.cpu(), unigram, **_kw(data))
        for key in chance:
            chance[key] += c[key] / batches
    n = B * batches
    return [label, B, T, width, f"{exact}/{n}", flagged, acc, r1, r2, seconds,
            f"{round(chance['exact'] * n)}/{n}", chance["token_acc"], chance["rouge1"]]


#: the encoder search's bound on seconds per batch here.
ENCODER_SECONDS = 60.0


def _train_encoder(model, device: str, steps: int = 100, lr: float = 1e-4) -> None:
    """Brief training on the module labels: ``steps`` Adam steps on batches of 16 from the training split."""
    train = lb.load("text", split="train", context=16).with_task("classify")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        xb, yb = train.batch(16, seed=step)
        loss = torch.nn.functional.cross_entropy(model(xb.to(device)), yb.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _encoder_row(label: str, B: int, width: int, batches: int, device: str, unigram, trained: int = 0):
    data = lb.load("text", split="test", context=16).with_task("classify")
    model = lb.build(f"bert:layers=2,width={width},heads=4,vocab={data.vocab_size}", input_shape=data.shape,
                     classes=data.num_classes, seed=1 if trained else 0, device=device)
    if trained:
        _train_encoder(model, device, steps=trained)
    exact = flagged = wrong = 0
    acc = seconds = chance_acc = 0.0
    chance_exact = 0
    for k in range(batches):
        x, y = data.batch(B, seed=100 + k)
        obs = lb.observe(model, x.to(device), y.to(device))
        start = time.perf_counter()
        try:
            rec = lb.attack("dager", obs, seconds=ENCODER_SECONDS)
            tokens, flags = rec.images.cpu(), rec.trace["exact"]
        except LeakbenchError:
            tokens, flags = torch.zeros_like(x), [False] * B
        seconds += (time.perf_counter() - start) / batches
        s = text_scores(tokens, x, **_kw(data))
        exact += round(s["exact"] * B)
        flagged += int(sum(flags))
        truth = {tuple(r[r != data.pad_id].tolist()) for r in x}
        wrong += sum(1 for r, f in zip(tokens, flags) if f and tuple(r[r != data.pad_id].tolist()) not in truth)
        acc += s["token_acc"] / batches
        c = unigram_chance(x, unigram, **_kw(data))
        chance_acc += c["token_acc"] / batches
        chance_exact += round(c["exact"] * B)
    n = B * batches
    return [label, B, width, f"{exact}/{n}", flagged, wrong, acc, seconds, f"{chance_exact}/{n}", chance_acc]


def run(quick: bool = False, device: str = "cpu") -> None:
    torch.manual_seed(0)
    unigram = lb.load("text").unigram()
    batches = 2 if quick else 3
    settings = [(1, 16, 64), (4, 16, 128), (16, 16, 320), (8, 8, 80), (4, 32, 160)]
    if device != "cpu":
        settings.append((64, 16, 1088))
    rows = [_dager_row("untrained", B, T, W, batches, device, unigram) for B, T, W in settings]
    for B, W, n, steps in ((1, 64, 6, 50), (4, 128, 6, 50), (16, 320, 2, 200)):
        rows.append(_dager_row(f"trained {steps} steps", B, 16, W, 2 if quick else n, device, unigram, trained=steps))
    table("DAGER (gpt:layers=2) on held-out bundled sentences",
          ["model", "B", "T", "width", "exact", "flagged", "token acc", "ROUGE-1", "ROUGE-2", "s/batch",
           "chance exact", "chance acc", "chance R-1"], rows,
          note=f"{batches} batches per untrained row (n = B·batches sequences); chance: unigram draws")

    enc = [(1, 64), (4, 128), (8, 160)] + ([(16, 320)] if device != "cpu" else [])
    rows = [_encoder_row(f"{'trained 100 steps' if steps else 'untrained'}", B, W, 2 if quick else 3, device, unigram,
                         trained=steps) for steps in (0, 100) for B, W in enc]
    table("DAGER on bert:layers=2 encoders (T = 16, granted lengths), held-out bundled sentences",
          ["model", "B", "width", "exact", "flagged", "flagged wrong", "token acc", "s/batch", "chance exact",
           "chance acc"], rows,
          note=f"n = B·batches sequences; search bounded to {ENCODER_SECONDS:.0f} s per batch; chance: unigram draws")

    data = lb.load("text", split="test", context=16)
    model = lb.build("gpt:layers=1,width=64,heads=4", input_shape=data.shape, classes=data.vocab_size, seed=0,
                     device=device)
    count = 3 if quick else 8
    rows = []
    chance = dict.fromkeys(("token_acc", "rouge1", "rouge2", "exact"), 0.0)
    sentences = [data.batch(1, seed=2000 + k) for k in range(count)]
    for x, _ in sentences:
        for key, value in unigram_chance(x, unigram, **_kw(data)).items():
            if key in chance:
                chance[key] += value / count
    for name in ("tag", "lamp"):
        totals = dict.fromkeys(chance, 0.0)
        seconds = 0.0
        for k, (x, y) in enumerate(sentences):
            obs = lb.observe(model, x.to(device), y.to(device))
            if name == "lamp" and k == 0:
                lb.attack(name, obs, iterations=1)  # trains the prior once, before the clock starts
            start = time.perf_counter()
            rec = lb.attack(name, obs, iterations=300, lr=0.02, seed=k)
            seconds += (time.perf_counter() - start) / count
            for key, value in text_scores(rec.images.cpu(), x, **_kw(data)).items():
                if key in totals:
                    totals[key] += value / count
        rows.append([name, count, totals["token_acc"], totals["rouge1"], totals["rouge2"], totals["exact"], seconds])
    rows.append(["chance (unigram)", count, chance["token_acc"], chance["rouge1"], chance["rouge2"], chance["exact"],
                 0.0])
    table("TAG and LAMP (gpt:layers=1,width=64, B = 1, labels unknown, 300 Adam steps each, same sentences)",
          ["attack", "n", "token acc", "ROUGE-1", "ROUGE-2", "exact", "s"], rows,
          note="LAMP's prior: gpt:layers=2,width=64 trained 300 steps on the training split (trained once, not timed)")
