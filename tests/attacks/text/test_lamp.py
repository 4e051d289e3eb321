"""LAMP: the language-model prior is a real one, and LAMP beats the unigram chance level at B = 1."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks.text.lamp import _lm_nll, language_prior
from leakbench.errors import ConfigError
from leakbench.metrics.text_metrics import text_scores, unigram_chance


@pytest.fixture(scope="module")
def data():
    return lb.load("text", split="test", context=16)


def test_the_prior_predicts_held_out_text_better_than_an_untrained_model(data):
    prior = language_prior(data.vocab_size, 16, 150)
    fresh = lb.build("gpt:layers=2,width=64,heads=4", input_shape=data.shape, classes=data.vocab_size, seed=0)
    x, _ = data.batch(16, seed=0)
    with torch.no_grad():
        assert float(_lm_nll(prior, x, 8).mean()) < float(_lm_nll(fresh, x, 8).mean()) - 1.0
    assert language_prior(data.vocab_size, 16, 150) is prior  # trained once per process and setting


def test_beats_the_unigram_chance_level_and_moves_tokens(data):
    model = lb.build("gpt:layers=1,width=64,heads=4", input_shape=data.shape, classes=data.vocab_size, seed=0)
    x, y = data.batch(1, seed=2002)
    rec = lb.attack("lamp", lb.observe(model, x, y), preset="quick", seed=2)
    kw = dict(decode=data.tokenizer.decode, pad_id=data.pad_id, eos_id=data.tokenizer.eos_id)
    chance = unigram_chance(x, lb.load("text").unigram(), draws=16, **kw)
    got = text_scores(rec.images, x, **kw)
    assert got["rouge1"] > chance["rouge1"] + 0.3 and got["token_acc"] > chance["token_acc"] + 0.3
    assert rec.trace["moves"] >= 1  # the discrete steps changed the order at least once


def test_bad_options():
    obs = lb.observe(lb.build("gpt:layers=1,width=16,heads=2", input_shape=(8,), classes=2000, seed=0),
                     torch.ones(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ConfigError, match="option every"):
        lb.attack("lamp", obs, every=0)
