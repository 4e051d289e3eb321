"""SPEAR's search for the sparse directions of a low-rank gradient factorisation (Dimitrov et al. 2024,
Algorithm 1): candidate directions from the gradient's rows, their selection and repair until the ReLU patterns
agree with the bias gradient, completing the basis, and the estimated precision of each recovered sample.
The attack itself (:mod:`leakbench.attacks.gradient.spear`) drives these."""
from __future__ import annotations

import torch

from .sparse_span import blurred_zeros, contradictions, exact_zeros, scales, strays, zero_band


def sample_precision(left: torch.Tensor, right: torch.Tensor, grad_b: torch.Tensor, q_full: torch.Tensor, k: int,
                     s: torch.Tensor, dec, batch: int, zero_tol: float) -> torch.Tensor:
    """Per sample, an estimate of the max-abs error of x̂_i (see the caller)."""
    floor = float(dec.spectrum[batch]) if dec.spectrum.numel() > batch else 0.0
    inv = torch.linalg.inv(q_full)
    amplified = inv.norm(dim=1) * floor / s.abs().clamp_min(1e-300)
    halves = []
    for parity in (0, 1):
        zeros = exact_zeros(left @ q_full[:, :k], zero_tol)
        keep = (torch.arange(left.shape[0], device=left.device) % 2 == parity)[:, None] & zeros
        gram = torch.einsum("mk,mr,ms->krs", keep.to(left.dtype), left, left)
        cols = torch.linalg.eigh(gram)[1][:, :, 0].T
        cols = cols * torch.sign((cols * q_full[:, :k]).sum(0, keepdim=True))
        q = torch.cat([cols, q_full[:, k:]], 1)
        sh, _ = scales(left, q, grad_b)
        halves.append(torch.linalg.solve(q, right) / sh[:, None])
    spread = (halves[0] - halves[1]).abs().amax(1)
    out = amplified + spread
    return torch.where(torch.isfinite(out), out, torch.full_like(out, float("inf")))


def row_inputs(grad_w: torch.Tensor, grad_b: torch.Tensor, live: torch.Tensor, limit: int) -> torch.Tensor:
    """Row j of ∂L/∂W over ∂L/∂b_j: a weighted mean of the samples active on neuron j (those with the
    largest |∂L/∂b_j| first, at most ``limit``)."""
    usable = (live & (grad_b != 0)).nonzero().flatten()
    order = grad_b[usable].abs().argsort(descending=True)[:limit]
    rows = usable[order]
    return grad_w[rows] / grad_b[rows, None]


def deflated_rows(left: torch.Tensor, selected: torch.Tensor, grad_w: torch.Tensor, grad_b: torch.Tensor,
                  live: torch.Tensor, limit: int) -> torch.Tensor:
    """Row candidates of the gradient with the found samples projected out (ours).

    ∂L/∂W = Σ_i g_i x_iᵀ; projecting its columns off the found samples' g_i = L q_i leaves Σ_j (P⊥g_j) x_jᵀ over
    the samples still missing only, and P⊥g_j ≈ g_j (the found g_i span few of the m dimensions).  Its row j over
    its bias entry is then a weighted mean of the *missing* samples active on neuron j: fewer samples than in the
    whole gradient's row, so a start nearer one of them.  Measured (float64 prototype, digits-like B = 256,
    ``mlp:2000`` untrained, the tuning batch): 256 of 256 directions in six fractions (46 s); the whole gradient's
    rows give 82–96, and the same rows projected onto the missing samples' input span stall near 120."""
    basis = torch.linalg.qr(left @ selected)[0]
    both = torch.cat([grad_w, grad_b[:, None]], 1).to(basis)          # ∂L/∂W and ∂L/∂b: one projection
    both = both - basis @ (basis.T @ both)
    return row_inputs(both[:, :-1], both[:, -1], live, limit)


def select_directions(left: torch.Tensor, found: torch.Tensor, zero_tol: float, right: torch.Tensor | None = None,
                      floor: float = 0.0) -> torch.Tensor:
    """SPEAR's greedy selection: most exact zeros first (within the gradient's error, :func:`blurred_zeros`),
    skipping directions in the span of those taken."""
    if found.shape[1] == 0:
        return found
    zeros = blurred_zeros(left @ found, found, zero_tol, right, floor).to(found.dtype)
    counts = zeros.sum(0)
    # a mixture of samples is zero on their common zeros plus a few stray rows: drop a direction whose zeros
    # lie, but for a few stray rows, inside the zeros of a sparser one (two samples' zero sets differ far more)
    shared = zeros.T @ zeros
    dominated = ((counts[:, None] - shared <= strays(found.shape[0])) & (counts[None, :] > counts[:, None])).any(1)
    found, counts = found[:, ~dominated], counts[~dominated]
    found, counts = found[:, ~pair_mixtures(found, counts)], counts[~pair_mixtures(found, counts)]
    taken: list[torch.Tensor] = []
    basis = torch.zeros(found.shape[0], 0, dtype=found.dtype, device=found.device)
    for k in counts.argsort(descending=True).tolist():
        v = found[:, k] / found[:, k].norm()
        rest = v - basis @ (basis.T @ v)
        if float(rest.norm()) > 1e-4:
            taken.append(found[:, k])
            basis = torch.cat([basis, (rest / rest.norm())[:, None]], 1)
        if len(taken) == found.shape[0]:
            break
    return torch.stack(taken, 1)


def pattern_disagreements(left: torch.Tensor, right: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                          grad_b: torch.Tensor, cols: torch.Tensor, zero_tol: float,
                          proj: torch.Tensor | None = None, floor: float = 0.0, active_side: bool = True
                          ) -> torch.Tensor:
    """Per column of Q̂: neurons where the solved sample's activity (clear of the hinge) contradicts the zeros
    of its gradient L q̂ (SPEAR's sparsity matching); m for every sample when Q̂ is singular.  An inactive sample
    contradicts only entries of L q̂ above :func:`zero_band` (``floor``: the gradient's error per entry): at
    B = 256 the zeros of exact directions pass the relative ``zero_tol`` for nearly every sample.  Without
    ``active_side`` an active sample whose L q̂ looks zero is not counted: a neuron can be active with a
    back-propagated value below the gradient's resolution (one per digits-like B = 256 batch, 7e-7 of the sample's
    largest), which no direction changes, while a wrong column (a mixture) contradicts inactive neurons."""
    proj = right @ weight.T if proj is None else proj
    s, _ = scales(left, cols, grad_b)
    z = torch.linalg.solve(cols, proj) / s[:, None] + bias
    if not torch.isfinite(z).all():
        return torch.full((cols.shape[1],), weight.shape[0], device=cols.device)
    return contradictions(z, (left @ cols).T, zero_tol, zero_band(right, cols, floor), active_side).sum(1)


def repair_directions(left: torch.Tensor, right: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      grad_b: torch.Tensor, selected: torch.Tensor, found: torch.Tensor, zero_tol: float,
                      rounds: int = 2, limit: int = 16, floor: float = 0.0) -> tuple[torch.Tensor, int]:
    """Swap selected directions for other found ones while that makes more samples' activation patterns agree
    with their gradients' zeros (SPEAR's greedy step scored by sparsity matching).

    A wrong column (a sparse vector that is no sample's, e.g. one vanishing on the neurons every sample
    activates) mixes the samples it combines; only their patterns break, so the culprit is among the columns
    of the samples that disagree.  Each trial costs one B×B solve and B·m comparisons (X̂Wᵀ = Q̂⁻¹(RWᵀ)/s).
    """
    def disagreements(cols: torch.Tensor) -> torch.Tensor:
        return pattern_disagreements(left, right, weight, bias, grad_b, cols, zero_tol, proj=proj, floor=floor)

    proj = right @ weight.T                                             # r×m
    unit = found / found.norm(dim=0, keepdim=True)
    swaps = 0
    current = disagreements(selected)
    for _ in range(rounds):
        bad = (current > 0).nonzero().flatten()[:limit]
        if bad.numel() == 0:
            break
        taken = (unit.T @ (selected / selected.norm(dim=0, keepdim=True))).abs().amax(1) > 1 - 1e-6
        pool = found[:, ~taken][:, :limit]
        best, best_cols = int((current == 0).sum()), None
        for k in bad.tolist():
            for p in pool.T:
                trial = selected.clone()
                trial[:, k] = p
                score = int((disagreements(trial) == 0).sum())
                if score > best:
                    best, best_cols = score, trial
        if best_cols is None:
            break
        selected, swaps = best_cols, swaps + 1
        current = disagreements(selected)
    return selected, swaps


def pair_mixtures(found: torch.Tensor, counts: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Directions in the span of two others that both have more zeros: a mixture of two samples (whose
    zeros are the pair's common zeros, fewer than either's) — all triples at once."""
    k = found.shape[1]
    if k < 3:
        return torch.zeros(k, dtype=torch.bool, device=found.device)
    unit = found / found.norm(dim=0, keepdim=True)
    cos = unit.T @ unit                                                   # K×K
    ca, cb, cab = cos[:, :, None], cos[:, None, :], cos[None, :, :]      # c, a, b
    det = (1 - cab.pow(2)).clamp_min(1e-300)
    captured = (ca.pow(2) + cb.pow(2) - 2 * ca * cb * cab) / det         # ‖projection of c on span{a, b}‖²
    residual = (1 - captured).clamp_min(0)
    richer = (counts[None, :] > counts[:, None])                          # a (or b) has more zeros than c
    pair = richer[:, :, None] & richer[:, None, :] & (1 - cab.abs() > 1e-6)
    return ((residual < tol ** 2) & pair).any(2).any(1)


def complete_basis(left: torch.Tensor, selected: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
    """Q̂: the selected directions, then the best rejected proposals that keep it well conditioned, then an
    orthonormal complement."""
    r = left.shape[1]
    cols = selected
    for c in spare.T:
        if cols.shape[1] >= r:
            break
        trial = torch.cat([cols, c[:, None]], 1)
        sv = torch.linalg.svdvals(trial)
        if float(sv[-1]) > 1e-3 * float(sv[0]):
            cols = trial
    if cols.shape[1] < r:
        complement = torch.linalg.svd(cols.T, full_matrices=True)[2][cols.shape[1]:] if cols.shape[1] else \
            torch.eye(r, dtype=left.dtype, device=left.device)
        cols = torch.cat([cols, complement.T], 1)
    return cols
