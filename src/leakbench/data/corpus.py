"""The bundled text corpus: English sentences cut from the docstrings of the Python standard library.

Every Python install carries these, so the corpus needs no download.  The sources are read with
:mod:`ast` (nothing is imported or run): the docstrings of each module in :data:`MODULES` (a fixed,
sorted list), its classes and its functions, in source order.  Doctest and indented (code) lines
are dropped, paragraphs are joined and cut into sentences at ". ", "? " and "! "; a sentence is kept
when it holds 4 to 40 words, only printable ASCII and at least one lower-case letter, and is not
a duplicate of an earlier one.

The sentences depend on the Python version's standard library (``corpus_version()`` names it):
the same Python gives the same corpus, in the same order.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
import sys

__all__ = ["MODULES", "stdlib_sentences", "corpus_version"]

#: the standard-library modules whose docstrings make the corpus (sorted; each one's label is its index).
MODULES: tuple[str, ...] = (
    "argparse", "collections", "csv", "datetime", "email.message", "functools", "heapq", "inspect",
    "json", "logging", "pathlib", "random", "shutil", "subprocess", "tarfile", "textwrap", "threading",
    "typing", "unittest.case", "urllib.parse", "zipfile",
)

_SPLIT = re.compile(r"(?<=[.?!])\s+(?=[A-Z])")
_MIN_WORDS, _MAX_WORDS = 4, 40


def corpus_version() -> str:
    """What the corpus depends on: the Python version whose standard library it is cut from."""
    return f"python-{sys.version_info.major}.{sys.version_info.minor}"


def _docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                   ast.AsyncFunctionDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    return [d for d in (ast.get_docstring(n, clean=True) for n in nodes) if d]


def _sentences(doc: str) -> list[str]:
    paragraphs, current = [], []
    for line in doc.splitlines():
        text = line.strip()
        if not text or line.startswith((" ", "\t")) or text.startswith((">>>", "...", ":", "-", "*")):
            if current:
                paragraphs.append(" ".join(current))
            current = []
            continue
        current.append(text)
    if current:
        paragraphs.append(" ".join(current))
    out = []
    for paragraph in paragraphs:
        for sentence in _SPLIT.split(paragraph):
            sentence = " ".join(sentence.split())
            words = sentence.split()
            if (_MIN_WORDS <= len(words) <= _MAX_WORDS and sentence.isascii() and sentence.isprintable()
                    and any(c.islower() for c in sentence) and sentence[0].isupper()):
                out.append(sentence)
    return out


@functools.lru_cache(maxsize=1)
def stdlib_sentences() -> tuple[tuple[str, int], ...]:
    """(sentence, module index into :data:`MODULES`) for every kept sentence, in module then source order."""
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    for label, name in enumerate(MODULES):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue  # a stripped-down Python without this module's source: the corpus is smaller
        with open(spec.origin, encoding="utf-8") as f:
            source = f.read()
        for doc in _docstrings(source):
            for sentence in _sentences(doc):
                if sentence not in seen:
                    seen.add(sentence)
                    out.append((sentence, label))
    return tuple(out)
