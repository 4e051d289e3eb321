"""SPEAR's Algorithm 1 on one (residual or whole) gradient (Dimitrov et al., NeurIPS 2024): proposals from
candidate inputs (kernels of L on their most negative rows, shared kernels split), refinement, the sparsity filter,
greedy selection and repair, rounds that re-propose from the solved batch, then X̂ = Q̂⁻¹R/s with SPEAR's
pattern certificate and the precision estimate.  The attack (:mod:`leakbench.attacks.gradient.spear`) drives it
between peeling passes; the algebra is in :mod:`.sparse_span` and :mod:`.spear_search`."""
from __future__ import annotations

import time

import torch

from .sparse_span import (certify, decompose, directions_from_inputs, entry_floor, exact_zeros, refine, scales,
                          strays, unique_columns, zero_band)
from .next_layer import DROPS, next_layer_directions, usable
from .spear_options import SpearOptions
from .spear_search import (complete_basis, deflated_rows, pattern_disagreements, repair_directions, row_inputs,
                           sample_precision, select_directions)

__all__ = ["factorise", "PRECISION", "ROW_FACTORS", "WHOLE_FACTORS", "SPLIT"]

#: rows of L whose kernel is proposed, as multiples of the rank (Theorem 3.3 needs ≥ B − 1 of them).
ROW_FACTORS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
#: kernels shared by up to this many samples are split into their samples (``sparse_span.separate``).
SPLIT = 16
#: on the whole gradient (exact zeros) also 1.25 B rows, first: more kernels of few samples (measured on a digits-like
#: B = 256 gradient: 176 of 256 directions from 1.25 B rows against 150 from 1.5 B)
WHOLE_FACTORS = (1.25,) + ROW_FACTORS
#: at most this many rows per kernel (bounds the cost at large B: K candidates × rows × B²).
MAX_ROWS = 512
#: scales at which a completed (not yet exact) sample is re-proposed, both signs.
SCALES = torch.cat([torch.logspace(-0.7, 0.7, 15), -torch.logspace(-0.7, 0.7, 15)]).double()
#: a SPEAR sample is certified only when its estimated max-abs error is below this fraction of the data range
#: (the estimate runs ~10× above the measured error of exact samples, and far below that of imprecise ones).
PRECISION = 1e-4
#: a zero of a noised gradient is below this many times its noise level (σ_{B+1}/σ_1 of ∂L/∂W).
NOISE_ZEROS = 10.0
#: the next layer's directions are sought only on gradients whose σ_{B+1}/σ_1 is below this (round-off, not noise)
QUIET = 1e-5
#: cycles through the next layer's fractions (``next_layer.DROPS``) at most, each from the gradient deflated off the
#: directions selected so far (a cycle that adds nothing ends it sooner)
MAX_CYCLES = 4
#: the fraction of the time left that the next layer's pass may use (the kernels keep the rest)
SHARE = 0.75

def factorise(grad_w: torch.Tensor, grad_b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, batch: int,
              tolerances: tuple[float, float, float, float], device, width: float = 1.0, *, options: SpearOptions,
              deadline: float = float("inf"), extra: torch.Tensor | None = None,
              factors: tuple[float, ...] = ROW_FACTORS, next_weight: torch.Tensor | None = None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, dict]:
    """SPEAR's Algorithm 1 on a (residual) gradient of ``batch`` samples: the estimates X̂ (rank×n), their δ̂,
    which pass SPEAR's pattern certificate and which of those are also precise (estimated max-abs error
    ≤ ``PRECISION``·``width``), or None when the gradient is zero or the directions are singular.  ``extra``:
    candidate inputs proposed before the gradient's rows (and, with them, the solved rows of the selected directions
    in later rounds); ``deadline``: ``time.perf_counter()`` after which no further row factor is tried;
    ``next_weight``: the weight W₂ of the linear layer after this ReLU layer, whose structure proposes more
    directions where SPEAR's kernels stall (:mod:`.next_layer`)."""
    o = options
    rcond, zero_tol, null_tol, tol = tolerances
    dec = decompose(grad_w, batch, rcond)
    rank = dec.rank
    info: dict = {"rank": rank, "batch": batch, "rounds": 0}
    if dec.spectrum.numel() > batch and float(dec.spectrum[0]) > 0:
        # a noised gradient's zeros sit at the noise level: the first singular value past B measures it
        noise = float(dec.spectrum[batch] / dec.spectrum[0])
        zero_tol, null_tol = max(zero_tol, NOISE_ZEROS * noise), max(null_tol, NOISE_ZEROS * noise)
    info["zero_tol"] = zero_tol
    # exact zeros (σ_{B+1} at round-off): the next layer's equations hold to round-off, not to a noise level
    quiet = dec.spectrum.numel() <= batch or float(dec.spectrum[batch]) <= QUIET * float(dec.spectrum[0])
    none = torch.zeros(0, dtype=torch.bool, device=device)
    if rank < batch:
        info["rank_deficient"] = (f"∂L/∂W has rank {rank} < batch {batch}: the inputs are linearly dependent, "
                                  "so samples inside a dependency cannot be separated (Theorem 3.2 needs rank B)")
    if rank == 0:
        return None, None, none, none, info
    left, right = dec.left, dec.right
    floor = entry_floor(dec.spectrum, rank, tuple(grad_w.shape))   # the gradient's error per entry
    live = ~exact_zeros(grad_w.norm(dim=1, keepdim=True), zero_tol)[:, 0]   # neurons some sample activates
    dead = int((~live).sum())
    found = torch.zeros(rank, 0, dtype=torch.float64, device=device)
    spare = torch.zeros(rank, 0, dtype=torch.float64, device=device)
    inputs = row_inputs(grad_w, grad_b, live, o.candidates)
    if extra is not None:   # samples already found (approximately) propose first
        inputs = torch.cat([extra.reshape(extra.shape[0], -1).to(inputs), inputs])
    selected = found
    # a rank-deficient batch has no exact columns to complete or repair: one pass finds the samples outside
    # every dependency (if any), further rounds would only spend time
    last = o.rounds if rank == batch else 0
    for round_ in range(last + 1):
        info["rounds"] = round_ + 1
        if next_weight is not None and selected.shape[1] < rank and rank == batch and quiet and \
                usable(int(live.sum()), rank, next_weight.shape[0]) and time.perf_counter() <= deadline:
            # first (ours): the next layer's structure proposes from the same candidates; at large B it finds in
            # seconds what the kernels' row subsets find in minutes, and what it leaves the kernels still try
            # the samples found before (``extra``) alone start the first round's first fraction: they sit next to
            # their samples, and the gradient's rows come back deflated off them
            first = inputs[: extra.shape[0]] if extra is not None and round_ == 0 else inputs
            found, selected = _next_layer_pass(left, weight, bias, next_weight, first, found, selected, rank, dead,
                                               (zero_tol, null_tol), deadline, info, grad_w=grad_w, grad_b=grad_b,
                                               live=live, limit=o.candidates, rows=inputs, right=right, floor=floor)
        for factor in factors:  # fewest rows first; stop as soon as B directions are selected
            if selected.shape[1] >= rank and round_ == 0:   # the next layer found them all: the kernels' turn
                break                                       # comes only if the pattern test finds a wrong one
            rows = min(max(int(factor * rank), rank - 1), int(live.sum()), MAX_ROWS)
            if rows < max(rank - 1, 1):
                continue
            q, ok = directions_from_inputs(left, weight, bias, inputs, rows=rows, null_tol=null_tol, live=live,
                                           split=SPLIT)
            exact, zeros, single = refine(left, q, zero_tol=zero_tol, null_tol=null_tol, stray=strays(rank),
                                          right=right, floor=floor)
            # SPEAR's sparsity filter: a sample's kernel vanishes on its whole zero set, beyond the rows it was
            # read from; a kernel of rows that do not span (few rows, each active for few samples) vanishes on
            # little more than those rows and the dead ones
            keep = ok & single & (zeros >= rows + dead + max(4, rank // 8))
            found = torch.cat([found, exact[:, keep]], 1)
            found = found[:, unique_columns(found)]
            spare = torch.cat([spare, q[:, ~keep]], 1)
            if selected.shape[1] < rank:  # once B are selected, new directions only enter by repair swaps
                selected = select_directions(left, found, zero_tol, right, floor)
            if selected.shape[1] >= rank and round_ == 0:  # later rounds have few candidates: try every k
                break
            if time.perf_counter() > deadline:
                info["time_budget"] = f"stopped after {o.seconds:g} s (option seconds)"
                break
        spare = spare[:, exact_zeros(left @ spare, 1e-3).sum(0).argsort(descending=True)[: 4 * rank]]
        disagree = None
        if selected.shape[1] >= rank and rank == batch:
            selected, swapped = repair_directions(left, right, weight, bias, grad_b, selected, found, zero_tol,
                                                  floor=floor)
            info["swaps"] = info.get("swaps", 0) + swapped
            # the rounds re-propose samples that contradict inactive neurons (a wrong column); an active neuron
            # that looks zero (a back-propagated value below resolution) is left to the certificates
            disagree = pattern_disagreements(left, right, weight, bias, grad_b, selected, zero_tol, floor=floor,
                                             active_side=False)
            info["disagreeing"] = int((disagree > 0).sum())
            info["disagreements"] = int(disagree.sum())
        missing = rank - selected.shape[1] if disagree is None else int((disagree > 0).sum())
        if missing == 0 or round_ == last or "time_budget" in info:
            break
        completed = complete_basis(left, selected, spare)
        s, _ = scales(left, completed, grad_b)
        solved = torch.linalg.solve(completed, right) / s[:, None]
        # rows of Q̂⁻¹ for the completed columns lie in the span of the missing samples' dual vectors (exactly
        # so when one is missing), those of disagreeing samples near their sample; the scale of either rests on
        # wrong columns: try each at a grid of scales
        redo = solved[selected.shape[1]:] if disagree is None else solved[disagree > 0]
        # at most ``candidates`` proposals: fewer scales (evenly spread over both signs) for many samples
        grid = SCALES.to(redo)[torch.linspace(0, len(SCALES) - 1, max(2, min(len(SCALES), o.candidates //
                                                                             max(1, redo.shape[0])))).long()]
        inputs = (grid[:, None, None] * redo[None]).reshape(-1, redo.shape[1])[: o.candidates]
        if extra is not None and disagree is None:
            # on the whole gradient the selected samples' rows propose too: X̂_F = X_F + A X_U is near X_F, and
            # its kernels are shared with the similar samples still missing
            inputs = torch.cat([solved[: selected.shape[1]], inputs])
        inputs = inputs[torch.isfinite(inputs).all(1)]
    info["found"] = int(selected.shape[1])
    q_full = complete_basis(left, selected, spare)
    s, bias_fit = scales(left, q_full, grad_b)
    x_hat = torch.linalg.solve(q_full, right) / s[:, None]
    deltas = (left @ q_full * s[None, :]).T
    info["bias_residual"] = bias_fit
    if not torch.isfinite(x_hat).all():
        info["failed"] = "the selected directions were singular; nothing certified"
        return None, None, none, none, info
    cert = certify(x_hat, deltas, weight, bias, grad_w, grad_b, zero_tol=zero_tol, tol=tol,
                   band=zero_band(right, q_full, floor) * s.abs())
    exact = cert.certified & (torch.arange(rank, device=device) < selected.shape[1])
    # precision: X̂ = Q̂⁻¹R/s amplifies R's error (σ_{B+1} of the gradient, its noise or round-off) by row i of
    # Q̂⁻¹, and Q̂'s own error shows as the change of X̂ when every direction is re-solved from half of its
    # zero rows (even and odd rows apart); a sample is exact only to the larger of the two
    precision = sample_precision(left, right, grad_b, q_full, selected.shape[1], s, dec, batch, zero_tol)
    info["precision"] = precision.tolist()
    info["imprecise"] = int((exact & ~(precision <= PRECISION * width)).sum())
    info.update({"pattern_mismatch": cert.pattern_mismatch.tolist(), "sample_residual": cert.residual.tolist()})
    return x_hat, deltas, exact, precision <= PRECISION * width, info


def _next_layer_pass(left, weight, bias, next_weight, inputs, found, selected, rank: int, dead: int,
                     tolerances: tuple[float, float], deadline: float, info: dict, *, grad_w: torch.Tensor,
                     grad_b: torch.Tensor, live: torch.Tensor, limit: int, rows: torch.Tensor, right: torch.Tensor,
                     floor: float):
    """Directions from :mod:`.next_layer`, the neurons' certainty cut at each fraction in turn until B are selected;
    each judged by SPEAR's refinement and sparsity filter like a kernel's.  The first fraction starts from
    ``inputs``; once some directions are selected, the starts are the rows of the gradient deflated off them
    (:func:`deflated_rows`), else ``rows``.  The fractions cycle while a full cycle still adds directions."""
    zero_tol, null_tol = tolerances
    began = time.perf_counter()
    if deadline != float("inf"):   # ``SHARE`` of what is left: the kernels still get theirs (CIFAR-10, B = 256: the
        deadline = began + SHARE * (deadline - began)   # last two directions once came only from them)
    starts, idle = inputs, 0
    for step in range(MAX_CYCLES * len(DROPS)):
        drop = DROPS[step % len(DROPS)]
        q = next_layer_directions(left, weight, bias, next_weight, starts, drops=(drop,), deadline=deadline,
                                  right=right, floor=floor)
        exact, zeros, single = refine(left, q, zero_tol=zero_tol, null_tol=null_tol, stray=strays(rank),
                                      right=right, floor=floor)
        keep = single & (zeros >= rank - 1 + dead + max(4, rank // 8))
        found = torch.cat([found, exact[:, keep]], 1)
        found = found[:, unique_columns(found)]
        before, selected = selected.shape[1], select_directions(left, found, zero_tol, right, floor)
        added = selected.shape[1] - before
        info["next_layer"] = info.get("next_layer", 0) + added
        idle = 0 if added else idle + 1
        if selected.shape[1] >= rank or time.perf_counter() > deadline or idle >= len(DROPS):
            break
        if selected.shape[1] and (added or step == 0):
            starts = deflated_rows(left, selected, grad_w, grad_b, live, limit)
        elif step == 0:
            starts = rows
    info["next_layer_seconds"] = info.get("next_layer_seconds", 0.0) + time.perf_counter() - began
    return found, selected
