"""text-imprint: exact (token, position) pairs from a server's imprint block on h⁰ = E[v] + P[t]."""
from __future__ import annotations

import copy

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError, UnsupportedThreatModel
from leakbench.metrics.text_metrics import content, text_scores, unigram_chance
from leakbench.models.malicious import imprint_text


@pytest.fixture(scope="module")
def data():
    return lb.load("text", split="test", context=16)


@pytest.fixture(scope="module")
def honest(data):
    return lb.build("gpt:layers=2,width=64,heads=4", input_shape=data.shape, classes=data.vocab_size, seed=0)


@pytest.fixture(scope="module")
def shipped(honest):
    public = lb.load("text", split="train", context=16).ids[:, :16]  # the server's public text
    return imprint_text(honest, bins=4096, seed=0, public=public)


def kw(data):
    return dict(decode=data.tokenizer.decode, pad_id=data.pad_id, eos_id=data.tokenizer.eos_id)


def test_the_block_barely_changes_the_model(data, honest, shipped):
    x, _ = data.batch(2, seed=0)
    with torch.no_grad():
        assert float((shipped(x) - honest(x)).abs().max()) < 1e-4
    assert honest.pre is None  # the caller's model is not changed


def test_exact_sentences_at_batch_one(data, shipped):
    unigram = lb.load("text").unigram()
    for seed in range(4):  # n = 4 held-out sentences
        x, y = data.batch(1, seed=100 + seed)
        rec = lb.attack("text-imprint", lb.observe(shipped, x, y))
        s = text_scores(rec.images, x, **kw(data))
        assert s["exact"] == 1.0 and rec.trace["exact"] == [True] and rec.trace["blend_bins"] == 0
        # float32 round-off of eq. (1), relative to ‖z‖: 1.06e-4 measured on one machine, below 1e-4 on another
        assert rec.trace["max_lone_distance"] < 1e-3
        assert unigram_chance(x, unigram, **kw(data))["exact"] == 0.0


def test_blends_are_never_claimed(data, honest):
    # 8 bins for 16 positions: bins hold several positions, whose blends lie on no table entry
    few = imprint_text(honest, bins=8, seed=0)
    x, y = data.batch(1, seed=100)
    rec = lb.attack("text-imprint", lb.observe(few, x, y))
    assert rec.trace["blend_bins"] > 0 and rec.trace["exact"] == [False]


def test_larger_batches_give_exact_pairs_not_sequences(data, shipped):
    x, y = data.batch(4, seed=5)
    rec = lb.attack("text-imprint", lb.observe(shipped, x, y))
    have = {(t, int(x[b, t])) for b in range(4) for t in range(16) if int(y[b, t]) != -100}
    assert rec.trace["pairs"] and set(rec.trace["pairs"]) <= have  # every lone pair is in the batch
    assert len(rec.trace["pairs"]) >= 0.8 * len(have)
    assert rec.trace["exact"] == [False] * 4  # which sentence a pair belongs to is not known


def test_refusals_and_bad_input(data, honest, shipped):
    x, y = data.batch(1, seed=0)
    with pytest.raises(UnsupportedThreatModel, match="imprint_text"):
        lb.attack("text-imprint", lb.observe(honest, x, y))
    with pytest.raises(UnsupportedThreatModel, match="model.pre"):
        lb.attack("dager", lb.observe(shipped, x, y))
    with pytest.raises(ConfigError, match="argument bins"):
        imprint_text(honest, bins=1)
    with pytest.raises(ConfigError, match="argument model"):
        imprint_text(torch.nn.Linear(3, 3))
    with pytest.raises(ConfigError, match="at least 64 public positions"):
        imprint_text(honest, bins=64, public=x[:, :2])
    with pytest.raises(ConfigError, match="option tol"):
        lb.attack("text-imprint", lb.observe(shipped, x, y), tol=2.0)


def test_noise_of_growing_sigma_never_helps(data, shipped):
    x, y = data.batch(1, seed=101)
    rates, pairs = [], []
    for sigma in (0.0, 1e-9, 1e-6, 1e-3):
        obs = lb.observe(shipped, x, y, defense=f"noise:{sigma}" if sigma else None)
        rec = lb.attack("text-imprint", obs)
        rates.append(text_scores(rec.images, x, **kw(data))["exact"])
        pairs.append(len(rec.trace["pairs"]))
    assert rates[0] == 1.0 and rates[-1] == 0.0 and pairs[-1] == 0, (rates, pairs)
    assert all(a >= b for a, b in zip(rates, rates[1:])) and all(a >= b for a, b in zip(pairs, pairs[1:])), (rates, pairs)


# ---------------------------------------------------------------- Decepticons: sentences at B > 1
@pytest.fixture(scope="module")
def signed(honest):
    public = lb.load("text", split="train", context=16).ids[:, :16]
    return imprint_text(honest, bins=16384, seed=0, public=public, signature=8)


def _rows(data, rows):
    """(x, y) of token rows of length T + 1 (padding where a row is short), as ``data.batch`` cuts them."""
    rows = torch.stack(rows)
    x, y = rows[:, :-1].clone(), rows[:, 1:].clone()
    y[y == data.pad_id] = -100
    return x, y


def _check_flags(rec, x, data):
    """Every row flagged exact is one of the batch's sentences; returns the number flagged."""
    drop = [data.pad_id, data.tokenizer.eos_id]
    originals = content(x, drop)
    got = content(rec.images.cpu(), drop)
    flagged = [r for r, f in zip(got, rec.trace["exact"]) if f]
    assert all(r in originals for r in flagged), "a row flagged exact is not a sentence of the batch"
    return len(flagged)


@pytest.mark.parametrize("B,seed", [(4, 101), (8, 101)])
def test_signature_groups_whole_sentences_at_batch_4_and_8(data, signed, B, seed):
    x, y = data.batch(B, seed=seed)
    rec = lb.attack("text-imprint", lb.observe(signed, x, y))
    s = text_scores(rec.images, x, **kw(data))
    chance = unigram_chance(x, lb.load("text").unigram(), **kw(data))
    assert s["token_acc"] == 1.0 and s["exact"] == 1.0 and rec.trace["exact"] == [True] * B
    assert _check_flags(rec, x, data) == B
    assert rec.trace["sentences"] == B and rec.trace["ambiguous_links"] == 0
    assert rec.trace["max_link_residual"] < 1e-2
    assert chance["exact"] == 0.0 and chance["token_acc"] < 0.1  # the unigram chance level


def test_signature_flags_are_never_wrong_over_batches(data, signed):
    # three batches per B (n = 4·3, 8·3): whatever is flagged is right, and at B = 1 everything is
    flagged = {}
    for B in (1, 4, 8):
        flagged[B] = 0
        for seed in (100, 101, 102):
            x, y = data.batch(B, seed=seed)
            rec = lb.attack("text-imprint", lb.observe(signed, x, y))
            flagged[B] += _check_flags(rec, x, data)
    assert flagged[1] == 3 and flagged[4] >= 8 and flagged[8] >= 16, flagged


def test_shared_prefix_repeated_and_prefix_sentences(data, signed):
    ids = lb.load("text", split="test", context=16).ids
    full = [i for i in range(len(ids)) if int((ids[i] != data.pad_id).sum()) == 17]  # rows that fill the context
    a = ids[full[0]].clone()
    b = next(ids[i].clone() for i in full[1:] if ids[i][0] != a[0])
    mix = torch.cat([a[:8], b[8:]])                   # shares its first 8 tokens with a
    short = torch.full_like(a, data.pad_id)           # a's first 5 tokens, then end of sequence: a prefix of a
    short[:5], short[5] = a[:5], data.tokenizer.eos_id
    x, y = _rows(data, [a, b, mix, a])                # a twice
    rec = lb.attack("text-imprint", lb.observe(signed, x, y))
    assert rec.trace["blend_bins"] == 0 and rec.trace["sentences"] == 3  # a and mix branch at position 8
    assert _check_flags(rec, x, data) == 3            # a, b and mix; the repeat's row is not flagged
    assert rec.trace["exact"].count(False) == 1
    x, y = _rows(data, [a, b, short, mix])
    rec = lb.attack("text-imprint", lb.observe(signed, x, y))
    assert rec.trace["sentences"] == 3                # the prefix sentence ends inside a's path: no leaf
    assert _check_flags(rec, x, data) == 3 and rec.trace["exact"].count(False) == 1


def test_a_bin_collision_leaves_its_sentences_unflagged(data, honest):
    few = imprint_text(honest, bins=512, seed=0, public=lb.load("text", split="train", context=16).ids[:, :16],
                       signature=8)
    x, y = data.batch(4, seed=100)
    rec = lb.attack("text-imprint", lb.observe(few, x, y))
    with torch.no_grad():
        h = few.attended(x)
    bins = few.blocks[0].mid.bin_of(h.reshape(-1, h.shape[-1])).reshape(x.shape)
    visible = y != -100
    count = torch.bincount(bins[visible], minlength=512)
    clean = [bool((count[bins[r][visible[r]]] == 1).all()) for r in range(4)]  # every position alone in its bin
    assert rec.trace["blend_bins"] > 0 and not all(clean)
    n = _check_flags(rec, x, data)
    assert n <= sum(clean) < 4


def test_rebuilt_positions_are_collided_pairs_and_leave_rows_unflagged(data, signed):
    # B = 16: positions share bins; those rebuilt by equation (4) are true (position, token) pairs that collided
    x, y = data.batch(16, seed=1017)
    rec = lb.attack("text-imprint", lb.observe(signed, x, y))
    with torch.no_grad():
        h = signed.attended(x)
    visible = y != -100
    bins = signed.blocks[0].mid.bin_of(h[visible])
    pairs = [(t, int(x[b, t])) for b in range(16) for t in range(16) if visible[b, t]]
    collided = set()
    for k in bins.unique().tolist():
        members = (bins == k).nonzero().reshape(-1).tolist()
        if len({pairs[m] for m in members}) > 1 or (h[visible][members] - h[visible][members[0]]).abs().max() > 1e-4:
            collided.update(pairs[m] for m in members)
    assert rec.trace["rebuilt"] and set(rec.trace["rebuilt"]) <= collided
    s = text_scores(rec.images, x, **kw(data))
    n = _check_flags(rec, x, data)
    assert round(s["exact"] * 16) > n                    # rebuilt rows are exact but not flagged
    assert rec.trace["sentences"] <= 16


def test_noise_of_growing_sigma_degrades_the_sentences(data, signed):
    # the block's weight gradients are ~1e-11 (gain 1e-3 spread over 16 384 bins): σ = 1e-16 already moves them
    x, y = data.batch(4, seed=101)
    counts, lone = [], []
    for sigma in (0.0, 1e-17, 1e-16, 1e-15, 1e-13):
        rec = lb.attack("text-imprint", lb.observe(signed, x, y, defense=f"noise:{sigma}" if sigma else None))
        counts.append(_check_flags(rec, x, data))
        lone.append(rec.trace["lone_bins"])
    assert counts[0] == 4 and counts[-1] == 0 and lone[-1] == 0, (counts, lone)
    assert all(a >= b for a, b in zip(counts, counts[1:])), counts
    assert all(a >= b for a, b in zip(lone, lone[1:])), lone


def test_signature_on_an_encoder(data):
    cls = lb.load("text", split="test", context=16, task="classify")
    enc = lb.build(f"bert:layers=2,width=64,heads=4,vocab={cls.vocab_size}", input_shape=cls.shape, classes=21, seed=0)
    shipped = imprint_text(enc, bins=16384, seed=0, public=lb.load("text", split="train", context=16).ids[:, :16],
                           signature=8)
    x, y = cls.batch(4, seed=100)
    rec = lb.attack("text-imprint", lb.observe(shipped, x, y))
    assert rec.trace["exact"] == [True] * 4 and text_scores(rec.images, x, **kw(cls))["exact"] == 1.0
    assert _check_flags(rec, x, cls) == 4


def test_signature_bad_options(data, honest, signed):
    x, y = data.batch(2, seed=0)
    with pytest.raises(ConfigError, match="argument signature"):
        imprint_text(honest, signature=40)             # more than half the width
    with pytest.raises(ConfigError, match="argument signature"):
        imprint_text(honest, signature=-1)
    with pytest.raises(ConfigError, match="argument model"):
        imprint_text(signed, signature=8)              # already carries the server's block
    with pytest.raises(ConfigError, match="option link_tol"):
        lb.attack("text-imprint", lb.observe(signed, x, y), link_tol=2.0)
    with pytest.raises(ConfigError, match="option rounding"):
        lb.attack("text-imprint", lb.observe(signed, x, y), rounding=0.5)
    tampered = copy.deepcopy(signed)
    with torch.no_grad():
        tampered.blocks[0].attn.qkv.weight[0, 0] = 1.0
    with pytest.raises(UnsupportedThreatModel, match="not uniform"):
        lb.attack("text-imprint", lb.observe(tampered, x, y))
    with pytest.raises(UnsupportedThreatModel, match="mid"):
        lb.attack("dager", lb.observe(signed, x, y))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_signature_on_cuda_gives_the_cpu_sentences(data, honest):
    public = lb.load("text", split="train", context=16).ids[:, :16]
    on_gpu = imprint_text(copy.deepcopy(honest).to("cuda"), bins=16384, seed=0, public=public.cuda(), signature=8)
    on_cpu = imprint_text(copy.deepcopy(honest), bins=16384, seed=0, public=public, signature=8)
    x, y = data.batch(8, seed=101)
    rec = lb.attack("text-imprint", lb.observe(on_gpu, x.cuda(), y.cuda()))
    cpu = lb.attack("text-imprint", lb.observe(on_cpu, x, y))
    # the same machine's CPU, not a fixed count: the vocabulary's tokenizer and torch's initialisation differ between
    # environments (on the H200's image, torch 2.11, this batch gives 5 of 8 on both devices)
    assert rec.images.device.type == "cuda" and rec.trace["exact"] == cpu.trace["exact"] and any(cpu.trace["exact"])
    assert torch.equal(rec.images.cpu(), cpu.images)
    assert text_scores(rec.images.cpu(), x, **kw(data))["exact"] == text_scores(cpu.images, x, **kw(data))["exact"] > 0
