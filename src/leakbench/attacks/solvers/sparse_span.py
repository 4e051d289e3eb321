"""Sparse directions in the span of a ReLU layer's weight gradient: the algebra of ``spear``.

A linear layer Z = X Wᵀ + b (B samples as rows of X, m neurons) followed by a ReLU shares
∂L/∂W = Δᵀ X and ∂L/∂b = Δᵀ 1, where Δ (B×m) holds the per-sample gradients at Z; δ_ij = 0
wherever z_ij ≤ 0.  Dimitrov et al. (SPEAR, NeurIPS 2024, Sec. 3) factor ∂L/∂W = L R with
rank B; then Δᵀ = L Q and X = Q⁻¹ R for an unknown invertible B×B matrix Q, and every column q_i
of Q spans the kernel of the rows of L where sample i's gradient vanishes.  Everything here works
on float64 tensors on the caller's device, in batches (no loop over neurons or pixels):

* :func:`decompose` — L (orthonormal, m×r) and R (r×n) from the SVD, with the numerical rank r;
* :func:`directions_from_inputs` — for each candidate input x̂, the rows where x̂ is most surely
  inactive (most negative pre-activation margin) and the kernel of L on those rows: a direction
  q with L q exactly zero there, accepted only when that kernel is one-dimensional;
* :func:`exact_zeros` / :func:`refine` — the zero set of L q and the kernel of L on all of it
  (the direction is then fixed by hundreds of rows, not r − 1);
* :func:`unique_columns` — directions up to sign and scale;
* :func:`scales` — the scales s with L Q̄ s = ∂L/∂b (SPEAR's scale recovery);
* :func:`certify` — per sample, whether the reconstruction explains the gradient exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .linalg import lstsq

__all__ = ["Decomposition", "decompose", "directions_from_inputs", "separate", "exact_zeros", "blurred_zeros",
           "entry_floor", "zero_band", "ZERO_BAND", "refine", "unique_columns", "scales", "certify", "contradictions",
           "Certificate", "strays"]


@dataclass
class Decomposition:
    """∂L/∂W = L R with L orthonormal (m×r); ``spectrum`` holds all singular values of ∂L/∂W."""

    left: torch.Tensor
    right: torch.Tensor
    rank: int
    spectrum: torch.Tensor


def strays(rank: int) -> int:
    """How many stray rows a mixture's zero set may carry beyond two samples' common zeros: r/8, from 1 to 4
    (small batches have few rows that tell two samples apart, so only one stray row is tested there)."""
    return max(1, min(4, rank // 8))


def decompose(grad_w: torch.Tensor, batch: int, rcond: float) -> Decomposition:
    """The rank-B factorisation of SPEAR's Sec. 3: singular vectors above ``rcond``·σ_max, at most ``batch``
    of them (a noised gradient has full rank; its top-B subspace is the least-squares estimate)."""
    u, s, vh = torch.linalg.svd(grad_w, full_matrices=False)
    rank = int((s > rcond * s[0]).sum()) if s.numel() and float(s[0]) > 0 else 0
    rank = min(rank, batch)
    return Decomposition(u[:, :rank], s[:rank, None] * vh[:rank], rank, s)


def exact_zeros(values: torch.Tensor, tol: float) -> torch.Tensor:
    """Entries of each column of ``values`` (m×K) at most ``tol`` times that column's largest magnitude."""
    mags = values.abs()
    return mags <= tol * mags.amax(0, keepdim=True).clamp_min(torch.finfo(values.dtype).tiny)


#: an entry of L q̂ that is zero in exact arithmetic sits within this many of its standard errors (:func:`zero_band`)
#: of zero.  Measured with q̂ the kernel of L on a sample's true zeros, float32 gradients of untrained MLPs: the
#: largest zero at 6.7–11.3 standard errors (digits-like B = 128, 256; CIFAR-10 B = 64, 256), where the relative
#: ``zero_tol`` of 16 ulps was passed by a few per cent of them at B = 256; 3e-5 of the active entries or fewer
#: fall below the band (they are not counted either way).
ZERO_BAND = 16.0
#: an exact direction's kernel eigenvalue on its zero set is at most this many standard errors (rms) squared per row:
#: measured 0.02–0.42 of one on the true zero sets of a trained mlp:2000's B = 256 gradient (the second eigenvalue:
#: ≥ 8.8e6 of them)
NULL_SE = 2.0


def entry_floor(spectrum: torch.Tensor, rank: int, shape: tuple[int, int]) -> float:
    """The standard error of one entry of ∂L/∂W (its round-off or noise), from the singular values past the rank:
    Σ_{k>r} σ_k² ≈ (m − r)(n − r)·e²."""
    m, n = shape
    if spectrum.numel() <= rank or min(m, n) <= rank:
        return 0.0
    return float((spectrum[rank:].double().pow(2).sum() / ((m - rank) * (n - rank))).sqrt())


def zero_band(right: torch.Tensor, cols: torch.Tensor, floor: float) -> torch.Tensor:
    """Per column q̂ of Q̂, the magnitude below which an entry of L q̂ may be a zero blurred by the gradient's error
    (ours).  L's error is E V Σ⁻¹ to first order (E: the gradient's, ``floor`` per entry), so an entry of L q̂
    carries about ``floor``·‖Σ⁻¹q̂‖; ``ZERO_BAND`` of those.  ``right`` = Σ Vᵀ (its row norms are the σ_k)."""
    return ZERO_BAND * floor * (cols / right.norm(dim=1, keepdim=True).clamp_min(1e-300)).norm(dim=0)


def blurred_zeros(values: torch.Tensor, cols: torch.Tensor, zero_tol: float, right: torch.Tensor | None,
                  floor: float) -> torch.Tensor:
    """:func:`exact_zeros`, widened per column to :func:`zero_band` when the gradient's error is known (``right``,
    ``floor``): on a trained model's ill-conditioned gradient the samples with the smallest gradients have most of
    their zeros above the relative tolerance (digits-like B = 256, ``mlp:2000`` at accuracy 0.62: 310–443 of
    ~800 zeros), all of them inside the band, and 0–2 active entries."""
    zeros = exact_zeros(values, zero_tol)
    if right is None or not floor:
        return zeros
    return zeros | (values.abs() <= zero_band(right, cols, floor)[None, :])


def directions_from_inputs(left: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, inputs: torch.Tensor, *,
                           rows: int, null_tol: float, live: torch.Tensor | None = None, chunk: int = 64,
                           split: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel directions of L on the ``rows`` rows where each candidate input is most surely inactive.

    ``left`` is L (m×r), ``weight``/``bias`` the layer (m×n, m), ``inputs`` the candidates (K×n).  A candidate
    near a true sample x_i is inactive with a wide margin on rows of sample i's zero set Z_i, whose kernel in L
    is q_i alone (Theorem: q_i ⊥ L_j for j ∈ Z_i).  Returns directions (r×K, unit) and whether each kernel is
    one-dimensional (σ_r ≤ ``null_tol``·σ_1 < σ_{r−1}/100); rows outside ``live`` (neurons no sample
    activates: zero, or noise only) are never picked.  A kernel of dimension 2 … ``split`` (several similar
    samples inactive on every picked row) is told apart by :func:`separate`; its directions are appended (flagged
    one-dimensional: their own kernel is checked by :func:`refine`).
    """
    r = left.shape[1]
    norms = weight.norm(dim=1).clamp_min(torch.finfo(weight.dtype).tiny)
    dead = left.norm(dim=1) == 0 if live is None else ~live
    out, ok, extra = [], [], []
    for start in range(0, inputs.shape[0], chunk):
        part = inputs[start:start + chunk]
        margin = (part @ weight.T + bias) / norms
        margin = margin.masked_fill(dead, float("inf"))
        pick = margin.topk(rows, dim=1, largest=False).indices      # K×rows
        sub = left[pick]                                            # K×rows×r
        evals, evecs = torch.linalg.eigh(sub.transpose(1, 2) @ sub)  # σ² ascending (Gram: robust, r×r)
        sv = evals.clamp_min(0).sqrt()
        out.append(evecs[:, :, 0])
        top = sv[:, -1].clamp_min(torch.finfo(sv.dtype).tiny)
        # one-dimensional: σ_r at the null level and σ_{r−1} above that level as well as 100 σ_r (two singular values
        # both at round-off are a kernel of two dimensions, whatever their ratio)
        ok.append((sv[:, 0] <= null_tol * top) & (sv[:, 1] > torch.maximum(100 * sv[:, 0], null_tol * top))
                  if r >= 2 else sv[:, 0] > 0)
        if split >= 2 and r > 2:
            dims = (sv <= null_tol * top[:, None]).sum(1)
            above = sv.gather(1, dims.clamp(max=r - 1)[:, None])[:, 0]
            below = sv.gather(1, (dims - 1).clamp(min=0)[:, None])[:, 0]
            shared = (dims >= 2) & (dims <= split) & (above > 100 * below)
            for c in shared.nonzero().flatten().tolist():
                found = separate(left, evecs[c, :, : int(dims[c])], ~dead)
                if found is not None:
                    extra.append(found)
    directions = torch.cat(out).T
    if not extra:
        return directions, torch.cat(ok)
    more = torch.cat(extra, 1)
    return (torch.cat([directions, more], 1),
            torch.cat(ok + [torch.ones(more.shape[1], dtype=torch.bool, device=left.device)]))


#: rows of a shared kernel whose directions agree to this (1 − |cos|) belong to one sample alone.
SAME_ROW = 1e-9
#: a sample is told apart only by a group of at least this many rows exclusive to it within the kernel.
GROUP_ROWS = 3


def separate(left: torch.Tensor, basis: torch.Tensor, live: torch.Tensor) -> torch.Tensor | None:
    """The samples of a shared kernel told apart: directions of L's kernel V (r×a) on rows several samples leave
    inactive (ours).

    Each row j of L V is Σ_i δ_ij (Q⁻¹)_i V over the samples i active on j, and (Q⁻¹)_i V = 0 for a sample outside
    the kernel, so L V is the layer gradient of the a kernel samples alone.  Exclusivity (Pan et al. 2022) then
    only has to hold among those a: a row active for one of them alone is parallel to that sample's dual row,
    and the many such rows of each sample (similar images still differ on hundreds of neurons) form a group of
    rows equal up to scale.  With one group per sample, sample k's direction is the kernel of the other groups'
    directions, V c_k.  None when fewer than a groups of ``GROUP_ROWS`` rows are found.
    """
    a = basis.shape[1]
    rows = (left @ basis)[live]
    norms = rows.norm(dim=1)
    rows = rows[norms > 1e-6 * norms.amax().clamp_min(torch.finfo(rows.dtype).tiny)]
    unit = rows / rows.norm(dim=1, keepdim=True)
    same = (unit @ unit.T).abs() > 1 - SAME_ROW
    size = same.sum(1)
    taken = torch.zeros(unit.shape[0], dtype=torch.bool, device=unit.device)
    groups = []
    for j in size.argsort(descending=True).tolist():
        if int(size[j]) < GROUP_ROWS or len(groups) == a:
            break
        if not taken[j]:
            groups.append(unit[j])
            taken |= same[j]
    if len(groups) < a:
        return None
    duals = torch.stack(groups)                                          # a×a, one row direction per sample
    others = duals[None].expand(a, a, a).masked_fill(torch.eye(a, dtype=torch.bool, device=duals.device)[:, :, None],
                                                     0.0)               # for each k: the other samples' rows
    coeffs = torch.linalg.eigh(others.transpose(1, 2) @ others)[1][:, :, 0]   # a×a: c_k ⊥ every other group
    return basis @ coeffs.T


def refine(left: torch.Tensor, directions: torch.Tensor, *, zero_tol: float, null_tol: float, stray: int = 1,
           right: torch.Tensor | None = None, floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each direction re-solved as the kernel of L on its whole exact-zero set.

    Returns the refined unit directions (r×K), their zero counts and whether the kernel on the zero set is
    one-dimensional and stays so without its ``stray`` most influential rows (a direction shared by several
    samples' common zeros has a larger kernel: not a sample).  With the gradient's error (``right``, ``floor``)
    the zeros are those within it (:func:`blurred_zeros`), and a kernel counts as one-dimensional also when its
    smallest eigenvalue is what that error leaves on |Z| rows, ``NULL_SE``²·|Z|·(floor‖Σ⁻¹q‖)² (ours).
    """
    zeros = blurred_zeros(left @ directions, directions, zero_tol, right, floor)   # m×K
    gram = torch.einsum("mk,mr,ms->krs", zeros.to(left.dtype), left, left)  # Lᵀ_Z L_Z per direction
    evals, evecs = torch.linalg.eigh(gram)
    top = evals[:, -1].clamp_min(torch.finfo(left.dtype).tiny)
    r = left.shape[1]
    bound = (null_tol ** 2) * top
    if right is not None and floor:
        error = zero_band(right, evecs[:, :, 0].T, floor) / ZERO_BAND          # per entry of L q, for each kernel
        bound = torch.maximum(bound, NULL_SE ** 2 * zeros.sum(0) * error.pow(2))
    single = evals[:, 0].clamp_min(0) <= bound
    if r >= 2:
        # the second direction must be held by many rows: when a few rows lift it, the zero set is the common
        # zeros of two samples plus a few stray rows, and without them the kernel is two-dimensional
        pull = (left @ evecs[:, :, 1].T).pow(2) * zeros.to(left.dtype)      # m×K
        lifted = pull.topk(min(stray, pull.shape[0]), dim=0).values.sum(0)
        single &= (evals[:, 1] > (100 * null_tol) ** 2 * top) & (lifted < 0.5 * evals[:, 1])
    refined = evecs[:, :, 0].T
    counts = blurred_zeros(left @ refined, refined, zero_tol, right, floor).sum(0)
    return refined, counts, single


def unique_columns(directions: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """Indices of the first of each group of columns equal up to sign (|cos| > 1 − ``tol``)."""
    if directions.shape[1] == 0:
        return torch.zeros(0, dtype=torch.long, device=directions.device)
    unit = directions / directions.norm(dim=0, keepdim=True).clamp_min(torch.finfo(directions.dtype).tiny)
    same = (unit.T @ unit).abs() > 1 - tol
    first = same.to(torch.int8).argmax(dim=1)           # smallest index equal to each column
    return torch.unique(first)


def scales(left: torch.Tensor, directions: torch.Tensor, grad_b: torch.Tensor) -> tuple[torch.Tensor, float]:
    """s with L Q̄ s = ∂L/∂b by least squares (SPEAR's scale recovery), and the relative residual."""
    basis = left @ directions
    s = lstsq(basis, grad_b[:, None])[:, 0]
    residual = float((basis @ s - grad_b).norm() / grad_b.norm().clamp_min(torch.finfo(grad_b.dtype).tiny))
    return s, residual


@dataclass
class Certificate:
    """Per-sample evidence that a reconstruction is exact."""

    certified: torch.Tensor          # bool per sample
    pattern_mismatch: torch.Tensor   # per sample: neurons whose activity disagrees with its gradient's support
    residual: torch.Tensor           # per sample: relative residual of ∂L/∂W on the rows it is active on
    gradient_residual: float         # ‖∂W − Δ̂ᵀX̂‖/‖∂W‖ over the batch
    bias_residual: float             # ‖∂b − Δ̂ᵀ1‖/‖∂b‖


def contradictions(z: torch.Tensor, grads: torch.Tensor, zero_tol: float, band: torch.Tensor | None = None,
                   active_side: bool = True) -> torch.Tensor:
    """Per sample (row) and neuron, whether its pre-activation ``z`` (K×m, clear of the hinge: above ``zero_tol`` of
    its largest) contradicts its gradient ``grads`` (K×m; SPEAR's sparsity matching): inactive where the gradient is
    non-zero (above ``band``, per sample, when given: zeros blurred by the gradient's own error,
    ``sparse_span.zero_band``), or, with ``active_side``, active where it is zero."""
    zeros = exact_zeros(grads.T, zero_tol).T
    strong = ~zeros if band is None else ~zeros & (grads.abs() > band[:, None])
    wrong = (z <= 0) & strong
    if active_side:
        wrong |= (z > 0) & zeros
    return wrong & (z.abs() > zero_tol * z.abs().amax(1, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny))


def certify(inputs: torch.Tensor, deltas: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
            grad_w: torch.Tensor, grad_b: torch.Tensor, *, zero_tol: float, tol: float,
            band: torch.Tensor | None = None) -> Certificate:
    """Whether each reconstructed sample x̂_i (row of ``inputs``) with gradient δ̂_i (row of ``deltas``) is exact.

    A sample is certified when (1) its own pre-activations W x̂_i + b are positive exactly where δ̂_i is
    non-zero (neurons within ``zero_tol`` of the hinge are not counted), and (2) ∂L/∂W − Δ̂ᵀX̂ vanishes, to
    relative ``tol``, on the rows where sample i is active, and ∂L/∂b − Δ̂ᵀ1 over the batch.  A corrupted x̂_i
    breaks (2) on its rows; a wrong δ̂_i breaks (1) or (2).  ``band`` (per sample): entries of δ̂_i at most this
    large may be zeros blurred by the gradient's error, and do not contradict an inactive neuron
    (``sparse_span.zero_band``).
    """
    z = inputs @ weight.T + bias                                          # B×m
    support = ~exact_zeros(deltas.T, zero_tol).T                          # B×m
    mismatch = contradictions(z, deltas, zero_tol, band)
    residual = grad_w - deltas.T @ inputs
    row_res = residual.norm(dim=1)
    row_ref = grad_w.norm(dim=1)
    active = support.to(grad_w.dtype)
    per_sample = (active @ row_res.pow(2)).sqrt() / (active @ row_ref.pow(2)).sqrt().clamp_min(
        torch.finfo(grad_w.dtype).tiny)
    total = float(residual.norm() / grad_w.norm().clamp_min(torch.finfo(grad_w.dtype).tiny))
    bias_res = float((grad_b - deltas.sum(0)).norm() / grad_b.norm().clamp_min(torch.finfo(grad_b.dtype).tiny))
    counts = mismatch.sum(1)
    ok = (counts == 0) & (per_sample <= tol) & torch.isfinite(per_sample) & (bias_res <= tol)
    return Certificate(ok, counts, per_sample, total, bias_res)
