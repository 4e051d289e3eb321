"""text-imprint: exact (token, position) pairs from a server's imprint block on h⁰ = E[v] + P[t]."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError, UnsupportedThreatModel
from leakbench.metrics.text_metrics import text_scores, unigram_chance
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
        assert rec.trace["max_lone_distance"] < 1e-4
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
