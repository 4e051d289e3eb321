"""Issue 48: a text file is tokenised as far as its samples keep, not as far as it goes."""
from __future__ import annotations

import random
import time

import pytest

import leakbench as lb
from leakbench.data.text import encode_head
from leakbench.data.tokenizer import TextTokenizer, bundled_tokenizer

WORDS = ("the gradient of a batch leaks its samples when the model is wide and the batch is small; "
         "defenses trade utility for privacy, and attacks trade compute for fidelity. ").split()


def prose(chars: int, seed: int = 0) -> str:
    """``chars`` characters of words: 4 KiB drawn at random, repeated."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < min(chars, 4096):
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    unit = " ".join(out)
    return ((unit + " ") * (chars // (len(unit) + 1) + 1))[:chars].rstrip()


@pytest.fixture(scope="module")
def data_tok():
    return bundled_tokenizer(2000)  # the files' default tokenizer


@pytest.fixture
def counted(monkeypatch):
    """The characters handed to the tokenizer, in all."""
    seen = {"chars": 0}
    encode = TextTokenizer.encode

    def counting(self, text):
        seen["chars"] += len(text)
        return encode(self, text)

    monkeypatch.setattr(TextTokenizer, "encode", counting)
    return seen


def test_a_16_mib_line_costs_the_tokens_kept(tmp_path, data_tok, counted):
    line = prose(16 * 2**20)
    path = tmp_path / "long.txt"
    path.write_text(line + "\nshort second line here\n")
    start = time.perf_counter()
    data = lb.load("text", files=[path], context=16)
    assert time.perf_counter() - start < 2.0
    assert counted["chars"] < 10_000  # the line's head, not its 16 M characters
    head = data.tokenizer.encode(line[:2000])  # cut between words, as far as the row needs
    assert data.ids[0].tolist() == head[:17]


def test_the_head_is_the_head_of_the_whole_encoding(data_tok):
    for seed in range(5):
        text = prose(3000, seed)
        full = data_tok.encode(text)
        for need in (1, 5, 17, 64, len(full) + 3):
            assert encode_head(data_tok, text, need) == full[:need]


def test_windows_stop_at_the_last_window_kept(tmp_path, data_tok, counted, monkeypatch):
    monkeypatch.setattr("leakbench.data.text._CHUNK_CHARS", 2**16)
    path = tmp_path / "running.txt"
    path.write_text("\n".join(prose(2**20 // 8, s) for s in range(40)))  # 5 MiB of running text
    start = time.perf_counter()
    data = lb.load("text", files=[path], context=8, windows=True, limit=3)
    assert time.perf_counter() - start < 2.0
    assert data.ids.shape == (3, 9)
    assert counted["chars"] <= 2**16  # one piece, not the whole file


def test_windows_of_a_small_text_are_those_of_its_whole_encoding(tmp_path, data_tok):
    text = prose(20_000, 3)
    path = tmp_path / "small.txt"
    path.write_text(text)
    data = lb.load("text", files=[path], context=8, windows=True)
    full = data_tok.encode(text)
    n = len(full) // 9
    assert data.ids.shape == (n, 9) and data.ids.reshape(-1).tolist() == full[: n * 9]
