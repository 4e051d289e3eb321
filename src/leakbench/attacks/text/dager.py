"""DAGER: exact recovery of a text batch from a transformer's gradient (Petrov et al., NeurIPS 2024).

Petrov, Dimitrov, Baader, Müller & Vechev, "DAGER: Exact Gradient Inversion for Large Language
Models" (arXiv:2405.15586).  Sec. 4: a linear layer Z = X W (X the B·T inputs of width d) has
the weight gradient ∂L/∂W = Xᵀ ∂L/∂Z, so its rank is at most B·T and, when B·T < d, its
column span (the row span of PyTorch's out × in layout) is a proper subspace that contains every
input row x_i whose output gradient is non-zero — and, generically, no other vector.  Sec. 5
turns this into a membership test for discrete tokens, the *span check*: a candidate input z is
accepted when its distance to the span, d(z) = ‖z − Π z‖ (Π the orthogonal projector onto the
top-r right singular vectors of the gradient), is below a threshold τ.

Here (the models of :mod:`leakbench.models.transformers`, pre-LN, learned positions):

1. **Layer 1, position-wise candidates** (Sec. 5.1).  The first block's fused [Q; K; V]
   projection multiplies z_{b,t} = LN₁(E[v_{b,t}] + P[t]).  For every position t and every
   vocabulary token v the attacker computes LN₁(E[v] + P[t]) and its relative distance to the
   span of ∇W_qkv of block 1 (SVD in float64, rank r₁ = #σ > ``rank_tol``·σ_max); tokens with
   distance < ``tol`` form the candidate set C_t (all tokens at position t across the batch).
2. **Decoders: greedy extension through layer 2** (Sec. 5.2).  Causal attention makes block 2's
   input at position t a function of the prefix v_0..v_t only; every recovered prefix is extended
   by every v ∈ C_t and kept when block 2's LN₁ input at t passes the span check of block 2's
   ∇W_qkv.  A prefix with no passing extension is a finished sequence.
3. **Encoders** (Sec. 5.3).  B = 1: the candidate sets are the sequence.  B > 1
   (:mod:`.dager_encoder`): bidirectional attention makes block 2's input at every position depend
   on the whole sequence, so whole sequences are scored: the lengths are read from the
   end-of-sequence token among the C_t (or granted), the sequences of C_0 × … × C_{l-1} are scored
   by block 2's span check at every position — exhaustively up to ``max_combinations`` (the
   paper), else by our seeded coordinate search (one position at a time, every candidate tried
   with the rest fixed, batched) — and the ones within ``tol2`` everywhere are kept; an encoder
   batch of B > 1 needs 2 blocks.  Flags: :mod:`.dager_encoder`.

Each recovered sequence is flagged exact (``confidence`` 1) when every one of its positions passed
both span checks, unambiguously (its token ``margin`` times closer to block 2's span than any other
candidate after the same prefix), the directions of block 2's gradient above its float32 floor (σ > 10·σ_{N+1})
and the distinct prefixes recovered match in number to within ``SIGNAL_SHARE``, and, where the sequence
lengths are granted, its length is one of them; slots left over when fewer distinct sequences were found than B (a repeated
sequence leaves one span direction) are copies, flagged not exact.  Preconditions (refused up
front otherwise): the gradient of one step, B·T < width (the span must not be full: the paper's
bound), our transformer's layout.  Positions without a loss (padding, and the end-of-sequence
token whose target is padding) contribute nothing to the gradient and come back as padding; a
sequence that is a strict prefix of another in the same batch is not told apart from it.
Equation numbers of the paper were not checked in this session: the section numbers name where.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...errors import ConfigError, NothingRecovered
from ...models.text_model import TextModel
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from .dager_encoder import encoder_batch
from .span_check import span_basis, span_distance

__all__ = ["Dager", "DagerOptions", "span_basis", "span_distance"]

#: σ_{N+1}/σ_1 above this (N the tokens behind the gradient, which bound its rank) means noise: a float32
#: gradient's own floor is near 1e-8.
NOISE_FLOOR = 1e-5
#: a singular value counts as signal when above this multiple of σ_{N+1} (N the tokens: the gradient's float32 floor).
SIGNAL_FACTOR = 10.0
#: decoders: sequences are flagged exact only when block 2's signal rank and the number of distinct prefixes
#: recovered (each has its own direction in block 2's input) are within this share of each other.  Measured at
#: B = 16, width 320 (signal rank / the batch's distinct prefixes): untrained 223/223, trained 200 steps at lr 1e-3
#: 223/223 and 220/221; trained 20 steps at lr 5e-3, where block 2 fails: 124/223 — directions under the floor.
SIGNAL_SHARE = 0.9
#: most prefixes × candidates checked at one position (a bound on memory and time).
MAX_EXTENSIONS = 1_000_000


def _unit(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` / ‖grad‖_F (zero stays zero)."""
    return grad / grad.norm().clamp_min(1e-30)


def _beyond_rank(s: torch.Tensor, rank: int) -> float:
    """σ_{rank+1}/σ_1 of the singular values ``s`` (descending; 0 when there are no more): what lies past the token count."""
    return float(s[rank] / s[0]) if s.numel() > rank and float(s[0]) > 0 else 0.0


def _signal_rank(s: torch.Tensor, tail: float) -> int:
    """#σ_i/σ_1 > SIGNAL_FACTOR · tail of the singular values ``s``: the directions above the float32 floor."""
    if s.numel() == 0 or float(s[0]) == 0.0:
        return 0
    return int((s / s[0] > SIGNAL_FACTOR * tail).sum())


@dataclass
class DagerOptions:
    """Options of ``dager``."""

    #: relative span distance below which a token passes block 1's span check (the paper's τ₁).
    tol: float = 1e-3
    #: the same for a prefix at block 2 (τ₂).  Measured on a briefly trained decoder (B = 4, six batches):
    #: 1e-3 gives 19 of 24 sequences exact, 3e-3 17 of 24 (looser lets wrong branches through).
    tol2: float = 1e-3
    #: prefixes kept per batch slot at each position (the beam: at most beam·B, the closest to the span).
    beam: int = 4
    #: a sequence is flagged exact only when, at every position, its token's block-2 distance is below
    #: margin × that of the best other candidate after the same prefix (tokens that another kept sequence
    #: with the same prefix has there excepted): a search that could as well have taken another token
    #: certifies nothing (measured: a briefly trained width-320 decoder at B = 16 passed wrong sequences
    #: at 1e-4 while its true ones sat at up to 1.6e-3).
    margin: float = 0.1
    #: singular values below rank_tol·σ_max are taken as zero when the gradient's rank is read; the rank is
    #: also capped by the number of tokens (Σ of the granted sequence lengths, else B·T).
    rank_tol: float = 1e-9
    #: encoders at B > 1 (:mod:`.dager_encoder`): every combination of a length's candidates is scored when
    #: there are at most this many (the paper's exhaustive search), else our coordinate search runs.
    max_combinations: int = 4096
    #: encoders: random starts of the coordinate search per sequence sought, in each round.
    restarts: int = 4
    #: encoders: rounds of starts per length (a round that finds no new sequence ends the length).
    rounds: int = 6
    #: encoders: most sweeps over the positions per round.
    sweeps: int = 8
    #: encoders: candidates per position scored on the whole sequence after screening by their own position.
    screen: int = 4
    #: encoders: a bound on the search's wall-clock seconds (what is found by then is returned, flagged as usual).
    seconds: float = 300.0
    #: encoders: the tokenizer's end-of-sequence id (the threat model grants the tokenizer; the bundled one's
    #: ``[EOS]`` is 1), which ends every sequence shorter than T; None for a tokenizer that appends none.
    eos_id: int | None = 1

    def check(self) -> None:
        for name in ("tol", "tol2", "rank_tol", "margin"):
            value = getattr(self, name)
            if not (isinstance(value, float) and 0 < value < 1):
                raise ConfigError(f"expected {name} in (0, 1), got {value!r} (option {name})")
        if not (isinstance(self.beam, int) and 1 <= self.beam <= 1000):
            raise ConfigError(f"expected beam in 1..1000, got {self.beam!r} (option beam)")
        for name, high in (("max_combinations", 10_000_000), ("restarts", 1000), ("rounds", 100), ("sweeps", 100),
                           ("screen", 10_000)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= high):
                raise ConfigError(f"expected {name} an integer in 1..{high}, got {value!r} (option {name})")
        if not (isinstance(self.seconds, (int, float)) and not isinstance(self.seconds, bool)
                and 0 < self.seconds <= 86_400):
            raise ConfigError(f"expected seconds in (0, 86400], got {self.seconds!r} (option seconds)")
        if self.eos_id is not None and not (isinstance(self.eos_id, int) and not isinstance(self.eos_id, bool)
                                            and self.eos_id >= 0):
            raise ConfigError(f"expected eos_id a token id ≥ 0 or None, got {self.eos_id!r} (option eos_id)")


@register
class Dager(Attack):
    """DAGER (Petrov et al. 2024): span checks of token embeddings against attention-weight gradients, exact text."""

    name = "dager"
    tags = ("gradient",)
    modality = "text"
    Options = DagerOptions
    presets = {"quick": {}}
    # 1: encoders at B > 1 run the search (dager_encoder) instead of being refused; models read through the span
    # view (Hugging Face layouts), q/k/v gradients scaled to norm 1 where they are separate weights
    preset_revisions = {"default": 1, "quick": 1}

    def requirements(self, obs: Observation) -> list[str]:
        model = obs.model
        if not isinstance(model, TextModel):
            return ["DAGER reads the first attention layers of leakbench's text transformers (gpt:/bert: specs, Hugging Face "
                    f"models given to lb.build); got a {type(model).__name__}"]
        reasons = []
        if model.span_unsupported:
            reasons.append(model.span_unsupported)
        if model.modified:
            reasons.append("the model carries a server's block on its residual stream (model.pre or a block's mid): "
                           "DAGER reads block "
                           "1's input as LN₁(E[v] + P[t]); attack the server's block with text-imprint instead")
        if obs.kind != "gradient" and obs.local_steps != 1:
            reasons.append(f"DAGER needs the gradient of one step, got an update after {obs.local_steps} steps")
        tokens = obs.batch_size * int(obs.input_shape[0])
        if tokens >= model.width:
            reasons.append(f"B·T = {obs.batch_size}·{obs.input_shape[0]} = {tokens} ≥ width {model.width}: the "
                           "attention gradient's span can be the whole space and every token would pass the span "
                           "check (DAGER needs B·T < width); use a smaller batch, shorter sequences or a wider model")
        if model.causal and model.depth < 2 and obs.batch_size > 1:
            reasons.append("a decoder batch of B > 1 needs 2 blocks (the second block's span check orders the "
                           "tokens)")
        if not model.causal and model.depth < 2 and obs.batch_size > 1:
            reasons.append("an encoder batch of B > 1 needs 2 blocks: block 1 checks each position alone, and only "
                           "block 2's span check ties the tokens of one sequence together (Sec. 5.3); B = 1 works")
        return reasons

    def run(self, obs: Observation, *, seed: int = 0, callback=None, progress=None) -> Reconstruction:
        model: TextModel = obs.model
        opts = self.options
        grads = dict(zip(obs.param_names, obs.gradients))
        T = int(obs.input_shape[0])
        lengths = (obs.extras.get("text") or {}).get("lengths")
        n_tokens = int(sum(lengths)) if lengths is not None else obs.batch_size * T
        bases, signal = [], []
        for layer in range(min(2, model.depth)):
            # each projection's gradient (q, k, v of a Hugging Face model) scaled to norm 1: their rows share one span,
            # and a raw concatenation lets the largest one's float32 floor bury the others' directions
            names = model.span_weights(layer)
            grad = grads[names[0]] if len(names) == 1 else torch.cat([_unit(grads[name]) for name in names])
            sv = torch.linalg.svdvals(grad.detach().to(torch.float64))
            tail = _beyond_rank(sv, n_tokens)
            signal.append(_signal_rank(sv, tail))
            if tail > NOISE_FLOOR:
                raise NothingRecovered(
                    f"block {layer + 1}'s attention gradient has rank above the {n_tokens} tokens behind it "
                    f"(σ_{n_tokens + 1}/σ_1 = {tail:.1e} > {NOISE_FLOOR:.0e}): noise fills its span (a defense), "
                    "DAGER's span check cannot tell the batch's tokens")
            basis = span_basis(grad, opts.rank_tol, n_tokens)
            if basis.shape[0] == 0:
                raise NothingRecovered(f"the gradient of block {layer + 1}'s attention is zero: no token to check")
            if basis.shape[0] >= model.width:
                raise NothingRecovered(
                    f"block {layer + 1}'s attention gradient has full rank {basis.shape[0]} = width {model.width}: "
                    "every token lies in its span, DAGER cannot tell the batch's tokens (a noise defense, or "
                    "B·T too large)")
            bases.append(basis)
        with torch.no_grad():
            candidates, first = _position_candidates(model, bases[0], T, opts.tol)
            if not any(candidates):
                raise NothingRecovered("no vocabulary token passed the first layer's span check")
            if not model.causal and obs.batch_size > 1:
                return encoder_batch(obs, model, bases, candidates, signal, lengths, opts, seed,
                                     signal_share=SIGNAL_SHARE)
            if model.causal and len(bases) > 1:
                seqs, scores = _greedy_decode(model, bases[1], candidates, first, opts.tol2,
                                              opts.beam * obs.batch_size)
            else:
                seqs, scores = _encoder_single(candidates, first)
            B = obs.batch_size
            order = _select(model, seqs, scores, B, causal=model.causal and len(bases) > 1)
        rows, exact = [], []
        causal = model.causal and len(bases) > 1
        limit = opts.tol2 if causal else opts.tol
        fits = _length_fits(lengths, [len(seqs[i]) for i in order])
        with torch.no_grad():
            clear = (_unambiguous(model, bases[1], [seqs[i] for i in order], candidates, opts.margin) if causal
                     else [True] * len(order))
        distinct = len({tuple(seqs[i][: t + 1]) for i in order for t in range(len(seqs[i]))})
        # block 2's check certifies a prefix only if its direction stands above the float32 floor of the gradient
        # and the recovered prefixes must explain the directions that stand above it (none of the batch left out)
        certified = not causal or (signal[1] >= SIGNAL_SHARE * distinct and distinct >= SIGNAL_SHARE * signal[1])
        for i, fit, sure in zip(order, fits, clear):
            rows.append(seqs[i])
            exact.append(scores[i] < limit and fit and sure and certified)
        found = len(rows)
        while len(rows) < B:  # fewer distinct sequences than slots: repeats, not known to be exact
            rows.append(rows[len(rows) % found])
            exact.append(False)
        pad = model.pad_id
        tokens = torch.full((B, T), pad, dtype=torch.int64)
        for b, s in enumerate(rows):
            tokens[b, : len(s)] = torch.tensor(s, dtype=torch.int64)
        return Reconstruction(
            images=tokens.to(obs.device), confidence=torch.tensor(exact, dtype=torch.float32, device=obs.device),
            trace={"modality": "text", "exact": exact, "distinct_found": found, "rank": [int(b.shape[0]) for b in bases],
                   "candidates": [len(c) for c in candidates], "max_distance": [float(scores[i]) for i in order],
                   "signal_rank": signal, "distinct_prefixes": distinct,
                   "certified": certified})


def _position_candidates(model: TextModel, basis: torch.Tensor, T: int, tol: float):
    """C_t (token ids passing layer 1's span check at position t) and their distances {(t, v): d}."""
    candidates: list[list[int]] = []
    dist: dict[tuple[int, int], float] = {}
    for t in range(T):
        z = model.vocab_inputs(t)
        d = span_distance(z, basis.to(z.device))
        ids = torch.nonzero(d < tol).flatten().tolist()
        candidates.append(ids)
        for v in ids:
            dist[(t, v)] = float(d[v])
    return candidates, dist


def _greedy_decode(model: TextModel, basis2: torch.Tensor, candidates, first, tol, beam: int):
    """Prefixes extended position by position through block 2's span check (Sec. 5.2); (sequences, max distance).

    Position 0 goes through block 2's check too: block 1's span accepts every E[u] + P[s] that a
    connected set of batch pairs (token, position) spans (learned positions are added, and LN₁ only
    centres and scales), so layer 1 narrows the vocabulary to the batch's tokens and layer 2 places them.
    """
    prefixes: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    device = model.tok.weight.device
    for t, options in enumerate(candidates):
        if not prefixes:
            break
        if not options:
            finished.extend(p for p in prefixes if p[0])
            prefixes = []
            break
        if len(prefixes) * len(options) > MAX_EXTENSIONS:
            raise NothingRecovered(f"{len(prefixes)} prefixes × {len(options)} candidates at position {t} pass "
                                   f"{MAX_EXTENSIONS:,}: the span checks do not narrow the search (lower tol)")
        heads = torch.tensor([p for p, _ in prefixes], dtype=torch.int64, device=device).reshape(len(prefixes), t)
        z = extension_inputs(model, heads, torch.tensor(options, dtype=torch.int64, device=device))
        d = span_distance(z, basis2.to(z.device))
        extended = []
        for i, (p, score) in enumerate(prefixes):
            passed = torch.nonzero(d[i] < tol).flatten().tolist()
            if not passed and p:
                finished.append((p, score))
            for j in passed:
                v = options[j]
                extended.append((p + [v], max(score, first[(t, v)], float(d[i, j]))))
        prefixes = sorted(extended, key=lambda e: e[1])[:beam]
    finished.extend(p for p in prefixes if p[0])
    return [s for s, _ in finished], [d for _, d in finished]


def extension_inputs(model: TextModel, prefixes: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
    """Block 2's attention input at position t for every prefix (P × t ids) followed by every option (O ids): P × O × d
    (the model's span view, :meth:`~leakbench.models.text_model.TextModel.extension_inputs`)."""
    return model.extension_inputs(prefixes, options)


def _select(model: TextModel, seqs: list[list[int]], scores: list[float], limit: int, *,
            causal: bool) -> list[int]:
    """At most ``limit`` of the recovered sequences: those that together explain the most of block 2's span.

    Greedy: each pick adds the sequence whose block-2 inputs (one per position) bring the most new
    directions, Σ ‖(I − QQᵀ) z‖²/‖z‖² over its positions (Q an orthonormal basis of what the picked ones
    span), ties to the smaller span distance.  A branch that left a true sequence for a token of
    another one (weak attention: a briefly trained model's block-2 input is mostly its own token's)
    adds almost nothing beyond the true sequences, whose every position is new.
    """
    if not causal or len(seqs) <= 1:
        return sorted(range(len(seqs)), key=lambda i: scores[i])[:limit]
    device = model.tok.weight.device
    vectors = [model.layer_inputs(1, torch.tensor([q], dtype=torch.int64, device=device))[0].to(torch.float64)
               for q in seqs]
    vectors = [v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300) for v in vectors]
    if model.position_free:  # a leading run of one token repeats one vector (rotary positions): one direction
        vectors = [_distinct_rows(v) for v in vectors]
    basis = torch.zeros(0, model.width, dtype=torch.float64, device=device)
    chosen: list[int] = []
    for _ in range(min(limit, len(seqs))):
        best, best_key = None, None
        for i, v in enumerate(vectors):
            if i in chosen:
                continue
            gain = float(((v - (v @ basis.T) @ basis) ** 2).sum())
            key = (round(gain, 3), -scores[i])
            if best_key is None or key > best_key:
                best, best_key = i, key
        chosen.append(best)
        _, sv, vh = torch.linalg.svd(torch.cat([basis, vectors[best]]), full_matrices=False)
        basis = vh[sv > 1e-3 * sv[0]]
    return chosen


def _distinct_rows(v: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """The unit rows of ``v`` (t × d) with each row that repeats an earlier one (within ``tol``) left out."""
    keep = [0]
    for i in range(1, v.shape[0]):
        if float((v[keep] - v[i]).norm(dim=-1).min()) > tol:
            keep.append(i)
    return v[keep]


def _unambiguous(model: TextModel, basis2: torch.Tensor, rows: list[list[int]], candidates, margin: float):
    """Per kept sequence: whether each of its tokens is ``margin`` times closer to block 2's span than any
    other candidate after the same prefix (the tokens that kept sequences sharing that prefix have there excepted)."""
    device = model.tok.weight.device
    out = []
    for s in rows:
        ok = True
        for t in range(len(s)):
            taken = {r[t] for r in rows if len(r) > t and r[:t] == s[:t]} - {s[t]}
            if model.position_free and t and len(set(s[:t])) == 1:  # a run of one token repeats its first vector
                taken.add(s[0])
            others = [v for v in candidates[t] if v != s[t] and v not in taken]
            if not others:
                continue
            prefix = torch.tensor([s[:t]], dtype=torch.int64, device=device).reshape(1, t)
            options = torch.tensor([s[t], *others], dtype=torch.int64, device=device)
            d = span_distance(extension_inputs(model, prefix, options), basis2.to(device))[0]
            if float(d[0]) > margin * float(d[1:].min()):
                ok = False
                break
        out.append(ok)
    return out


def _length_fits(lengths: list[int] | None, recovered: list[int]) -> list[bool]:
    """For each recovered sequence length, whether it is paired with a granted length it fits (n = L or L − 1).

    A granted length L counts the sequence's non-padding ids; its last one may be the end-of-sequence id,
    which has no target (padding follows) and so no gradient.  The pairing is one-to-one and pairs as many
    as possible (Hungarian).  A sequence cut short by two or more tokens fits no length and is not exact
    (one token short of a window that no end-of-sequence id ended is not caught).
    """
    from scipy.optimize import linear_sum_assignment  # lazy: `import leakbench` skips scipy
    if lengths is None:
        return [True] * len(recovered)
    fits = np.array([[float(n in (L, L - 1)) for L in lengths] for n in recovered])
    rows, cols = linear_sum_assignment(fits, maximize=True)
    out = [False] * len(recovered)
    for r, c in zip(rows, cols):
        out[int(r)] = bool(fits[r, c])
    return out


def _encoder_single(candidates, first):
    """B = 1: the sequence is its candidate at every position up to the first empty set."""
    seq, score = [], 0.0
    for t, ids in enumerate(candidates):
        if len(ids) != 1:
            break
        seq.append(ids[0])
        score = max(score, first[(t, ids[0])])
    if not seq:
        raise NothingRecovered("no position has exactly one candidate token")
    return [seq], [score]
