"""Deterministic batch reconstruction through neuron exclusivity (Pan, Zhang, Yan, Zhu & Yang, USENIX Security 2022).

ReLU MLP h_{k+1} = ReLU(W_k h_k + b_k), logits W_H h_H + b_H, cross-entropy, mean over a
batch of M.  With δ^m_k = ∂ℓ_m/∂z_k / M the shared gradients are ∇W_k = Σ_m δ^m_{k+1} h^m_kᵀ
and ∇b_k = Σ_m δ^m_{k+1}.  A neuron j of layer k is *exclusively activated* (an ExAN) by
sample m when it fires for m alone; then row j of ∇W_{k−1} is δ^m_{k,j} h^m_{k−1}ᵀ.

1. Loss vectors and labels (initial step of the proof of Proposition 2): column j of the
   output layer's ∇W_H is Σ_m g^m h^m_{H,j} / M with g^m = softmax − e_y.  The columns of
   a sample's ExANs are all parallel to g^m; a column mixing several samples is, almost
   surely, parallel to no other column.  Groups of ≥ 2 parallel columns therefore are
   the samples (Pan et al. need "at least two exclusive elements in D_H^m"); the label
   is the only negative entry of g^m.  The row of an ExAN j in ∇W_{H−1} divided by
   ∇b_{H−1}[j] (= δ^m_{H,j}) is h^m_{H−1}; rows of members that do not agree on it
   are dropped (a column nearly, but not exactly, exclusive).
2. Recurrent step (Proposition 2, eq. 2): once h^m_k is known its non-zero positions
   are the activation pattern D^m_k, δ^m_k = D^m_k W_kᵀ δ^m_{k+1} follows by
   back-propagation, neurons active for one sample only are that sample's ExANs, and
   h^m_{k−1} = ∇W_{k−1}[j] / δ^m_{k,j} (least squares over all its ExANs; METHODS:
   the largest |δ| dominates).
3. Samples without an ExAN at layer k (all others known): the remaining gradient
   Σ_{m∈U} δ^m_k h^m_{k−1}ᵀ plus the forward equations of their active neurons,
   W_{k−1}[D^m_k] h^m_{k−1} = h^m_k[D^m_k] − b_{k−1}[D^m_k], are solved jointly by least
   squares.  A sample is determined uniquely iff the null space of this system does
   not move it — at the input layer this is exactly the non-uniqueness of Theorem 2
   (perturbations Δ with W_0Δ_m = 0 on the active rows and Σ_m α_m Δ_mᵀ = 0).

Per sample ``trace["unique"]`` says whether it was determined uniquely (then the
reconstruction equals the input up to round-off), ``confidence`` is 1.0 for those and
0.0 otherwise — 0/1 flags, so :func:`leakbench.metrics.compare` matches these slots to
their originals first; ``trace["exans"]`` counts the ExANs found per sample and layer.
Samples not identified at the output layer are returned as the data-range centre (flagged not unique);
when no sample is identified at all the attack raises :class:`~leakbench.errors.NothingRecovered`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigError, NothingRecovered
from ...models.matrices import layer_chain
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..labels import label_counts
from ..solvers.linalg import lstsq
from ..solvers.analytic import analytic_reasons, chain_or_reason
from ..observed import layer_gradients, param_index

__all__ = ["Exclusivity", "ExclusivityOptions", "parallel_groups", "joint_solve"]


@dataclass
class ExclusivityOptions:
    """Tolerances of the exclusivity attack (float64 arithmetic throughout)."""

    #: two output-layer gradient columns are parallel when 1 − cos < parallel_tol.
    parallel_tol: float = 1e-9
    #: ExAN rows of one sample agree when their h differ by less than this (relative).
    agree_tol: float = 1e-5
    #: activations below active_tol·max|h| count as inactive (least-squares solutions).
    active_tol: float = 1e-7
    #: singular values below rcond·σ_max count as zero in the joint systems.
    rcond: float = 1e-9
    #: a sample keeps its "unique" flag only if, forwarded from its reconstruction, it predicts the output-layer
    #: gradient columns of its ExANs to this relative error (exact samples: round-off, ≤ 1e-5 in float32; a
    #: two-sample mixture: ~0.5).
    verify_tol: float = 1e-3

    def check(self) -> None:
        for name in ("parallel_tol", "agree_tol", "active_tol", "rcond", "verify_tol"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ConfigError(f"expected 0 < {name} < 1, got {value} (option {name})")


def parallel_groups(columns: torch.Tensor, tol: float) -> list[list[int]]:
    """Groups (≥ 2 members) of mutually parallel, same-direction non-zero columns of a K×d matrix."""
    norms = columns.norm(dim=0)
    nz = (norms > 0).nonzero().flatten()
    if nz.numel() < 2:
        return []
    unit = columns[:, nz] / norms[nz]
    close = (1 - unit.T @ unit) < tol
    seen = torch.zeros(nz.numel(), dtype=torch.bool)
    groups = []
    for i in range(nz.numel()):
        if seen[i]:
            continue
        members = close[i].nonzero().flatten()
        seen[members] = True
        if members.numel() >= 2:
            groups.append(nz[members].tolist())
    return groups


def _rows_solution(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """h minimising Σ_j ‖rows_j − scales_j h‖² (rows_j = scales_j·h for exclusive neurons)."""
    return scales @ rows / scales.dot(scales)


def joint_solve(deltas: torch.Tensor, residual: torch.Tensor, forward: list[tuple[torch.Tensor, torch.Tensor]],
                rcond: float) -> tuple[torch.Tensor, list[bool], int]:
    """Solve Σ_u δ_u h_uᵀ = R and F_u h_u = f_u for the h_u; say which h_u are unique.

    ``deltas`` is d_out × U, ``residual`` d_out × d_in, ``forward`` the (F_u, f_u) pairs.
    Returns the minimum-norm solution (U × d_in), per-sample uniqueness and the dimension of
    the solution set's null space.
    """
    n_u, d_in = deltas.shape[1], residual.shape[1]
    u_, s, vh = torch.linalg.svd(deltas, full_matrices=True)
    rank = int((s > rcond * s.max()).sum()) if s.numel() and float(s.max()) > 0 else 0
    pinv = vh[:rank].T @ ((u_[:, :rank].T @ residual) / s[:rank, None])  # U × d_in
    null = vh[rank:].T  # U × r: coefficient patterns left free by the gradient equations
    r = null.shape[1]
    if r == 0:
        return pinv, [True] * n_u, 0
    blocks, rhs = [], []
    for u, (f_mat, f_vec) in enumerate(forward):
        if f_mat.shape[0] == 0:
            continue
        blocks.append(torch.cat([null[u, t] * f_mat for t in range(r)], dim=1))
        rhs.append(f_vec - f_mat @ pinv[u])
    if not blocks:
        free_dim = r * d_in
        unique = [bool(null[u].abs().max() <= rcond) for u in range(n_u)]
        return pinv, unique, free_dim
    g = torch.cat(blocks)
    _, sg, vg = torch.linalg.svd(g, full_matrices=False)
    grank = int((sg > rcond * sg.max()).sum()) if float(sg.max()) > 0 else 0
    coef = vg[:grank].T @ ((vg[:grank] @ (g.T @ torch.cat(rhs))) / sg[:grank] ** 2)  # min-norm LS
    c = coef.reshape(r, d_in)
    solution = pinv + null @ c
    basis = vg[:grank].reshape(grank, r, d_in)  # row space of g, split per free pattern
    unique = []
    for u in range(n_u):
        weight = null[u]  # perturbation of h_u is Σ_t weight_t c_t
        total = float(weight.pow(2).sum()) * d_in
        if total <= rcond ** 2:
            unique.append(True)
            continue
        captured = float(torch.einsum("t,gtd->gd", weight, basis).pow(2).sum())
        unique.append(total - captured <= 1e-6 * total)
    return solution, unique, r * d_in - grank


@register
class Exclusivity(Attack):
    """Pan et al.'s neuron-exclusivity attack on ReLU MLP batches: exact for samples with exclusive neurons."""

    name = "exclusivity"
    tags = ("gradient", "update", "labels")
    Options = ExclusivityOptions
    presets = {"quick": {}}

    def requirements(self, obs: Observation) -> list[str]:
        reasons = analytic_reasons(obs, attack=self.name, batch_one=False)
        if obs.loss != "ce":
            reasons.append(f"exclusivity reads labels from cross-entropy loss vectors; got loss {obs.loss!r}")
        chain, why = chain_or_reason(obs)
        if chain is None:
            return reasons + [why]
        blocks = chain.blocks
        if any(b.kind != "linear" for b in blocks) or len(blocks) < 2:
            reasons.append("exclusivity needs a ReLU MLP (fully connected layers with at least one hidden layer)")
            return reasons
        if any(b.act != "relu" for b in blocks[:-1]) or blocks[-1].act != "identity":
            reasons.append("exclusivity needs a ReLU MLP: ReLU after every hidden layer, logits out")
        index = param_index(obs)
        if any(id(b.layer.weight) not in index for b in blocks):
            reasons.append("exclusivity needs the weight gradients of every layer")
        feed = blocks[-2].layer
        if feed.bias is None or id(feed.bias) not in index:
            reasons.append(f"exclusivity needs the bias gradient of the last hidden layer ({blocks[-2].name!r}) "
                           "to scale the first recovered features")
        return reasons

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        o = self.options
        chain = layer_chain(obs.model, obs.input_shape)
        blocks = chain.blocks
        H = len(blocks) - 1  # hidden layers
        index = param_index(obs)
        grads = obs.gradients
        M = obs.batch_size
        W = [b.layer.weight.detach().double() for b in blocks]
        bias = [b.layer.bias.detach().double() if b.layer.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype,
                device=w.device) for b, w in zip(blocks, W)]
        gW, gB = zip(*(layer_gradients(obs, b.layer, grads, index) for b in blocks))
        exans = torch.zeros(M, H, dtype=torch.long)

        # -- step 1: samples and labels from the output layer --------------------------------------
        groups = parallel_groups(gW[H], o.parallel_tol)
        samples: list[dict] = []
        for members in groups:
            rows, scales = gW[H - 1][members], gB[H - 1][members]
            keep = scales != 0
            rows, scales, members_kept = rows[keep], scales[keep], [m for m, k in zip(members, keep) if k]
            if len(members_kept) < 2:
                continue
            each = rows / scales[:, None]
            agree = self._agreeing(each, o.agree_tol)
            if len(agree) < 2:
                continue
            h = _rows_solution(rows[agree], scales[agree])
            direction = gW[H][:, members_kept[agree[0]]]
            samples.append({"h": h, "label": int(direction.argmin()), "known": True, "exans_top": len(agree),
                            "members": [members_kept[a] for a in agree]})
        samples = samples[:M]
        identified = len(samples)
        if identified == 0:
            raise NothingRecovered("exclusivity identified no sample at the output layer (no group of exclusively "
                                   "activated neurons agrees on an input; noise, pruning or dropped gradient "
                                   "entries break the rank-one rows it reads): it determined nothing")
        for i, s in enumerate(samples):
            s["slot"] = i
            exans[i, H - 1] = s["exans_top"]

        # forward each identified sample to its loss vector and the δ of its top layers
        for s in samples:
            s["delta"] = self._top_delta(s["h"], s["label"], W, bias, H, M)
        # -- steps 2–3: layer by layer towards the input ----------------------------------------------
        unique_layers = []
        for k in range(H - 1, 0, -1):  # know h_k (input of block k); recover h_{k−1}
            known = [s for s in samples if s["known"]]
            all_known = len(known) == M
            for s in known:
                h = s["h"]
                s["pattern"] = h > o.active_tol * float(h.abs().max().clamp_min(1e-300))
                s["delta_k"] = s["pattern"].double() * (W[k].T @ s["delta"])  # δ at z_k
            active = torch.stack([s["pattern"] for s in known]) if known else torch.zeros(0, W[k - 1].shape[0],
                                                                                                dtype=torch.bool)
            counts = active.sum(0)
            solved, pending = [], []
            for i, s in enumerate(known):
                own = (active[i] & (counts == 1)).nonzero().flatten()
                d = s["delta_k"][own]
                ok = d != 0
                if not all_known:  # an unknown sample might share the neuron: the bias gradient must match
                    ok &= (gB[k - 1][own] - d).abs() <= 1e-6 * d.abs()
                own, d = own[ok], d[ok]
                exans[s["slot"], k - 1] = own.numel()
                if own.numel() > 0:
                    s["next"] = _rows_solution(gW[k - 1][own], d)
                    solved.append(s)
                else:
                    pending.append(s)
            if pending and all_known:
                residual = gW[k - 1] - sum((torch.outer(s["delta_k"], s["next"]) for s in solved),
                                           torch.zeros_like(gW[k - 1]))
                deltas = torch.stack([s["delta_k"] for s in pending], dim=1)
                forward = []
                for s in pending:
                    rows = s["pattern"]
                    forward.append((W[k - 1][rows], s["h"][rows] - bias[k - 1][rows]))
                sol, unique, _ = joint_solve(deltas, residual, forward, o.rcond)
                for s, x, u in zip(pending, sol, unique):
                    s["next"], s["known"] = x, u
            else:
                for s in pending:  # cannot separate its contribution: invert the forward map only
                    rows = s["pattern"]
                    s["next"] = lstsq(W[k - 1][rows], (s["h"] - bias[k - 1])[rows, None])[:, 0] \
                        if rows.any() else torch.zeros(W[k - 1].shape[1], dtype=W[k - 1].dtype)
                    s["known"] = False
            for s in known:
                s["delta"], s["h"] = s["delta_k"], s["next"]
            unique_layers.append(sum(s["known"] for s in samples))
        # -- verification: a flagged sample must explain its own ExANs' output-layer columns -------------
        for s in samples:
            if s["known"] and not self._explains(s, W, bias, gW[H], H, M, o.verify_tol):
                s["known"] = False
        # -- output ---------------------------------------------------------------------------------
        lo, hi = obs.data_range
        images = torch.full((M, *obs.input_shape), (lo + hi) / 2, dtype=torch.float64, device=obs.device)
        unique = torch.zeros(M, dtype=torch.bool)
        labels = torch.zeros(M, dtype=torch.long, device=obs.device)
        for i, s in enumerate(samples):
            images[i] = s["h"].reshape(obs.input_shape)
            unique[i] = bool(s["known"])
            labels[i] = s["label"]
        if identified < M:
            labels[identified:] = self._leftover_labels(obs, [s["label"] for s in samples], M - identified, seed)
        trace = {"identified": identified, "unique": unique.tolist(), "exans": exans.tolist(),
                 "recovered": "exact inputs for samples flagged unique; least-squares estimates otherwise",
                 "unique_per_layer": unique_layers}
        if callback is not None:
            callback(0, images.to(obs.dtype))
        return Reconstruction(images=images.to(obs.dtype), labels=labels, confidence=unique.double().to(obs.dtype),
                              trace=trace)

    @staticmethod
    def _agreeing(each: torch.Tensor, tol: float) -> list[int]:
        """Indices of the largest subset of rows that agree with each other (relative ``tol``)."""
        scale = each.norm(dim=1).clamp_min(1e-300)
        dist = torch.cdist(each, each) / torch.minimum(scale[:, None], scale[None])
        close = dist <= tol
        best = int(close.sum(1).argmax())
        return close[best].nonzero().flatten().tolist()

    @staticmethod
    def _explains(s: dict, W, bias, g_out: torch.Tensor, H: int, M: int, tol: float) -> bool:
        """Whether the reconstruction, forwarded through the model, predicts the output-layer gradient columns
        g(x̂)·h_j(x̂)/M of the neurons it was read from (its ExANs).  Step 1 takes a group of parallel columns
        for one sample; a group of neurons shared by two samples with nearly parallel loss vectors (same label,
        similar images, an untrained net) passes that test and its rows agree on a *mixture* of the two — which
        predicts those columns only up to the difference of the two loss vectors, far above round-off."""
        h = s["h"]
        for k in range(H):
            h = torch.relu(W[k] @ h + bias[k])
        g = torch.softmax(W[H] @ h + bias[H], 0)
        g[s["label"]] -= 1
        cols = s["members"]
        predicted = torch.outer(g, h[cols]) / M
        observed = g_out[:, cols]
        return float((predicted - observed).norm()) <= tol * float(observed.norm().clamp_min(1e-300))

    @staticmethod
    def _top_delta(h: torch.Tensor, label: int, W, bias, H: int, M: int) -> torch.Tensor:
        """δ at z_H (the last hidden pre-activation) of a sample whose h_{H−1} is known."""
        z = W[H - 1] @ h + bias[H - 1]
        top = torch.relu(z)
        logits = W[H] @ top + bias[H]
        g = torch.softmax(logits, 0)
        g[label] -= 1
        return (top > 0).double() * (W[H].T @ (g / M))

    @staticmethod
    def _leftover_labels(obs: Observation, found: list[int], count: int, seed: int) -> torch.Tensor:
        """Labels of unidentified samples: the class counts from ∇b minus the identified labels."""
        if obs.labels is not None:
            pool = obs.labels.tolist()
        else:
            counts = label_counts(obs, seed=seed)
            pool = torch.repeat_interleave(torch.arange(obs.num_classes), counts).tolist()
        for y in found:
            if y in pool:
                pool.remove(y)
        pool = (pool + [0] * count)[:count]
        return torch.tensor(pool, dtype=torch.long, device=obs.device)
