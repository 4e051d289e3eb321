"""The text dataset kind: bundled corpus, tokenizer (trained, cached, user's own), batches and bad input."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.data.corpus import MODULES, stdlib_sentences
from leakbench.data.text import IGNORE, TextDataset
from leakbench.data.tokenizer import bundled_tokenizer, load_tokenizer
from leakbench.errors import ConfigError, DataNotFound


@pytest.fixture(scope="module")
def data():
    return lb.load("text", context=16)


def test_corpus_is_deterministic_sentences_of_sorted_modules():
    first, again = stdlib_sentences(), stdlib_sentences.__wrapped__()
    assert first == again and len(first) > 1000
    assert list(MODULES) == sorted(MODULES)
    labels = [label for _, label in first]
    assert labels == sorted(labels)  # module order
    assert all(4 <= len(s.split()) <= 40 and s.isascii() for s, _ in first)
    assert len({s for s, _ in first}) == len(first)


def test_batch_shapes_targets_and_padding(data):
    assert isinstance(data, TextDataset) and data.shape == (16,) and data.vocab_size == 2000
    x, y = data.batch(8, seed=3)
    assert x.dtype == torch.int64 and x.shape == (8, 16) and y.shape == (8, 16)
    rows = data.ids[torch.isin(data.ids[:, 0], x[:, 0])]  # the targets are the next tokens
    assert rows.numel()
    valid = y != IGNORE
    assert torch.equal(y[:, :-1][valid[:, :-1]], x[:, 1:][valid[:, :-1]])
    padded = x == data.pad_id
    assert bool((~valid[padded]).all())  # no loss on a padded position
    x2, y2 = data.batch(8, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_sentences_round_trip_through_the_tokenizer(data):
    x, _ = data.batch(4, seed=0)
    for row, text in zip(x, data.decode(x)):
        ids = data.tokenizer.encode(text)
        n = min(len(ids), 16)
        assert ids[:n] == [i for i in row.tolist() if i not in (data.pad_id, data.tokenizer.eos_id)][:n]


def test_tokenizer_is_cached_as_json(tmp_path):
    first = bundled_tokenizer(400, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and files[0].read_text().lstrip().startswith("{")
    again = bundled_tokenizer(400, cache_dir=tmp_path)
    assert again.encode("Return the value.") == first.encode("Return the value.")
    own = load_tokenizer(files[0])  # a user's own tokenizer JSON
    assert own.vocab_size == 400 and own.pad_id == 0
    retrained = bundled_tokenizer(400, cache_dir=tmp_path / "other")  # training is deterministic
    assert retrained.to_json() == first.to_json()


def test_classification_labels_are_modules():
    data = lb.load("text", task="classify", split="test")
    x, y = data.batch(5, seed=0)
    assert data.num_classes == len(MODULES) and y.shape == (5,) and int(y.max()) < len(MODULES)


def test_user_files_lines_and_windows(tmp_path, data):
    path = tmp_path / "mine.txt"
    path.write_text("The quick brown fox jumps.\n\nA second line of text here.\n")
    lines = lb.load("text", files=[path], context=8)
    assert len(lines) == 2 and lines.decode(lines.ids[:, :-1])[0].startswith("The quick")
    windows = lb.load("text", files=str(path), context=4, windows=True)
    assert windows.ids.shape[1] == 5 and bool((windows.ids != windows.pad_id).all())


def test_unigram_is_a_distribution_without_specials(data):
    p = data.unigram()
    assert abs(float(p.sum()) - 1) < 1e-9 and float(p[data.pad_id]) == 0 and float(p[data.tokenizer.eos_id]) == 0


@pytest.mark.parametrize("opts, message", [
    ({"context": 0}, "field context"),
    ({"task": "translate"}, "field task"),
    ({"split": "dev"}, "field split"),
    ({"windows": True}, "field windows"),
])
def test_bad_options_one_line(opts, message):
    with pytest.raises(ConfigError, match=message):
        lb.load("text", **opts)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ConfigError, match="empty input"):
        lb.load("text", files=[empty])
    with pytest.raises(DataNotFound, match="no file"):
        lb.load("text", files=[tmp_path / "absent.txt"])
    bad = tmp_path / "tok.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="argument tokenizer"):
        lb.load("text", tokenizer=bad)


def _word_tokenizer(path, unk):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "hello": 1, "world": 2, **({unk: 3} if unk else {})}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk) if unk else models.WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.parametrize("unk, message", [
    ("[UNK]", r"got 1 of 2 sequences holding its unknown token \(id 3\) \(field files\)"),
    (None, r"can encode, got 'foo bar baz'.*\(argument tokenizer\)"),
])
def test_unknown_tokens_one_line(tmp_path, unk, message):
    # a word-level tokenizer that does not know "foo": with an unknown token the text would silently become [UNK]s
    # (an attack would "recover" them); without one the tokenizers library raises a bare Exception
    text = tmp_path / "a.txt"
    text.write_text("hello world hello\nfoo bar baz\n")
    with pytest.raises(ConfigError, match=message) as err:
        lb.load("text", files=[text], tokenizer=_word_tokenizer(tmp_path / "tok.json", unk), context=4)
    assert "\n" not in str(err.value)
    text.write_text("hello world hello\nworld hello\n")  # the same tokenizer on text it knows
    assert lb.load("text", files=[text], tokenizer=tmp_path / "tok.json", context=4).ids.shape == (2, 5)
