"""DAGER's search for encoder batches (B > 1): whole sequences scored by block 2's span check.

Petrov et al., NeurIPS 2024 (arXiv:2405.15586), Sec. 5.3.  With bidirectional attention, block 2's
input at position t depends on every token of the sequence, so the decoders' prefix-by-prefix
extension (Sec. 5.2) has nothing to hold on to: a candidate is a *whole* sequence.  The paper:

1. block 1's span check gives the candidate sets C_t (:func:`leakbench.attacks.text.dager._position_candidates`);
2. the sequence lengths come from the end-of-sequence token among the C_t (our tokenizer appends
   ``[EOS]`` to every sentence that fits; a sequence cut at T has none and fills all T positions),
   or, where the threat model grants them (``extras["text"]["lengths"]``), from the grant;
3. for every length l, the sequences of C_0 × … × C_{l-2} × {EOS} are scored by block 2's span check
   — every position's LN₁ input to block 2 (``model.layer_inputs(1, ·)``) must lie in the span of
   block 2's ∇W_qkv — exhaustively when there are at most ``max_combinations`` of them.

**Ours, beyond the paper**, where the product is larger: a coordinate search from seeded random
starts.  For each position in turn, every candidate of C_t is tried with the other tokens fixed
(one batched forward over all starts and candidates), the one with the least Σ_t d_t² (d_t the
relative span distance of position t) is kept, and sweeps repeat until no token changes.  Why:
bidirectional attention leaves no prefix to extend, and ∏|C_t| is up to |C|^l (at B = 16, T = 16
and random init, block 1's span accepts about 150 tokens at every position: LN with β = 0 keeps
E[w] + P[s'] in the span whenever (w, s), (u, s), (u, s') are batch pairs).  To keep the sweeps
cheap, each candidate is first screened by its *own* position's distance with the rest of the
sequence fixed (attention against the other positions' block-1 keys and values, computed once),
and only the ``screen`` closest are scored on the whole sequence.  Later rounds start from the
tokens no sequence found so far explains.

A sequence is **flagged exact** only when (i) every position's block-2 distance is below ``tol2``;
(ii) it is *isolated*: every single-token change of it (a candidate of C_t at one position t) is
at least 1/``margin`` times farther from block 2's span, except changes that give another kept
sequence (two true sentences one token apart); a screened-out change counts with its own
position's distance, a lower bound of its score, so the test errs towards "not exact"; (iii) its
length is granted (when lengths are granted) and no more sequences of that length passed than
were granted; (iv) block 2's directions above its float32 floor and the positions of the distinct
sequences found (each has its own direction) agree in number to within ``SIGNAL_SHARE``.
"""
from __future__ import annotations

import math
import time
from collections import Counter

import torch

from ...errors import NothingRecovered
from ...models.transformers import TextTransformer
from ..base import Reconstruction
from .span_check import span_distance

__all__ = ["encoder_batch", "encoder_search", "block2_distances"]

#: most activations (floats of block 1's MLP, 4·width per token) in one forward: a bound on memory (64 MiB).
CHUNK_FLOATS = 1 << 24


def block2_distances(model, basis2: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
    """Relative span distance of every position's block-2 input for N whole sequences (N × l ids): N × l."""
    out = []
    step = max(1, CHUNK_FLOATS // (4 * model.width * max(1, seqs.shape[1])))
    for i in range(0, seqs.shape[0], step):
        out.append(span_distance(model.layer_inputs(1, seqs[i: i + step]), basis2))
    return torch.cat(out) if out else torch.zeros(0, seqs.shape[1], dtype=torch.float64, device=seqs.device)


def _own_distances(model, basis2, cur: torch.Tensor, t: int, cands: torch.Tensor) -> torch.Tensor:
    """Block-2 distance at position t of every start (S × l) with its token t replaced by each candidate: S × k.

    For leakbench's transformer, block 1's keys and values of the other positions do not depend on
    token t, so they are computed once; only position t's query, key, value and its residual branch
    are recomputed per candidate.  Other models (the span view of Hugging Face models) run the S·k
    changed sequences through :meth:`layer_inputs`.
    """
    if not (isinstance(model, TextTransformer) and not model.modified):
        S, l = cur.shape
        trial = cur.unsqueeze(1).repeat(1, cands.shape[0], 1)
        trial[:, :, t] = cands
        return block2_distances(model, basis2, trial.reshape(-1, l))[:, t].reshape(S, -1)
    block, attn = model.blocks[0], model.blocks[0].attn
    d, heads = model.width, attn.heads
    dh = d // heads
    S, l = cur.shape
    k = cands.shape[0]
    _, kk, vv = attn.qkv(block.ln1(model.tok(cur) + model.pos.weight[:l])).split(d, dim=-1)
    kk, vv = kk.reshape(S, l, heads, dh), vv.reshape(S, l, heads, dh)
    h_new = model.tok(cands) + model.pos.weight[t]  # k × d
    q, kc, vc = (z.reshape(k, heads, dh) for z in attn.qkv(block.ln1(h_new)).split(d, dim=-1))
    scores = torch.einsum("khd,sjhd->skhj", q, kk) / math.sqrt(dh)  # S × k × H × l
    own = (q * kc).sum(-1) / math.sqrt(dh)  # k × H
    scores[..., t] = own.unsqueeze(0).expand(S, -1, -1)
    w = torch.softmax(scores, dim=-1)
    wt = w[..., t].unsqueeze(-1)  # S × k × H × 1
    w = w.clone()
    w[..., t] = 0
    out = torch.einsum("skhj,sjhd->skhd", w, vv) + wt * vc.unsqueeze(0)
    h = h_new + attn.proj(out.reshape(S, k, d))
    h = h + block.mlp(block.ln2(h))
    return span_distance(model.blocks[1].ln1(h), basis2)


def _coordinate_search(model, basis2, starts: torch.Tensor, options: list[torch.Tensor], opts, deadline: float):
    """Sweeps of single-position moves from every start (rows of ``starts``); the converged sequences, each with
    its per-position distances, whether it converged, and for every position the lower bound of each
    single-token change's worst distance (S × l × k_max, +inf where no candidate)."""
    cur = torch.unique(starts, dim=0)
    S, l = cur.shape
    kmax = max(len(o) for o in options)
    changed_last = torch.ones(S, dtype=torch.bool, device=cur.device)
    neighbours = torch.full((S, l, kmax), math.inf, dtype=torch.float64, device=cur.device)
    dist = block2_distances(model, basis2, cur)
    for _ in range(opts.sweeps):
        changed = torch.zeros(S, dtype=torch.bool, device=cur.device)
        for t in range(l):
            if time.monotonic() > deadline:
                return cur, dist, torch.zeros(S, dtype=torch.bool, device=cur.device), neighbours
            cands = options[t]
            k = cands.shape[0]
            if k == 1:
                neighbours[:, t] = math.inf
                continue
            step = max(1, CHUNK_FLOATS // (4 * model.width * k))  # S × k: lower bounds of each change's max
            own = torch.cat([_own_distances(model, basis2, cur[i: i + step], t, cands) for i in range(0, S, step)])
            screen = min(opts.screen, k)
            pick = own.topk(screen, dim=1, largest=False).indices  # S × screen
            trial = cur.unsqueeze(1).repeat(1, screen, 1)
            trial[:, :, t] = cands[pick]
            full = block2_distances(model, basis2, trial.reshape(-1, l)).reshape(S, screen, l)
            objective = (full ** 2).sum(-1)
            bound = own.clone()
            bound.scatter_(1, pick, full.amax(-1))
            neighbours[:, t, :k] = bound
            neighbours[:, t, k:] = math.inf
            current = trial[:, :, t] == cur[:, t: t + 1]
            base = (dist ** 2).sum(-1)
            objective = torch.where(current, base.unsqueeze(1), objective)
            best = objective.argmin(1)
            # a sequence already within tol2 everywhere stays: it is checked, not traded for a neighbour that also
            # passes (two true sentences one token apart)
            better = (objective.gather(1, best[:, None])[:, 0] < base) & (dist.amax(-1) >= opts.tol2)
            rows = torch.nonzero(better).flatten()
            if rows.numel():
                cur[rows, t] = trial[rows, best[rows], t]
                dist[rows] = full[rows, best[rows]]
                changed[rows] = True
        changed_last = changed
        if not bool(changed.any()):
            break
    # the record of each position's changes is valid for a sequence that did not move in the last sweep
    return cur, dist, ~changed_last, neighbours


def _options(candidates, l: int, T: int, eos: int | None, device) -> list[torch.Tensor] | None:
    """The token options of every position of a length-l sequence (None when a position has none)."""
    out = []
    for t in range(l):
        if t == l - 1 and l < T and eos is not None and eos in candidates[t]:
            ids = [eos]  # a sequence shorter than T ends with the end-of-sequence token
        else:
            ids = [v for v in candidates[t] if v != eos or t == l - 1]
        if not ids:
            return None
        out.append(torch.tensor(ids, dtype=torch.int64, device=device))
    return out


def _lengths(candidates, T: int, eos: int | None, granted) -> dict[int, int | None]:
    """{length: how many sequences have it (None: not known)}: granted, else read from where [EOS] passes."""
    if granted is not None:
        return dict(Counter(int(n) for n in granted if int(n) > 0))
    if eos is None:  # no end-of-sequence token to read: every length whose positions all have candidates
        return dict.fromkeys(l for l in range(1, T + 1) if all(candidates[:l]))
    ends = {t + 1 for t, c in enumerate(candidates) if eos in c}
    if any(v != eos for v in candidates[T - 1]):
        ends.add(T)
    return dict.fromkeys(sorted(ends))


def encoder_search(model, basis2: torch.Tensor, candidates: list[list[int]], *, batch: int, T: int, granted,
                   eos: int | None, opts, seed: int, signal2: int, signal_share: float):
    """Sequences, their worst block-2 distance and exact flags (module docstring), at most ``batch``; and a trace."""
    device = model.tok.weight.device
    basis2 = basis2.to(device=device, dtype=torch.float64)
    gen = torch.Generator().manual_seed(int(seed))
    deadline = time.monotonic() + opts.seconds
    plan = _lengths(candidates, T, eos, granted)
    if not plan:
        raise NothingRecovered("no sequence length could be read: [EOS] passed block 1's check nowhere and the "
                               "last position has no candidate")
    found: dict[tuple, dict] = {}  # sequence → {"dist", "isolated", "threats"}
    trace = {"lengths": {}, "combinations": {}, "rounds": {}, "timed_out": False}
    # the lengths most sequences share first: their sequences explain the most tokens for the later starts
    for l, count in sorted(plan.items(), key=lambda e: (-(e[1] or 0), -e[0])):
        if sum(len(k) for k, e in found.items() if e["dist"] < opts.tol2) >= signal2:
            trace["lengths"][l] = "not searched: the sequences found explain block 2's directions"
            continue
        options = _options(candidates, l, T, eos, device)
        if options is None:
            trace["lengths"][l] = "a position without candidates"
            continue
        want = count if count is not None else batch
        sizes = [len(o) for o in options]
        total = math.prod(sizes)
        trace["combinations"][l] = float(total)
        if total <= opts.max_combinations:  # the paper's exhaustive search: every combination, scored
            grid = torch.cartesian_prod(*options) if l > 1 else options[0][:, None]
            grid = grid.reshape(-1, l)
            worst = block2_distances(model, basis2, grid).amax(-1)
            keep = torch.argsort(worst)[: max(2 * want, int((worst < opts.tol2).sum()))]
            starts_list = [grid[keep]]
            rounds = 1
        else:
            starts_list, rounds = [], opts.rounds
        local: set[tuple] = set()
        for r in range(rounds):
            if time.monotonic() > deadline:
                trace["timed_out"] = True
                break
            pending = [k for e in found.values() if e["dist"] < opts.tol2 for k in e["near"]
                       if len(k) == l and k not in found]
            if starts_list:
                starts = starts_list.pop()
            elif pending:  # single-token changes of found sequences that came as close to the span: check them
                starts = torch.tensor(sorted(set(pending)), dtype=torch.int64, device=device)
            else:
                known = [k for k, e in found.items() if e["dist"] < opts.tol2]
                starts = _random_starts(options, opts.restarts * want, known, gen, device)
            seqs, dist, converged, neighbours = _coordinate_search(model, basis2, starts, options, opts, deadline)
            new = 0
            worst = dist.amax(-1)
            for i in range(seqs.shape[0]):
                key = tuple(seqs[i].tolist())
                if float(worst[i]) >= opts.tol2:  # kept only as a best guess, never over a passing one
                    found.setdefault(key, {"dist": float(worst[i]), "isolated": False, "threats": [], "near": []})
                    continue
                threat = torch.nonzero(neighbours[i] < float(worst[i]) / opts.margin)
                threats = [key[:t] + (int(options[t][j]),) + key[t + 1:] for t, j in threat.tolist()]
                near = [th for th, (t, j) in zip(threats, threat.tolist()) if float(neighbours[i, t, j]) < opts.tol2]
                entry = {"dist": float(worst[i]), "isolated": bool(converged[i]), "threats": threats, "near": near}
                old = found.get(key)
                if old is None or old["dist"] >= opts.tol2 or (entry["isolated"] and not old["isolated"]):
                    found[key] = entry
                new += key not in local
                local.add(key)
            trace["rounds"][l] = r + 1
            explained = sum(len(k) for k, e in found.items() if e["dist"] < opts.tol2)
            if count is not None and len(local) >= count:
                break
            if new == 0 and explained >= signal_share * signal2:
                break  # nothing new, and the found sequences explain block 2's directions
        trace["lengths"][l] = len(local)
    return _choose(found, batch, granted, opts, signal2, signal_share, trace)


def _random_starts(options, n: int, known: list[tuple], gen, device) -> torch.Tensor:
    """``n`` seeded starts; at each position half of them draw from the tokens no known sequence has there."""
    cols = []
    for t, o in enumerate(options):
        ids = o.cpu()
        draw = ids[torch.randint(len(ids), (n,), generator=gen)]
        used = {s[t] for s in known if len(s) > t}
        fresh = torch.tensor([v for v in ids.tolist() if v not in used], dtype=torch.int64)
        if known and fresh.numel():
            half = torch.rand(n, generator=gen) < 0.5
            draw = torch.where(half, fresh[torch.randint(len(fresh), (n,), generator=gen)], draw)
        cols.append(draw)
    return torch.stack(cols, dim=1).to(device)


def _choose(found: dict, batch: int, granted, opts, signal2: int, signal_share: float, trace: dict):
    """The passing sequences (at most ``batch``, best first) with their exact flags; the best failing ones when none pass."""
    passing = sorted((k for k, e in found.items() if e["dist"] < opts.tol2), key=lambda k: found[k]["dist"])
    if not passing:
        if not found:
            raise NothingRecovered("the encoder search found no sequence")
        best = sorted(found, key=lambda k: found[k]["dist"])[:batch]
        trace.update(passed=0, certified=False, explained=0)
        return [list(k) for k in best], [found[k]["dist"] for k in best], [False] * len(best), trace
    over = len(passing) > batch
    chosen = passing[:batch]
    kept = set(chosen)
    per_length = Counter(len(k) for k in chosen)
    allowed = Counter(int(n) for n in granted) if granted is not None else None
    explained = sum(len(k) for k in chosen)
    certified = signal2 >= signal_share * explained and explained >= signal_share * signal2
    flags = []
    for k in chosen:
        e = found[k]
        fits = allowed is None or (allowed.get(len(k), 0) >= per_length[len(k)])
        clear = e["isolated"] and all(th in kept for th in e["threats"])
        flags.append(bool(fits and clear and certified and not over))
    trace.update(passed=len(passing), certified=certified, explained=explained)
    return [list(k) for k in chosen], [found[k]["dist"] for k in chosen], flags, trace


def encoder_batch(obs, model, bases, candidates, signal, lengths, opts, seed: int, *, signal_share: float):
    """DAGER's reconstruction of an encoder batch (B > 1): the search's sequences in B rows, copies flagged not exact."""
    B, T = obs.batch_size, int(obs.input_shape[0])
    rows, scores, exact, trace = encoder_search(
        model, bases[1], candidates, batch=B, T=T, granted=lengths, eos=opts.eos_id, opts=opts, seed=seed, signal2=signal[1],
        signal_share=signal_share)
    found = len(rows)
    while len(rows) < B:  # fewer distinct sequences than slots: repeats, not known to be exact
        rows.append(rows[len(rows) % found])
        exact.append(False)
    tokens = torch.full((B, T), model.pad_id, dtype=torch.int64)
    for b, s in enumerate(rows):
        tokens[b, : len(s)] = torch.tensor(s, dtype=torch.int64)
    trace.update({"modality": "text", "exact": exact, "distinct_found": found,
                  "rank": [int(b.shape[0]) for b in bases], "candidates": [len(c) for c in candidates],
                  "max_distance": scores, "signal_rank": signal})
    return Reconstruction(images=tokens.to(obs.device),
                          confidence=torch.tensor(exact, dtype=torch.float32, device=obs.device), trace=trace)
