"""A malicious server's imprint block on a text transformer (Fowl et al., ICLR 2022, Sec. 3; ICLR 2023, Sec. 3).

Fowl, Geiping, Czaja, Goldblum & Goldstein, "Robbing the Fed: Directly Obtaining Private Data in
Federated Learning with Modified Models" (ICLR 2022), applied per token position, and its follow-up for
language models, Fowl, Geiping, Reich, Wen, Czaja, Goldblum & Goldstein, "Decepticons: Corrupted
Transformers Breach Privacy in Federated Learning for Language Models" (ICLR 2023), whose first attention
layer tags every position with a signature of its sentence.  The server ships
:func:`leakbench.models.malicious.imprint_text`.

**The imprint.**  The block z ↦ z + V·ReLU(W z + b), W's K rows one query q, b = −c at equal-mass quantiles of
⟨q, z⟩ over public text, V's columns equal.  Each token position p is one "sample" of the 2022 paper's Sec. 3
(g_p its upstream gradient), and for a position alone in bin k (c_k < ⟨q, z_p⟩ ≤ c_{k+1})

    z_p = (∇W_k − ∇W_{k+1}) / (∇b_k − ∇b_{k+1})        (∇W_K = ∇b_K = 0),                      (1)

exactly (the image attack's identity, :mod:`leakbench.attacks.gradient.robbing_the_fed`).  A bin of several
positions returns their g-weighted blend; positions without a loss gradient (padding, and an end-of-sequence
id whose target is padding) are invisible.

**Without a signature** (``signature=0``) the block sits on h⁰_p = E[v_p] + P[t_p] (``model.pre``), so z_p = h⁰_p
and the public table E[v] + P[t] names the position's token *and* position: a bin is lone when its vector lies
within ``tol`` (relative) of a table entry — blends lie on none.  This gives the batch's bag of (token,
position) pairs.  At B = 1 that is the sentence, flagged exact when no bin held a blend and the positions run
0, 1, …, n−1; at B > 1 the pairs at one position are not tied to their sentences, so rows are filled in bin
order and flagged not exact (``trace["pairs"]`` holds what is exact).

**With a signature** (``signature=r``, Decepticons) the server reserves r dimensions R (E[:, R] = P[:, R] = 0),
sets block 1's Q = K = 0 (uniform attention over the allowed keys), V = LN₁(·) and W_o = G into R, and places the
block on block 1's residual stream after its attention (``blocks[0].mid``), so with x_j = G·LN₁(E[v_j] + P[j])
(a public function of (v_j, j), zero outside R)

    z_t = h¹_t = h⁰_t + s_t,    s_t = (1/(t+1)) Σ_{j ≤ t} x_j   (``gpt:``, causal),
                               s_t = (1/n) Σ_{j < n} x_j        (``bert:``, n non-padding positions).   (2)

Our blocks are pre-LN, so the vector the imprint sees is h¹ itself, not LN₂(h¹): no normalisation to undo.  A
lone vector splits into its kept part h⁰ (nearest table entry on the dimensions outside R, as above → token v,
position t) and its signature s = z[R].  For a causal model (2) chains a position to the one before it:

    (t + 1)·s_t − t·s_{t−1} = x(v_t, t),        s_0 = x(v_0, 0),                                    (3)

so every lone node at t > 0 is linked to the lone node at t − 1 whose signature satisfies (3) (residual below
``link_tol``·‖x‖), and the sentences are the root-to-leaf paths of the resulting forest.  Two sentences sharing a
prefix share those positions' vectors exactly (same bin, one node, a branch point); a repeated sentence is one
path.  A position lost in a blend between lone nodes at t − 1 and t + 1 follows from (3) applied twice,

    x(v_t, t) = (t + 2)·s_{t+1} − t·s_{t−1} − x(v_{t+1}, t + 1)        (s_{−1} term absent at t = 0),     (4)

its token the unique v with x(v, t) within ``link_tol``, checked to land in a bin holding a blend (a "rebuilt"
position).  A blend bin whose vector lies in the affine hull of the rebuilt positions in it (to round-off) is
"explained": a further visible position in it would pull it off that hull.  For an encoder, (2) gives every
position of a sentence the same s: nodes are grouped by equal signature.

**Certificate** (a row is flagged exact only when its grouping is unambiguous):

- causal: every node on the path came from a lone bin (no rebuilt position); its root satisfies s_0 = x(v_0, 0)
  and each link is the *only* lone node at t − 1 satisfying (3); and its end e is certain — e = T − 1, or no token
  v appended to the path (its vector h⁰(v, e+1) + ((e+1)s_e + x(v, e+1))/(e+2), which the server can compute)
  would land in a bin holding an unexplained blend, where position e + 1 could hide; when the lengths are
  granted, e + 2 (the end-of-sequence id after it) or T must be one of them.
- encoder: the group holds positions 0, 1, …, n−1 once each, and its signature equals the mean of its own x's
  (a position lost in a blend would be missing from that mean), with n a granted length when lengths are known.

A sentence repeated in the batch, or one that is a prefix of another, is not a separate path: its row is filled
from what is left (orphan chains whose parent fell in a blend, longest first) and never flagged.  Which rows
are flagged and why is in ``trace`` (``sentences``, ``open_ends``, ``orphans``, ``repaired_positions``,
``explained_blends``, ``ambiguous_links``, ``max_link_residual``).  Measured in docs/text.md: 0 wrong among 206
flagged rows (B = 1–32, 1 024–16 384 bins).

A bin counts as lone only when its distance to the table is also within ``rounding`` times the float round-off of
(1) (a blend dominated by one position can lie closer than ``tol`` to that position's entry).  Positions whose
gradient through the block is ~0 are invisible to any imprint; such a position is neither seen nor ruled out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import ConfigError, NothingRecovered
from ...models.malicious import ImprintBlock
from ...models.transformers import TextTransformer
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..observed import bin_differences, shared_gradient

__all__ = ["TextImprint", "TextImprintOptions"]


@dataclass
class TextImprintOptions:
    """Options of ``text-imprint``."""

    #: a bin is occupied when |∇b_k − ∇b_{k+1}| > threshold · max_k |…|.
    threshold: float = 1e-7
    #: a bin's vector counts as one table entry E[v] + P[t] when within tol · ‖h⁰‖ of it (float32 round-off of
    #: the bin difference is ~1e-6 of it; distinct entries lie ~1 apart, relative).
    tol: float = 1e-3
    #: with a signature: a link (equation (3), a root, a group's mean) holds when its residual is below
    #: link_tol · ‖x‖ (float32 round-off of the recovered signatures, times t + 1 ≤ T, reaches ~1e-3 of it at
    #: B = 16; a wrong parent's residual is of the order of ‖x‖).
    link_tol: float = 1e-2

    #: a bin is lone only when its distance to the table is also within rounding × its float round-off estimate
    #: (a blend dominated by one position can lie closer than tol to that position's entry).
    rounding: float = 10.0

    def check(self) -> None:
        for name in ("threshold", "tol", "link_tol"):
            value = getattr(self, name)
            if not (isinstance(value, float) and 0 < value < 1):
                raise ConfigError(f"expected {name} in (0, 1), got {value!r} (option {name})")
        if not (isinstance(self.rounding, float) and 1 <= self.rounding <= 1e6):
            raise ConfigError(f"expected rounding in [1, 1e6], got {self.rounding!r} (option rounding)")


def _server_block(model) -> tuple[ImprintBlock | None, bool]:
    """(the imprint block, whether it carries a signature) of a text transformer, or (None, False)."""
    if not isinstance(model, TextTransformer):
        return None, False
    if isinstance(model.pre, ImprintBlock):
        return model.pre, False
    mid = getattr(model.blocks[0], "mid", None)
    if isinstance(mid, ImprintBlock) and getattr(mid, "reserved", None) is not None:
        return mid, True
    return None, False


def _signature_problems(model: TextTransformer, reserved: torch.Tensor) -> list[str]:
    """Why block 1 does not write equation (2)'s signature (empty when it does)."""
    d = model.width
    rest = torch.ones(d, dtype=torch.bool, device=reserved.device)
    rest[reserved] = False
    attn = model.blocks[0].attn
    out = []
    if bool(attn.qkv.weight[: 2 * d].any()) or bool(attn.qkv.bias[: 2 * d].any()):
        out.append("block 1's queries and keys are not zero, so its attention is not uniform")
    if bool(attn.proj.weight[rest].any()) or bool(attn.proj.bias.any()):
        out.append("block 1's attention writes outside the reserved dimensions")
    if bool(model.tok.weight[:, reserved].any()) or bool(model.pos.weight[:, reserved].any()):
        out.append("the embeddings are not zero on the reserved dimensions")
    if model.pre is not None or any(b.mid is not None for b in model.blocks[1:]):
        out.append("the model carries further server blocks")
    return out


@register
class TextImprint(Attack):
    """The server's imprint block: exact (token, position) pairs; with a signature attention, exact sentences at B > 1."""

    name = "text-imprint"
    tags = ("gradient", "update", "modified-model")
    modality = "text"
    Options = TextImprintOptions
    presets = {"quick": {}}
    #: revision 1: link_tol and the round-off test on lone bins (rounding) were added
    preset_revisions = {"default": 1, "quick": 1}

    def requirements(self, obs: Observation) -> list[str]:
        model = obs.model
        block, signed = _server_block(model)
        if block is None:
            return ["text-imprint needs the server's imprint block on a text transformer: ship "
                    "leakbench.models.malicious.imprint_text(model, bins=K) (signature=r for sentences at B > 1) "
                    "and observe that model"]
        if obs.kind == "weights":
            return ["text-imprint needs a shared gradient or update, not trained weights"]
        if shared_gradient(obs, block.linear0.weight) is None or shared_gradient(obs, block.linear0.bias) is None:
            return ["the imprint block's first layer is not among the shared parameters"]
        if signed:
            return [f"the signature needs block 1 as imprint_text(signature=r) ships it: {p}"
                    for p in _signature_problems(model, block.reserved)]
        return []

    def run(self, obs: Observation, *, seed: int = 0, callback=None, progress=None) -> Reconstruction:
        model: TextTransformer = obs.model
        block, signed = _server_block(model)
        opts = self.options
        grad_w = shared_gradient(obs, block.linear0.weight).detach().double()
        grad_b = shared_gradient(obs, block.linear0.bias).detach().double()
        diff_w, diff_b = bin_differences(grad_w, grad_b)
        size = diff_b.abs()
        top = float(size.max()) if size.numel() else 0.0
        if top == 0.0:
            raise NothingRecovered("text-imprint found no occupied bin: the imprint block's gradient is zero")
        occupied = (size > opts.threshold * top).nonzero().reshape(-1)
        vectors = diff_w[occupied] / diff_b[occupied, None]                    # n × d, eq. (1)
        T = int(obs.input_shape[0])
        d = model.width
        keep = torch.ones(d, dtype=torch.bool, device=vectors.device)
        if signed:
            keep[block.reserved.to(vectors.device)] = False
        # at most B·T positions are visible, so at most B·T bins hold one: beyond 4·B·T occupied bins the
        # observation is noise-dominated, and only the 4·B·T bins of largest |Δb| are searched (the rest: blends)
        search = torch.arange(len(occupied), device=vectors.device)
        cap = 4 * obs.batch_size * T
        if len(occupied) > cap:
            search = size[occupied].topk(cap).indices.sort().values
        token = torch.zeros(len(occupied), dtype=torch.int64, device=vectors.device)
        place = torch.zeros_like(token)
        rel = torch.full((len(occupied),), float("inf"), dtype=torch.float64, device=vectors.device)
        with torch.no_grad():
            token[search], place[search], rel[search] = _nearest_entry(model, vectors[search][:, keep], keep, T)
        # float round-off of eq. (1) for bin k, relative to ‖z‖: eps·(‖∇W_k‖ + ‖∇W_{k+1}‖) / (|Δb_k|·‖z‖).  A lone
        # bin's distance stays within a few of it (≤ 1.4 measured); a blend's lies 1e4 and more above it.
        eps = torch.finfo(shared_gradient(obs, block.linear0.weight).dtype).eps
        norms = grad_w.norm(dim=1)
        nxt = torch.cat([norms[1:], norms[:1] * 0])
        roundoff = eps * (norms + nxt)[occupied] / (diff_b[occupied].abs() * vectors.norm(dim=1)).clamp_min(1e-300)
        accept = torch.minimum(torch.full_like(roundoff, opts.tol), opts.rounding * roundoff)
        lone = rel < accept
        pairs = sorted((int(t), int(v)) for t, v, ok in zip(place, token, lone) if ok)
        B = obs.batch_size
        blends = int((~lone).sum())
        trace = {"modality": "text", "bins": block.bins, "bins_occupied": int(len(occupied)),
                 "lone_bins": int(lone.sum()), "blend_bins": blends, "pairs": pairs,
                 "max_lone_distance": float(rel[lone].max()) if bool(lone.any()) else None}
        if signed:
            with torch.no_grad():
                tokens, exact, more = _group(model, block, obs, vectors, keep, token, place, lone, occupied, T, B,
                                             opts.link_tol, accept)
            trace.update(more)
        else:
            tokens = torch.full((B, T), model.pad_id, dtype=torch.int64)
            fill = [0] * T
            for t, v in pairs:
                if fill[t] < B:
                    tokens[fill[t], t] = v
                    fill[t] += 1
            positions = [t for t, _ in pairs]
            run_ok = positions == list(range(len(positions))) and len(positions) > 0
            exact = [B == 1 and blends == 0 and run_ok] + [False] * (B - 1)
            trace["rows"] = "B = 1: the sequence; B > 1: (token, position) pairs in bin order, not tied to sequences"
        trace["exact"] = exact
        if progress is not None:
            progress(1, 1, 0.0)
        return Reconstruction(images=tokens.to(obs.device),
                              confidence=torch.tensor(exact, dtype=torch.float32, device=obs.device), trace=trace)


def _nearest_entry(model: TextTransformer, u: torch.Tensor, keep: torch.Tensor, T: int):
    """For each row of u (n × |keep|): the nearest table entry (E[v] + P[t]) on the kept dimensions, and the distance relative to ‖u‖."""
    emb = model.tok.weight.detach().double()[:, keep].to(u.device)
    pos = model.pos.weight.detach().double()[:T, keep].to(u.device)
    best = torch.full((len(u),), float("inf"), dtype=torch.float32, device=u.device)
    token = torch.zeros(len(u), dtype=torch.int64, device=u.device)
    place = torch.zeros_like(token)
    emb32, sq = emb.float(), emb.float().pow(2).sum(1)
    for t in range(T):  # T squared-distance matrices n × V in float32 (a search: entries lie ~1 apart, relative)
        w = (u - pos[t]).float()
        value, idx = (w.pow(2).sum(1, keepdim=True) - 2 * w @ emb32.T + sq).min(dim=1)
        better = value < best
        best, token = torch.where(better, value, best), torch.where(better, idx, token)
        place = torch.where(better, torch.full_like(place, t), place)
    dist = (u - pos[place] - emb[token]).norm(dim=1)  # the distance to the entry found, in float64
    return token, place, dist / u.norm(dim=1).clamp_min(1e-300)


def _x_table(model: TextTransformer, positions, reserved: torch.Tensor, device) -> torch.Tensor:
    """x(v, t) = W_o (W_v LN₁(E[v] + P[t]) + b_v) + b_o on the reserved dimensions, float64: len(positions) × V × r."""
    d = model.width
    blk = model.blocks[0]
    ln, attn = blk.ln1, blk.attn
    emb = model.tok.weight.detach().double().to(device)
    w_v, b_v = attn.qkv.weight[2 * d:].detach().double().to(device), attn.qkv.bias[2 * d:].detach().double().to(device)
    w_o, b_o = attn.proj.weight.detach().double().to(device), attn.proj.bias.detach().double().to(device)
    gamma = None if ln.weight is None else ln.weight.detach().double().to(device)
    beta = None if ln.bias is None else ln.bias.detach().double().to(device)
    out = []
    for t in positions:
        h = emb + model.pos.weight[int(t)].detach().double().to(device)
        z = F.layer_norm(h, (d,), gamma, beta, ln.eps)
        out.append(((z @ w_v.T + b_v) @ w_o.T + b_o)[:, reserved])
    return torch.stack(out)


def _group(model, block, obs, vectors, keep, token, place, lone, occupied, T, B, link_tol, accept):
    """Rows, exact flags and trace of the signature grouping (module docstring, equations (2)–(3))."""
    dev = vectors.device
    reserved = block.reserved.to(dev)
    X = _x_table(model, range(T), reserved, dev)                                # T × V × r
    nodes = lone.nonzero().reshape(-1)
    t_n, v_n = place[nodes], token[nodes]
    s_n = vectors[nodes][:, reserved]                                           # signatures
    x_n = X[t_n, v_n]                                                           # x(v, t) of each node
    xnorm = x_n.norm(dim=1).clamp_min(1e-300)
    lengths = (obs.extras.get("text") or {}).get("lengths")
    n = len(nodes)
    more: dict = {"signature_dims": int(len(reserved)), "lengths_granted": lengths is not None}
    if model.causal:
        rows, flags, info = _chains(model, block, X, t_n, v_n, s_n, x_n, xnorm, lone, occupied, keep, T, B, n,
                                    link_tol, lengths, (vectors, accept))
    else:
        rows, flags, info = _groups(t_n, v_n, s_n, X, T, B, n, link_tol, lengths)
    more.update(info)
    tokens = torch.full((B, T), model.pad_id, dtype=torch.int64)
    exact = [False] * B
    consistent = info["sentences"] <= B                                        # more sentences than rows: flag none
    for b, (row, ok) in enumerate(zip(rows[:B], flags[:B])):
        for t, v in row:
            tokens[b, t] = v
        exact[b] = bool(ok) and consistent
    more["rows"] = ("sentences grouped by their signature (flagged rows certified, module docstring); then orphan "
                    "chains; then padding")
    return tokens, exact, more


def _chains(model, block, X, t_n, v_n, s_n, x_n, xnorm, lone, occupied, keep, T, B, n, link_tol, lengths, seen):
    """Causal grouping: link nodes by equation (3), read root-to-leaf paths, certify their ends."""
    dev = s_n.device
    parent = torch.full((n,), -1, dtype=torch.int64)
    ambiguous = 0
    ambiguous_nodes: set[int] = set()
    worst = 0.0
    root_res = ((s_n - x_n).norm(dim=1) / xnorm).cpu()
    is_root = (t_n.cpu() == 0) & (root_res < link_tol)
    if bool(is_root.any()):
        worst = max(worst, float(root_res[is_root].max()))
    for t in range(1, T):
        kids = (t_n == t).nonzero().reshape(-1)
        dads = (t_n == t - 1).nonzero().reshape(-1)
        if not len(kids) or not len(dads):
            continue
        res = ((t + 1) * s_n[kids][:, None] - t * s_n[dads][None] - x_n[kids][:, None]).norm(dim=2) / xnorm[kids][:, None]
        ok = res < link_tol
        count = ok.sum(1)
        ambiguous += int((count > 1).sum())
        ambiguous_nodes.update(int(kids[i]) for i in (count > 1).nonzero().reshape(-1).tolist())
        for i in (count == 1).nonzero().reshape(-1).tolist():
            j = int(ok[i].nonzero()[0])
            parent[int(kids[i])] = int(dads[j])
            worst = max(worst, float(res[i, j]))
    # one position lost in a blend between two lone nodes: (3) twice gives its x, hence its token (the repair)
    repaired = _repair(model, block, X, t_n, v_n, s_n, x_n, parent, is_root, ambiguous_nodes, lone, occupied, keep,
                       link_tol)
    if repaired:
        t_n = torch.cat([t_n, torch.tensor([r[0] for r in repaired], device=dev)])
        v_n = torch.cat([v_n, torch.tensor([r[1] for r in repaired], device=dev)])
        parent = torch.cat([parent, torch.tensor([r[3] for r in repaired], dtype=torch.int64)])
        is_root = torch.cat([is_root, torch.tensor([r[0] == 0 for r in repaired])])
        for k, r in enumerate(repaired):
            for child in r[4]:
                parent[child] = n + k
        n = n + len(repaired)
    fixed = [False] * (n - len(repaired)) + [True] * len(repaired)
    t_list, v_list = t_n.tolist(), v_n.tolist()
    order = sorted(range(n), key=lambda i: t_list[i])
    rooted = [False] * n
    for i in order:
        rooted[i] = bool(is_root[i]) if t_list[i] == 0 else (parent[i] >= 0 and rooted[int(parent[i])])
    has_child = [False] * n
    for i in range(n):
        if parent[i] >= 0:
            has_child[int(parent[i])] = True

    def path(i):
        out = []
        while i >= 0:
            out.append((t_list[i], v_list[i]))
            i = int(parent[i]) if t_list[i] > 0 else -1
        return out[::-1]

    def mended(i):
        while i >= 0:
            if fixed[i]:
                return True
            i = int(parent[i]) if t_list[i] > 0 else -1
        return False

    leaves = [i for i in range(n) if rooted[i] and not has_child[i]]
    # ends: where could a continuation of each short path hide?  bins holding a blend
    blend = torch.zeros(block.bins, dtype=torch.bool, device=dev)
    blend[occupied[~lone].to(dev)] = True
    explained = _explained(model, block, repaired, occupied, keep, seen)
    blend[explained] = False                                                   # fully accounted for by repairs
    emb = model.tok.weight.detach().double().to(dev)
    vocab = torch.arange(model.vocab, device=dev) != model.pad_id
    reserved = block.reserved.to(dev)
    allowed = None if lengths is None else {int(m) for m in lengths}
    open_ends = 0
    rows, flags = [], []
    for i in sorted(leaves, key=lambda i: path(i)):
        e = t_list[i]
        certain = e == T - 1
        if not certain:
            h = torch.zeros(model.vocab, model.width, dtype=torch.float64, device=dev)
            h[:, keep] = (emb + model.pos.weight[e + 1].detach().double().to(dev))[:, keep]
            h[:, reserved] = ((e + 1) * s_n[i] + X[e + 1]) / (e + 2)
            certain = not bool(_bins_touch(block, h[vocab], blend).any())
        if allowed is not None and not ((e + 2) in allowed or (e == T - 1 and T in allowed)):
            certain = False
        open_ends += not certain
        rows.append(path(i))
        flags.append(certain and not mended(i))
    # what is left: orphan chains (a parent fell in a blend), longest first, never flagged
    orphans = [i for i in range(n) if not rooted[i] and not has_child[i]]

    def chain(i):
        out = []
        while i >= 0:
            out.append((t_list[i], v_list[i]))
            i = int(parent[i])
        return out[::-1]

    for i in sorted(orphans, key=lambda i: (-len(chain(i)), chain(i))):
        rows.append(chain(i))
        flags.append(False)
    info = {"sentences": len(leaves), "repaired_positions": len(repaired),
            "rebuilt": sorted((int(r[0]), int(r[1])) for r in repaired), "explained_blends": len(explained),
            "open_ends": open_ends, "orphans": len(orphans), "ambiguous_links": ambiguous,
            "max_link_residual": worst, "certified": int(sum(flags[: len(leaves)])) if len(leaves) <= B else 0}
    return rows, flags, info


def _bins_touch(block, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whether the bin of each vector of h (N × d, float64) — or a neighbour within float32 slack — is in ``mask``."""
    score = h @ block.query.double().to(h.device)
    edges = block.thresholds.double().to(h.device)
    cum = torch.cat([torch.zeros(1, dtype=torch.int64, device=h.device), mask.long().to(h.device).cumsum(0)])
    slack = 1e-5 * (score.abs() + 1.0)                                         # float32 forward vs float64 here
    lo = (torch.searchsorted(edges, score - slack) - 1).clamp_min(0)          # bin k: c_k < score ≤ c_{k+1}
    hi = (torch.searchsorted(edges, score + slack) - 1).clamp_min(0)
    return (cum[hi + 1] - cum[lo]) > 0


def _repair(model, block, X, t_n, v_n, s_n, x_n, parent, is_root, ambiguous_nodes, lone, occupied, keep, link_tol):
    """Positions lost in a blend between two lone nodes, rebuilt from equation (3) applied twice.

    An orphan o at t (no parent) whose grandparent g at t − 2 is lone: (t+1)s_t − (t−1)s_{t−2} − x(v_t, t) =
    x(v, t−1), and the unique v that fits (residual < link_tol), checked to land in a bin holding a blend, is the
    lost token; its signature is ((t−1)s_{t−2} + x(v, t−1))/t.  At t = 1 the root is x_0 = 2 s_1 − x(v_1, 1).
    Returns [(t−1, v, s, g or −1, [orphans])]; rows through a rebuilt position are never flagged exact.
    """
    dev = s_n.device
    blend = torch.zeros(block.bins, dtype=torch.bool, device=dev)
    blend[occupied[~lone].to(dev)] = True
    if not bool(blend.any()):
        return []
    emb, pos = model.tok.weight.detach().double().to(dev), model.pos.weight.detach().double().to(dev)
    reserved = block.reserved.to(dev)
    found: dict[tuple[int, int, int], list] = {}
    t_all = t_n.tolist()
    for o in range(len(t_all)):
        t = t_all[o]
        if t == 0 or int(parent[o]) >= 0 or o in ambiguous_nodes:
            continue
        if t == 1:
            grand = [-1]
            y = (2 * s_n[o] - x_n[o])[None]                                     # x_0
        else:
            grand = [g for g in range(len(t_all)) if t_all[g] == t - 2 and (t - 2 > 0 or bool(is_root[g]))]
            if not grand:
                continue
            y = (t + 1) * s_n[o] - (t - 1) * s_n[grand] - x_n[o]               # |G| × r
        table = X[t - 1]                                                       # V × r
        res = (y[:, None] - table[None]).norm(dim=2) / table.norm(dim=1).clamp_min(1e-300)[None]
        hits = (res < link_tol).nonzero()
        if len(hits) != 1:
            continue
        gi, v = int(hits[0, 0]), int(hits[0, 1])
        g = grand[gi]
        s_lost = table[v] if t == 1 else ((t - 1) * s_n[g] + table[v]) / t
        h = torch.zeros(model.width, dtype=torch.float64, device=dev)
        h[keep] = (emb[v] + pos[t - 1])[keep]
        h[reserved] = s_lost
        if not bool(_bins_touch(block, h[None], blend)[0]):
            continue                                                           # it would have been seen: no repair
        found.setdefault((t - 1, v, g), [t - 1, v, s_lost, g, []])[4].append(o)
    return [tuple(r) for r in found.values()]


def _explained(model, block, repaired, occupied, keep, seen) -> list[int]:
    """Blend bins whose vector lies in the affine hull of the rebuilt positions that fall in them (to round-off).

    A further position hidden in such a bin would pull its vector off that hull (its weight g_p / Σg is not zero
    for a visible position), so the bin hides nothing else: a continuation landing there does not open an end.
    """
    vectors, accept = seen
    if not repaired:
        return []
    dev = vectors.device
    reserved = block.reserved.to(dev)
    emb, pos = model.tok.weight.detach().double().to(dev), model.pos.weight.detach().double().to(dev)
    h = torch.zeros(len(repaired), model.width, dtype=torch.float64, device=dev)
    for k, (t, v, s_lost, _, _) in enumerate(repaired):
        h[k, keep] = (emb[v] + pos[t])[keep]
        h[k, reserved] = s_lost
    score = h @ block.query.double().to(dev)
    where = torch.searchsorted(block.thresholds.double().to(dev), score) - 1   # each rebuilt position's bin
    index = {int(b): i for i, b in enumerate(occupied.tolist())}
    out = []
    for b in sorted(set(where.tolist())):
        members = h[where == b]
        if b not in index or len(members) < 2:
            continue
        z = vectors[index[b]]
        basis = (members[1:] - members[0]).T                                    # d × (m − 1)
        coef = torch.linalg.lstsq(basis, (z - members[0])[:, None]).solution
        rel = float((basis @ coef - (z - members[0])[:, None]).norm() / z.norm().clamp_min(1e-300))
        if rel < float(accept[index[b]]):
            out.append(b)
    return out


def _groups(t_n, v_n, s_n, X, T, B, n, link_tol, lengths):
    """Encoder grouping: nodes with equal signature form a sentence; certified by its own mean (module docstring)."""
    label = list(range(n))
    snorm = s_n.norm(dim=1).clamp_min(1e-300)
    same = ((s_n[:, None] - s_n[None]).norm(dim=2) / snorm[:, None]) < link_tol
    for i in range(n):  # union of equal signatures (equality is transitive up to the tolerance)
        for j in same[i].nonzero().reshape(-1).tolist():
            a, b = label[i], label[j]
            while label[a] != a:
                a = label[a]
            while label[b] != b:
                b = label[b]
            if a != b:
                label[max(a, b)] = min(a, b)
    root = []
    for i in range(n):
        a = i
        while label[a] != a:
            a = label[a]
        root.append(a)
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(root):
        groups.setdefault(r, []).append(i)
    t_list, v_list = t_n.tolist(), v_n.tolist()
    allowed = None if lengths is None else {int(m) for m in lengths}
    rows, flags, worst = [], [], 0.0
    for members in sorted(groups.values(), key=lambda m: sorted((t_list[i], v_list[i]) for i in m)):
        row = sorted((t_list[i], v_list[i]) for i in members)
        m = len(row)
        ok = [t for t, _ in row] == list(range(m))
        if ok:
            mean = X[torch.tensor([t for t, _ in row]), torch.tensor([v for _, v in row])].mean(0)
            s = s_n[members].mean(0)
            res = float((mean - s).norm() / s.norm().clamp_min(1e-300))
            worst = max(worst, res)
            ok = res < link_tol and (allowed is None or m in allowed)
        rows.append(row)
        flags.append(ok)
    rows_flags = sorted(zip(rows, flags), key=lambda rf: not rf[1])
    rows, flags = [r for r, _ in rows_flags], [f for _, f in rows_flags]
    info = {"sentences": len(groups), "ambiguous_links": 0, "orphans": 0, "open_ends": 0,
            "max_link_residual": worst, "certified": int(sum(flags)) if len(groups) <= B else 0}
    return rows, flags, info
