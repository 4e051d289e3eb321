"""Scores of a text reconstruction: token accuracy, ROUGE-1/2/L and the exact-sequence rate, with their chance level.

A batched gradient carries the batch as an unordered set, so, as for images (:mod:`.matching`,
Liu et al. 2024 eq. (1)), recovered sequences are first paired one-to-one with the originals by
the Hungarian method (``scipy.optimize.linear_sum_assignment``), here maximising the summed token
accuracy.  Padding and end-of-sequence ids are dropped from both sides first; an original's
content is its remaining L tokens.

- token accuracy of a pair: the fraction of the original's L positions whose token the recovered
  sequence has at the same position (the measure of TAG, LAMP and DAGER's tables);
- ROUGE-1, ROUGE-2, ROUGE-L (Lin 2004): F-measures of the decoded texts from the ``rouge-score``
  package (Google's reference implementation, as LAMP and DAGER report them);
- exact: the recovered sequence equals the original.

Each is the mean over the B originals (an original left without a partner scores 0).
:func:`unigram_chance` scores sequences drawn from the corpus's unigram distribution, of the
originals' lengths, the same way: what an attacker who saw nothing would get.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..errors import ConfigError, expect

__all__ = ["content", "token_accuracy_matrix", "match_sequences", "text_scores", "unigram_chance", "TEXT_SCORES"]

#: the scores :func:`text_scores` returns.
TEXT_SCORES = ("token_acc", "rouge1", "rouge2", "rougeL", "exact")
Decode = Callable[[Sequence[int]], str]


def content(tokens, drop: Sequence[int | None]) -> list[list[int]]:
    """Each row of ``tokens`` (B × T, or a list of id lists) without the ids in ``drop`` (padding, end of sequence)."""
    rows = tokens.tolist() if isinstance(tokens, torch.Tensor) else [list(r) for r in tokens]
    skip = {int(d) for d in drop if d is not None}
    return [[int(i) for i in row if int(i) not in skip] for row in rows]


def token_accuracy_matrix(recovered: list[list[int]], originals: list[list[int]]) -> np.ndarray:
    """A[i, j]: the fraction of original i's positions whose token recovered j has at that position (B × R)."""
    acc = np.zeros((len(originals), len(recovered)))
    for i, o in enumerate(originals):
        if not o:
            continue
        o_arr = np.asarray(o)
        for j, r in enumerate(recovered):
            n = min(len(o), len(r))
            acc[i, j] = float((np.asarray(r[:n]) == o_arr[:n]).sum()) / len(o)
    return acc


def match_sequences(recovered: list[list[int]], originals: list[list[int]]) -> list[int | None]:
    """For every original, the index of its recovered partner (Hungarian, maximal total token accuracy), or None."""
    from scipy.optimize import linear_sum_assignment  # lazy: `import leakbench` skips scipy
    if not recovered:
        return [None] * len(originals)
    rows, cols = linear_sum_assignment(token_accuracy_matrix(recovered, originals), maximize=True)
    partner: list[int | None] = [None] * len(originals)
    for i, j in zip(rows, cols):
        partner[int(i)] = int(j)
    return partner


def _rouge(pairs: list[tuple[str, str]]) -> np.ndarray:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    out = np.zeros((len(pairs), 3))
    for k, (ref, hyp) in enumerate(pairs):
        s = scorer.score(ref, hyp)
        out[k] = (s["rouge1"].fmeasure, s["rouge2"].fmeasure, s["rougeL"].fmeasure)
    return out


def text_scores(recovered, originals, *, decode: Decode, pad_id: int, eos_id: int | None = None) -> dict[str, float]:
    """Mean token accuracy, ROUGE-1/2/L F-measures and exact-sequence rate after the best matching (module docstring).

    ``recovered`` and ``originals``: B × T id tensors (or lists of id lists); ``decode`` maps ids to text
    (``data.tokenizer.decode``).
    """
    orig = content(originals, (pad_id, eos_id))
    rec = content(recovered, (pad_id, eos_id))
    expect(len(orig) > 0 and any(orig), "expected at least one original sequence with content (argument originals)")
    partner = match_sequences(rec, orig)
    acc = token_accuracy_matrix(rec, orig)
    token_acc = [acc[i, j] if j is not None else 0.0 for i, j in enumerate(partner)]
    exact = [float(j is not None and rec[j] == o) for o, j in zip(orig, partner)]
    rouge = _rouge([(decode(o), decode(rec[j]) if j is not None else "") for o, j in zip(orig, partner)])
    return {"token_acc": float(np.mean(token_acc)), "rouge1": float(rouge[:, 0].mean()),
            "rouge2": float(rouge[:, 1].mean()), "rougeL": float(rouge[:, 2].mean()), "exact": float(np.mean(exact))}


def unigram_chance(originals, unigram: torch.Tensor, *, decode: Decode, pad_id: int, eos_id: int | None = None,
                   draws: int = 8, seed: int = 0) -> dict[str, float]:
    """The scores of ``draws`` batches drawn from ``unigram`` (one token per original position), averaged."""
    p = torch.as_tensor(unigram, dtype=torch.float64).reshape(-1)
    expect(p.numel() > 0 and bool(torch.isfinite(p).all()) and bool((p >= 0).all()) and float(p.sum()) > 0,
           "expected a unigram distribution of non-negative finite weights (argument unigram)")
    if not (isinstance(draws, int) and 1 <= draws <= 1000):
        raise ConfigError(f"expected draws in 1..1000, got {draws!r} (argument draws)")
    orig = content(originals, (pad_id, eos_id))
    gen = torch.Generator().manual_seed(int(seed))
    totals = dict.fromkeys(TEXT_SCORES, 0.0)
    for _ in range(draws):
        fake = [torch.multinomial(p, len(o), replacement=True, generator=gen).tolist() if o else [] for o in orig]
        for k, v in text_scores(fake, orig, decode=decode, pad_id=pad_id, eos_id=eos_id).items():
            totals[k] += v / draws
    return totals
