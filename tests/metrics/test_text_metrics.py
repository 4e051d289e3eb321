"""Text scores: matching, token accuracy, ROUGE against an independent count, exact rate, chance level."""
from __future__ import annotations

import itertools

import pytest
import torch

from leakbench.errors import ConfigError
from leakbench.metrics.text_metrics import match_sequences, text_scores, token_accuracy_matrix, unigram_chance

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away"]


def decode(ids):
    return " ".join(WORDS[i - 2] for i in ids)  # ids 0 (pad) and 1 (eos) never reach decode


KW = dict(decode=decode, pad_id=0, eos_id=1)
ORIG = torch.tensor([[2, 3, 4, 5, 6, 7, 1, 0], [2, 8, 9, 10, 11, 1, 0, 0], [4, 5, 2, 3, 1, 0, 0, 0]])


def test_a_permuted_batch_scores_perfectly():
    scores = text_scores(ORIG[[2, 0, 1]], ORIG, **KW)
    assert scores == {"token_acc": 1.0, "rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0, "exact": 1.0}


def test_matching_is_the_best_assignment_by_brute_force():
    gen = torch.Generator().manual_seed(0)
    orig = [torch.randint(2, 6, (6,), generator=gen).tolist() for _ in range(4)]
    rec = [torch.randint(2, 6, (6,), generator=gen).tolist() for _ in range(4)]
    acc = token_accuracy_matrix(rec, orig)
    partner = match_sequences(rec, orig)
    best = max(sum(acc[i, p[i]] for i in range(4)) for p in itertools.permutations(range(4)))
    assert sum(acc[i, j] for i, j in enumerate(partner)) == pytest.approx(best)


def test_token_accuracy_and_rouge_by_hand():
    rec = torch.tensor([[2, 3, 4, 9, 9, 9, 0, 0]])  # "the cat sat ran ran ran" vs "the cat sat on a mat"
    s = text_scores(rec, ORIG[:1], **KW)
    assert s["token_acc"] == pytest.approx(3 / 6) and s["exact"] == 0.0
    # unigram overlap 3 of 6 both ways: F1 = 0.5; bigrams: "the cat", "cat sat" of 5: F1 = 0.4
    assert s["rouge1"] == pytest.approx(0.5) and s["rouge2"] == pytest.approx(0.4)


def test_missing_partner_scores_zero_and_fewer_recovered_are_allowed():
    s = text_scores(ORIG[:1], ORIG, **KW)
    assert s["exact"] == pytest.approx(1 / 3) and s["token_acc"] == pytest.approx(1 / 3)


def test_unigram_chance_is_low_and_seeded():
    p = torch.zeros(12)
    p[2:] = 1.0
    a = unigram_chance(ORIG, p, draws=4, seed=0, **KW)
    b = unigram_chance(ORIG, p, draws=4, seed=0, **KW)
    assert a == b and a["exact"] == 0.0 and 0.0 < a["token_acc"] < 0.5


def test_bad_input():
    with pytest.raises(ConfigError, match="original"):
        text_scores(ORIG[:1], torch.zeros(1, 4, dtype=torch.long), **KW)
    with pytest.raises(ConfigError, match="unigram"):
        unigram_chance(ORIG, torch.full((12,), float("nan")), **KW)


def test_compare_points_text_to_text_scores():
    import leakbench as lb

    with pytest.raises(ConfigError, match="text_scores"):
        lb.compare(ORIG, ORIG)
