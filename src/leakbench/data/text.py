"""``TextDataset`` and the ``text`` loader: token sequences for next-token prediction or classification.

A sample is a row of ``context + 1`` token ids: the sentence's tokens, the end-of-sequence token,
then padding (``pad_id``) — or a window of ``context + 1`` tokens cut from running text.
:meth:`TextDataset.batch` returns ``(x, y)`` as :meth:`ImageDataset.batch <leakbench.data.ImageDataset.batch>`
does: ``x`` the first ``context`` ids (B × T, int64); for ``task="lm"`` ``y`` the next token of every
position (B × T, the padded positions −100, which cross-entropy ignores), for ``task="classify"``
``y`` the sample's class (B,).

``load("text")`` takes the bundled corpus (:mod:`.corpus`: standard-library docstring sentences,
labelled by their module) and the bundled tokenizer (:mod:`.tokenizer`); ``files=[...]`` reads
your own UTF-8 text files instead, one sample per line (``windows=False``) or running text cut
into windows (``windows=True``, labels then all 0); only what a sample keeps is tokenised (the head of a
long line, the text up to the last window kept), and ``tokenizer="path.json"`` your own
tokenizer.  ``split``: ``"train"`` (9 of every 10 sentences), ``"test"`` (every 10th) or ``"all"``.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DataNotFound, expect
from .checks import int_option
from .corpus import MODULES, stdlib_sentences
from .dataset import _as_index_array, _check_seed
from .tokenizer import TextTokenizer, bundled_tokenizer, load_tokenizer

__all__ = ["TextDataset", "text", "IGNORE", "MAX_CONTEXT", "TASKS", "SPLITS"]

#: the target of a position that has no next token (cross-entropy's ``ignore_index``).
IGNORE = -100
#: longest sequence the loader makes.
MAX_CONTEXT = 4096
#: most samples the loader keeps, and most ids in all (a bound on memory: rows of context + 1 int64 ids).
MAX_SAMPLES = 1_000_000
MAX_IDS = 64_000_000
TASKS = ("lm", "classify")
SPLITS = ("all", "train", "test")
_MAX_TEXT_BYTES = 256 * 1024**2


@dataclass(eq=False, repr=False)
class TextDataset:
    """Token rows (N × (context+1), int64, padded with ``tokenizer.pad_id``), labels and class names."""

    ids: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    tokenizer: TextTokenizer
    task: str = "lm"
    name: str = "text"

    def __post_init__(self) -> None:
        expect(self.ids.dim() == 2 and self.ids.shape[1] >= 2 and self.ids.dtype == torch.int64,
               f"expected token rows N × (context+1) of int64, got {tuple(self.ids.shape)} {self.ids.dtype} (field ids)")
        expect(self.labels.shape == (self.ids.shape[0],), "expected one label per row (field labels)")
        expect(self.task in TASKS, f"expected task in {TASKS}, got {self.task!r} (field task)")
        expect(len(self) > 0, f"expected at least one sample, got none in {self.name!r}; give non-empty text")

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __repr__(self) -> str:
        return (f"TextDataset(name={self.name!r}, n={len(self)}, context={self.context}, task={self.task!r}, "
                f"vocab={self.vocab_size}, classes={self.num_classes})")

    @property
    def context(self) -> int:
        """T: the length of every input sequence."""
        return int(self.ids.shape[1] - 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """Per-sample input shape ``(T,)`` (``build(spec, input_shape=data.shape, ...)``)."""
        return (self.context,)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def num_classes(self) -> int:
        """Outputs a model needs: the vocabulary (``lm``) or the class count (``classify``)."""
        return self.vocab_size if self.task == "lm" else len(self.classes)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    def lengths(self) -> torch.Tensor:
        """Number of non-padding input tokens of every sample (N,)."""
        return (self.ids[:, :-1] != self.pad_id).sum(1)

    def unigram(self) -> torch.Tensor:
        """The corpus's unigram distribution over the vocabulary (padding and end-of-sequence excluded)."""
        ids = self.ids[self.ids != self.pad_id]
        if self.tokenizer.eos_id is not None:
            ids = ids[ids != self.tokenizer.eos_id]
        counts = torch.bincount(ids, minlength=self.vocab_size).to(torch.float64)
        return counts / counts.sum().clamp_min(1)

    def decode(self, ids) -> list[str]:
        """The text of every row of ``ids`` (B × T)."""
        return [self.tokenizer.decode(row) for row in torch.as_tensor(ids).tolist()]

    def subset(self, indices) -> TextDataset:
        idx = torch.from_numpy(_as_index_array(indices, field="indices", upper=len(self), what="sample"))
        return replace(self, ids=self.ids[idx], labels=self.labels[idx], classes=list(self.classes))

    def with_task(self, task: str) -> TextDataset:
        expect(task in TASKS, f"expected task in {TASKS}, got {task!r} (argument task)")
        return replace(self, task=task)

    def batch(self, size: int | None = None, *, seed: int = 0, indices=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: B × T input ids and the targets of the task (see the module docstring), seeded."""
        if indices is not None:
            idx = _as_index_array(indices, field="indices", upper=len(self), what="sample")
            expect(idx.size > 0, "expected at least one index, got none (field indices)")
        else:
            seed = _check_seed(seed)
            expect(isinstance(size, (int, np.integer)) and not isinstance(size, bool) and 1 <= size <= len(self),
                   f"expected a batch size in 1..{len(self)}, got {size!r} (field size)")
            idx = np.random.default_rng(seed).permutation(len(self))[:size]
        rows = self.ids[torch.from_numpy(np.asarray(idx, dtype=np.int64))]
        x = rows[:, :-1].clone()
        if self.task == "classify":
            return x, self.labels[torch.from_numpy(np.asarray(idx, dtype=np.int64))].clone()
        y = rows[:, 1:].clone()
        y[y == self.pad_id] = IGNORE
        return x, y


def _rows(seqs: Sequence[list[int]], context: int, pad: int, eos: int | None) -> torch.Tensor:
    out = torch.full((len(seqs), context + 1), pad, dtype=torch.int64)
    for i, s in enumerate(seqs):
        s = (list(s) + ([eos] if eos is not None else []))[: context + 1]
        out[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
    return out


#: characters of text tokenised at a time when cutting windows from running text.
_CHUNK_CHARS = 1 << 20


def encode_head(tok: TextTokenizer, text: str, need: int) -> list[int]:
    """The first ``need`` token ids of ``text`` (all of them when it has fewer), tokenising only a prefix.

    The prefix starts at a few characters a token and doubles until it holds more than ``need`` + 1 tokens (the
    last one may be cut by the prefix's end) or is the whole text, so a 16 MiB line costs about the characters
    of the tokens kept, not the line.
    """
    size = 4 * (need + 2)
    while size < len(text):
        ids = tok.encode(text[:_cut(text, size // 2, size)])
        if len(ids) > need + 1:
            return ids[:need]
        size *= 2
    return tok.encode(text)[:need]


def _cut(text: str, low: int, high: int) -> int:
    """Where to end a piece of ``text`` near ``high``: before its last space or line break in [low, high), so
    the piece ends between words (as a tokenizer's pre-tokenizer splits), else at ``high``."""
    cut = max(text.rfind(" ", low, high), text.rfind("\n", low, high))
    return cut if cut > low else high


def _encode_stream(tok: TextTokenizer, texts: Sequence[str], need: int) -> np.ndarray:
    """At most ``need`` token ids of the running ``texts``, tokenised in chunks ending before a space or line
    break and kept as int64: the work and memory follow the ids kept, not the text's length."""
    out: list[np.ndarray] = []
    total = 0
    for text in texts:
        start = 0
        while start < len(text) and total < need:
            end = len(text) if len(text) - start <= _CHUNK_CHARS else _cut(text, start, start + _CHUNK_CHARS)
            ids = np.asarray(tok.encode(text[start:end]), dtype=np.int64)[: need - total]
            out.append(ids)
            total += len(ids)
            start = end
        if total >= need:
            break
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _read_files(files: Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    texts, total = [], 0
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise DataNotFound(f"expected a text file, got no file at {str(path)!r} (field files)")
        total += path.stat().st_size
        expect(total <= _MAX_TEXT_BYTES, f"expected at most {_MAX_TEXT_BYTES // 1024**2} MiB of text, got more "
               "(field files); pass fewer or smaller files")
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"expected UTF-8 text, got undecodable bytes in {str(path)!r} (field files)") from None
    return texts


def text(
    *,
    files: Sequence[str | os.PathLike] | str | None = None,
    tokenizer: str | os.PathLike | None = None,
    vocab: int = 2000,
    context: int = 16,
    task: str = "lm",
    windows: bool = False,
    split: str = "all",
    min_tokens: int = 2,
    limit: int | None = None,
) -> TextDataset:
    """Token sequences of ``context`` ids from the bundled corpus or your ``files`` (see the module docstring).

    ``tokenizer``: a ``tokenizers`` JSON file (default: the bundled byte-level BPE of ``vocab`` tokens);
    ``min_tokens``: sentences with fewer tokens are dropped; ``limit``: keep the first ``limit`` samples.
    """
    context = int_option(context, field="context", minimum=1)
    expect(context <= MAX_CONTEXT, f"expected context <= {MAX_CONTEXT}, got {context} (field context)")
    expect(task in TASKS, f"expected task in {TASKS}, got {task!r} (field task)")
    expect(split in SPLITS, f"expected split in {SPLITS}, got {split!r} (field split)")
    min_tokens = int_option(min_tokens, field="min_tokens", minimum=1)
    if limit is not None:
        limit = int_option(limit, field="limit", minimum=1)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else bundled_tokenizer(vocab)

    if files is None:
        expect(not windows, "windows=True cuts your own files; the bundled corpus is sentences (field windows)")
        pairs = list(stdlib_sentences())
        classes = list(MODULES)
        name = "text"
    else:
        texts = _read_files(files)
        if windows:
            pairs = [(t, 0) for t in texts]
        else:
            pairs = [(line.strip(), 0) for t in texts for line in t.splitlines() if line.strip()]
        classes = ["text"]
        name = "text-files"
    expect(any(s for s, _ in pairs), "expected some text, got empty input (field files); give non-empty UTF-8 files")
    if split != "all":
        keep = (lambda i: i % 10 == 9) if split == "test" else (lambda i: i % 10 != 9)
        pairs = [p for i, p in enumerate(pairs) if keep(i)]

    if windows:
        most = min(MAX_SAMPLES if limit is None else limit, MAX_IDS // (context + 1))
        stream = _encode_stream(tok, [s for s, _ in pairs], most * (context + 1))
        n = len(stream) // (context + 1)
        expect(n >= 1, f"expected at least {context + 1} tokens to cut one window, got {len(stream)} (field files)")
        ids = torch.from_numpy(stream[: n * (context + 1)].copy()).reshape(n, context + 1)
        labels = torch.zeros(n, dtype=torch.int64)
    else:
        seqs, labels_list = [], []
        for s, label in pairs:
            enc = encode_head(tok, s, max(context + 1, min_tokens))  # a row keeps context + 1 ids
            if len(enc) >= min_tokens:
                seqs.append(enc)
                labels_list.append(label)
            if len(seqs) >= (MAX_SAMPLES if limit is None else limit):
                break
        expect(len(seqs) > 0, f"expected sentences of at least {min_tokens} tokens, got none (field files)")
        expect(len(seqs) * (context + 1) <= MAX_IDS, f"expected at most {MAX_IDS:,} token ids in memory, got "
               f"{len(seqs):,} samples × {context + 1} (field limit); pass limit= or a shorter context")
        ids = _rows(seqs, context, tok.pad_id, tok.eos_id)
        labels = torch.tensor(labels_list, dtype=torch.int64)
    unk = tok.unk_id
    if unk is not None:
        n_unk = int((ids == unk).any(1).sum())
        expect(n_unk == 0, f"expected text the tokenizer knows, got {n_unk} of {len(ids)} sequences holding its unknown "
               f"token (id {unk}) (field files); an attack would recover the unknown token, not your text: use a "
               "tokenizer that covers your text (a byte-level BPE covers every string) or clean the text")
    bad = int((ids >= tok.vocab_size).sum())
    expect(bad == 0, f"expected token ids below the vocabulary size {tok.vocab_size}, got {bad} (field tokenizer)")
    return TextDataset(ids=ids, labels=labels, classes=classes, tokenizer=tok, task=task, name=name)
