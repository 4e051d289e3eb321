"""Tokenizers: a small byte-level BPE trained offline on the bundled corpus, cached as JSON, or the user's own.

:func:`bundled_tokenizer` trains a byte-level BPE (HF ``tokenizers``; Radford et al. 2019's
byte-level variant of Sennrich et al. 2016's BPE) with ``vocab`` tokens on the sentences of
:mod:`.corpus`, with the special tokens ``[PAD]`` (id 0) and ``[EOS]`` (id 1).  Training is
deterministic; the result is cached as the tokenizer's own JSON under
``$LEAKBENCH_CACHE/tokenizers`` (or ``~/.cache/leakbench/tokenizers``), keyed by the corpus's
Python version and the vocabulary size, so it is trained once (JSON, never pickle).

:func:`load_tokenizer` reads a user's ``tokenizers`` JSON file; it must hold a padding token
(``[PAD]``, ``<pad>`` or ``<|endoftext|>``) and may hold an end-of-sequence token.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, DataNotFound, expect
from .corpus import corpus_version, stdlib_sentences

__all__ = ["TextTokenizer", "bundled_tokenizer", "load_tokenizer", "tokenizer_cache", "MAX_VOCAB",
           "TOKENIZER_VERSION"]

#: largest vocabulary a tokenizer may have here (the models' embedding tables are V × width).
MAX_VOCAB = 65_536
#: bump when the training recipe changes: old cache entries are then never reused.
TOKENIZER_VERSION = 1
PAD, EOS = "[PAD]", "[EOS]"
_PAD_NAMES = (PAD, "<pad>", "<|endoftext|>")
_EOS_NAMES = (EOS, "</s>", "<|endoftext|>", "[SEP]")
_MAX_FILE_BYTES = 64 * 1024**2


@dataclass(frozen=True, eq=False)
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the ids of its padding and end-of-sequence tokens and a name."""

    backend: object
    pad_id: int
    eos_id: int | None
    name: str

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def unk_id(self) -> int | None:
        """The id of the model's unknown token (word-level and WordPiece vocabularies), None when it has none."""
        unk = getattr(getattr(self.backend, "model", None), "unk_token", None)
        return None if unk is None else self.backend.token_to_id(unk)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``; a ConfigError (one line) where the tokenizer cannot encode it."""
        try:
            return list(self.backend.encode(text).ids)
        except Exception as err:  # the tokenizers library raises a bare Exception (e.g. a WordLevel model without [UNK])
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"expected text the tokenizer {self.name!r} can encode, got {text[:40]!r}: {first} "
                              "(argument tokenizer); use a tokenizer that covers your text (a byte-level BPE covers "
                              "every string) or give it an unknown token") from None

    def decode(self, ids) -> str:
        """The text of ``ids`` with padding and end-of-sequence tokens dropped."""
        drop = {self.pad_id, self.eos_id}
        return self.backend.decode([int(i) for i in ids if int(i) not in drop])

    def to_json(self) -> str:
        return self.backend.to_str()


def tokenizer_cache(cache_dir: str | os.PathLike | bool | None = None) -> Path | None:
    """The tokenizer cache: ``cache_dir``, else ``$LEAKBENCH_CACHE/tokenizers``, else ``~/.cache/leakbench/tokenizers``."""
    if cache_dir is False:
        return None
    if cache_dir is None or cache_dir is True:
        base = os.environ.get("LEAKBENCH_CACHE")
        return Path(base) / "tokenizers" if base else Path.home() / ".cache" / "leakbench" / "tokenizers"
    return Path(cache_dir)


def _wrap(backend, name: str) -> TextTokenizer:
    vocab = backend.get_vocab(with_added_tokens=True)
    pad = next((vocab[t] for t in _PAD_NAMES if t in vocab), None)
    expect(pad is not None, f"expected a tokenizer with a padding token (one of {', '.join(_PAD_NAMES)}), got none "
           f"in {name!r} (argument tokenizer); add one with tokenizer.add_special_tokens(['[PAD]'])")
    eos = next((vocab[t] for t in _EOS_NAMES if t in vocab), None)
    size = backend.get_vocab_size(with_added_tokens=True)
    expect(2 <= size <= MAX_VOCAB, f"expected a vocabulary of 2..{MAX_VOCAB} tokens, got {size} (argument tokenizer)")
    return TextTokenizer(backend=backend, pad_id=int(pad), eos_id=None if eos is None else int(eos), name=name)


def _train(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[PAD, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([s for s, _ in stdlib_sentences()], trainer=trainer)
    return tok


def bundled_tokenizer(vocab: int = 2000, *, cache_dir: str | os.PathLike | bool | None = None) -> TextTokenizer:
    """A byte-level BPE of ``vocab`` tokens trained on the bundled corpus (cached as JSON after the first call)."""
    from tokenizers import Tokenizer

    expect(isinstance(vocab, int) and not isinstance(vocab, bool) and 300 <= vocab <= MAX_VOCAB,
           f"expected vocab in 300..{MAX_VOCAB} (256 byte tokens + merges + 2 special), got {vocab!r} (field vocab)")
    config = {"version": TOKENIZER_VERSION, "corpus": corpus_version(), "kind": "byte-bpe", "vocab": vocab}
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    name = f"bundled-bpe-{vocab}"
    root = tokenizer_cache(cache_dir)
    path = None if root is None else root / f"{name}-{key}.json"
    if path is not None and path.exists():
        try:
            return _wrap(Tokenizer.from_file(str(path)), name)
        except Exception:  # noqa: BLE001 (a broken cache entry is retrained and overwritten)
            pass
    backend = _train(vocab)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(backend.to_str())
        os.replace(tmp, path)
    return _wrap(backend, name)


def load_tokenizer(path: str | os.PathLike) -> TextTokenizer:
    """A user's ``tokenizers`` JSON file (``Tokenizer.save(path)``); it must name a padding token."""
    from tokenizers import Tokenizer

    file = Path(path)
    if not file.is_file():
        raise DataNotFound(f"expected a tokenizer JSON file, got no file at {str(file)!r} (argument tokenizer)")
    expect(file.stat().st_size <= _MAX_FILE_BYTES, f"expected a tokenizer file of at most "
           f"{_MAX_FILE_BYTES // 1024**2} MiB, got {file.stat().st_size / 1024**2:.0f} MiB (argument tokenizer)")
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 (the library's message, on one line)
        raise ConfigError(f"expected a tokenizers JSON file, could not read {str(file)!r}: "
                          f"{' '.join(str(err).split())[:200]} (argument tokenizer)") from None
    return _wrap(backend, file.stem)
