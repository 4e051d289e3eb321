"""SPEAR: exact gradient inversion of batches (Dimitrov, Baader, Müller & Vechev, NeurIPS 2024, arXiv 2403.03945).

The first trainable layer Z = X Wᵀ + b of the model, followed by a ReLU, shares (Sec. 3)

* ∂L/∂W = Δᵀ X and ∂L/∂b = Δᵀ 1, Δ = ∂L/∂Z (B×m): ∂L/∂W has rank B (Theorem 3.1);
* ∂L/∂W = L R (here from the SVD, L orthonormal) gives Δᵀ = L Q and X = Q⁻¹ R for one unknown
  invertible B×B matrix Q (Theorem 3.2);
* the ReLU makes each column δ_i of Δᵀ sparse (δ_ij = 0 where z_ij ≤ 0, about half the neurons), and q_i
  spans the kernel of the rows of L where δ_i vanishes, as soon as they have rank B − 1 (Theorem 3.3).

SPEAR's Algorithm 1: propose directions as kernels of B − 1 rows of L, keep those whose L q has at least
τ·m exact zeros (sparsity filter), select B of them greedily, and fix their scales from ∂L/∂b = L Q̄ s
(scale recovery), so X = diag(s)⁻¹ Q̄⁻¹ R.  The paper proposes by sampling B − 1 rows uniformly, which
succeeds with probability ≈ 2^−(B−1) per draw: exponential in B (the paper stops at B ≈ 25).

Where we depart — the proposal step.  SPEAR++ (Bakarsky et al. 2025) replaces sampling by sparsely-used
dictionary learning (ER-SpUD of Spielman, Wang & Wright 2012; ℓ1 on the sphere of Qu, Sun & Wright 2016;
ℓ4 maximisation of Zhai et al. 2020).  Measured on `mlp:1000` gradients of digits (B = 32) those solvers
(ADM ℓ1 from the rows of L, ℓ4 power and MSP iterations, reweighted ℓ0) recovered none of the columns:
activation patterns of similar images overlap by ~90 %, so differences of two samples' gradients are
*approximately* sparser than any sample's, and only *exact* zeros separate the two.  We therefore keep
SPEAR's exact kernel step and only choose its rows better, in the spirit of SPEAR++'s guided search:
every row j of ∂L/∂W divided by ∂L/∂b_j is a weighted mean of the samples active on neuron j (exactly a
sample when the neuron is exclusive, Pan et al. 2022), so its pre-activations W x̂ + b predict where some
sample is surely inactive; the kernel of L on the k rows of most negative margin, for k in a grid from
1.5 B to 8 B (fewest first, until B are selected), is a proposal.  Proposals are then kept only when (filter) L q vanishes exactly
(relative ``zero_tol``) on a set whose kernel is one-dimensional and is not lifted by one stray row alone —
a mixture of two samples has their common zeros plus at most a few stray ones; the kernel is re-solved on
the whole zero set (hundreds of rows).  Greedy selection takes them by number of zeros, skipping any in the
span of those taken (a mixture comes after both of its samples: it has fewer zeros than either).  When
fewer than B are found, the missing columns are completed with the best rejected proposals, the batch
X̂ = Q̂⁻¹R solved, and its rows become new candidate inputs (``rounds`` times).

Certificates (per sample, :func:`~leakbench.attacks.sparse_span.certify`): the recovered x̂_i's own
activation pattern reproduces the zero pattern of δ̂_i (SPEAR's sparsity matching), and Δ̂ᵀX̂ reproduces
∂L/∂W on the rows where i is active and Δ̂ᵀ1 reproduces ∂L/∂b (relative ``tol``).  With all B columns of
Q the residuals vanish for *any* Q (L Q Q⁻¹ R = L R), so here the pattern test carries the certificate:
a wrong column mixes samples, whose activation patterns then contradict their gradients' zeros.  ``confidence`` is 1.0 for certified samples and 0.0
otherwise (0/1 flags, so :func:`leakbench.metrics.compare` matches exact slots first).  Labels are read by
matching each δ̂_i with the gradient at Z that the rest of the model gives for x̂_i and each class.

Limits, said in ``trace``: the batch's inputs must be linearly independent (rank ∂L/∂W = B).  Images
that live in a subspace of dimension < B (e.g. 8×8 digits upsampled, ~55 dimensions) make ∂L/∂W rank-
deficient; then no sample's δ_i lies in the observed span unless the sample is outside every linear
dependency of the batch, and the others come back as least-squares estimates with confidence 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import expect
from ...losses import get_loss
from ...models.matrices import layer_chain
from ...threat import Observation
from ..analytic import analytic_reasons, chain_or_reason
from ..base import Attack, Reconstruction, register
from ..observed import attacker_model, layer_gradients, param_index
from ..sparse_span import certify, decompose, directions_from_inputs, exact_zeros, refine, scales, strays, unique_columns

__all__ = ["Spear", "SpearOptions"]

#: rows of L whose kernel is proposed, as multiples of the rank (Theorem 3.3 needs ≥ B − 1 of them).
ROW_FACTORS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
#: at most this many rows per kernel (bounds the cost at large B: K candidates × rows × B²).
MAX_ROWS = 512
#: scales at which a completed (not yet exact) sample is re-proposed, both signs.
SCALES = torch.cat([torch.logspace(-0.7, 0.7, 15), -torch.logspace(-0.7, 0.7, 15)]).double()
#: a zero of a noised gradient is below this many times its noise level (σ_{B+1}/σ_1 of ∂L/∂W).
NOISE_ZEROS = 10.0


@dataclass
class SpearOptions:
    """Tolerances and budgets of ``spear`` (0 = derived from the observation's precision)."""

    #: singular values below rcond·σ_max count as zero when reading the rank of ∂L/∂W.
    rcond: float = 0.0
    #: entries of L q below zero_tol·max|L q| are exact zeros (float32: ≈ 2e-6).
    zero_tol: float = 0.0
    #: a kernel direction is one whose singular value is below null_tol·σ_max.
    null_tol: float = 0.0
    #: relative residual of ∂L/∂W and ∂L/∂b a certified sample leaves.
    tol: float = 0.0
    #: at most this many rows of the gradient serve as candidate inputs per round.
    candidates: int = 1024
    #: rounds of completing Q with the best rejected proposals and re-proposing from the solved batch.
    rounds: int = 4

    def check(self) -> None:
        for name in ("rcond", "zero_tol", "null_tol", "tol"):
            value = getattr(self, name)
            expect(0 <= value < 1, f"expected 0 ≤ {name} < 1 (0 = automatic), got {value} (option {name})")
        expect(self.candidates >= 1, f"expected candidates ≥ 1, got {self.candidates} (option candidates)")
        expect(self.rounds >= 0, f"expected rounds ≥ 0, got {self.rounds} (option rounds)")


def _tolerances(o: SpearOptions, dtype: torch.dtype) -> tuple[float, float, float, float]:
    """rcond, zero_tol, null_tol, tol from the options, or from the precision the gradient was computed in."""
    eps = torch.finfo(dtype).eps
    return (o.rcond or max(8 * eps, 1e-12), o.zero_tol or max(16 * eps, 1e-7), o.null_tol or max(64 * eps, 1e-6),
            o.tol or max(1000 * eps, 1e-9))


@register
class Spear(Attack):
    """SPEAR: exact batch recovery from a ReLU linear layer's low-rank, sparse weight gradient (+ certificates)."""

    name = "spear"
    Options = SpearOptions
    presets = {"quick": {"rounds": 2}}

    def requirements(self, obs: Observation) -> list[str]:
        reasons = analytic_reasons(obs, attack=self.name, batch_one=False)
        chain, why = chain_or_reason(obs)
        if chain is None:
            return reasons + [why]
        first = chain.blocks[0]
        if first.kind != "linear":
            return reasons + [f"spear needs a fully connected first layer; {first.name!r} is a convolution"]
        if first.act != "relu":
            reasons.append(f"spear needs a ReLU after the first linear layer {first.name!r}; got {first.act!r}")
        index = param_index(obs)
        if id(first.layer.weight) not in index:
            reasons.append(f"spear needs the weight gradient of the first linear layer {first.name!r}")
        if first.layer.bias is None or id(first.layer.bias) not in index:
            reasons.append(f"spear needs the bias gradient of the first linear layer {first.name!r} to fix the "
                           "samples' scales (a layer with bias, its gradient shared)")
        out_f, in_f = first.layer.weight.shape
        if obs.batch_size > min(out_f, in_f):
            reasons.append(f"batch {obs.batch_size} exceeds the rank of {first.name!r}'s gradient "
                           f"(at most min({out_f} neurons, {in_f} inputs) = {min(out_f, in_f)})")
        elif obs.batch_size >= 2 and out_f < 2 * obs.batch_size:
            reasons.append(f"spear needs at least 2·B = {2 * obs.batch_size} neurons in {first.name!r} "
                           f"(each sample's zeros must fix its direction); got {out_f}")
        return reasons

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        o = self.options
        rcond, zero_tol, null_tol, tol = _tolerances(o, obs.dtype)
        chain = layer_chain(obs.model, obs.input_shape)
        first = chain.blocks[0]
        grad_w, grad_b = layer_gradients(obs, first.layer, obs.gradients, param_index(obs))
        weight = first.layer.weight.detach().double()
        bias = first.layer.bias.detach().double()
        batch = obs.batch_size
        dec = decompose(grad_w, batch, rcond)
        rank = dec.rank
        trace: dict = {"rank": rank, "spectrum": dec.spectrum[: batch + 1].tolist(), "rounds": 0}
        if dec.spectrum.numel() > batch and float(dec.spectrum[0]) > 0:
            # a noised gradient's zeros sit at the noise level: the first singular value past B measures it
            noise = float(dec.spectrum[batch] / dec.spectrum[0])
            zero_tol, null_tol = max(zero_tol, NOISE_ZEROS * noise), max(null_tol, NOISE_ZEROS * noise)
            trace["noise_level"] = noise
        trace["zero_tol"] = zero_tol
        lo, hi = obs.data_range
        images = torch.full((batch, weight.shape[1]), (lo + hi) / 2, dtype=torch.float64, device=obs.device)
        certified = torch.zeros(batch, dtype=torch.bool, device=obs.device)
        if rank < batch:
            trace["rank_deficient"] = (f"∂L/∂W has rank {rank} < batch {batch}: the inputs are linearly dependent, "
                                       "so samples inside a dependency cannot be separated (Theorem 3.2 needs rank B)")
        if rank == 0:
            return self._result(obs, images, certified, None, trace)
        left, right = dec.left, dec.right
        live = ~exact_zeros(grad_w.norm(dim=1, keepdim=True), zero_tol)[:, 0]   # neurons some sample activates
        found = torch.zeros(rank, 0, dtype=torch.float64, device=obs.device)
        spare = torch.zeros(rank, 0, dtype=torch.float64, device=obs.device)
        inputs = self._row_inputs(grad_w, grad_b, live, o.candidates)
        selected = found
        # a rank-deficient batch has no exact columns to complete or repair: one pass finds the samples outside
        # every dependency (if any), further rounds would only spend time
        last = o.rounds if rank == batch else 0
        for round_ in range(last + 1):
            trace["rounds"] = round_ + 1
            for factor in ROW_FACTORS:  # fewest rows first; stop as soon as B directions are selected
                rows = min(max(int(factor * rank), rank - 1), int(live.sum()), MAX_ROWS)
                if rows < max(rank - 1, 1):
                    continue
                q, ok = directions_from_inputs(left, weight, bias, inputs, rows=rows, null_tol=null_tol, live=live)
                exact, _, single = refine(left, q, zero_tol=zero_tol, null_tol=null_tol, stray=strays(rank))
                keep = ok & single
                found = torch.cat([found, exact[:, keep]], 1)
                found = found[:, unique_columns(found)]
                spare = torch.cat([spare, q[:, ~keep]], 1)
                if selected.shape[1] < rank:  # once B are selected, new directions only enter by repair swaps
                    selected = self._select(left, found, zero_tol)
                if selected.shape[1] >= rank and round_ == 0:  # later rounds have few candidates: try every k
                    break
            spare = spare[:, exact_zeros(left @ spare, 1e-3).sum(0).argsort(descending=True)[: 4 * rank]]
            disagree = None
            if selected.shape[1] >= rank and rank == batch:
                selected, swapped = self._repair(left, right, weight, bias, grad_b, selected, found, zero_tol)
                trace["swaps"] = trace.get("swaps", 0) + swapped
                disagree = self._disagreements(left, right, weight, bias, grad_b, selected, zero_tol)
            missing = rank - selected.shape[1] if disagree is None else int((disagree > 0).sum())
            if progress is not None:
                progress(round_ + 1, last + 1, float(missing))
            if missing == 0 or round_ == last:
                break
            completed = self._complete(left, selected, spare)
            s, _ = scales(left, completed, grad_b)
            solved = torch.linalg.solve(completed, right) / s[:, None]
            # rows of Q̂⁻¹ for the completed columns lie in the span of the missing samples' dual vectors (exactly
            # so when one is missing), those of disagreeing samples near their sample; the scale of either rests on
            # wrong columns: try each at a grid of scales
            redo = solved[selected.shape[1]:] if disagree is None else solved[disagree > 0]
            inputs = (SCALES.to(redo)[:, None, None] * redo[None]).reshape(-1, redo.shape[1])
            inputs = inputs[torch.isfinite(inputs).all(1)]
        trace["found"] = int(selected.shape[1])
        q_full = self._complete(left, selected, spare)
        s, bias_fit = scales(left, q_full, grad_b)
        x_hat = torch.linalg.solve(q_full, right) / s[:, None]
        deltas = (left @ q_full * s[None, :]).T
        trace["bias_residual"] = bias_fit
        if not torch.isfinite(x_hat).all():
            trace["failed"] = "the selected directions were singular; nothing certified"
            return self._result(obs, images, certified, None, trace)
        cert = certify(x_hat, deltas, weight, bias, grad_w, grad_b, zero_tol=zero_tol, tol=tol)
        exact = cert.certified & (torch.arange(rank, device=obs.device) < selected.shape[1])
        images[:rank] = torch.where(exact[:, None], x_hat, x_hat.clamp(lo, hi))
        certified[:rank] = exact
        trace.update({"gradient_residual": cert.gradient_residual, "pattern_mismatch": cert.pattern_mismatch.tolist(),
                      "sample_residual": cert.residual.tolist()})
        labels = self._labels(obs, chain, images[:rank], deltas)
        return self._result(obs, images, certified, labels, trace)

    @staticmethod
    def _row_inputs(grad_w: torch.Tensor, grad_b: torch.Tensor, live: torch.Tensor, limit: int) -> torch.Tensor:
        """Row j of ∂L/∂W over ∂L/∂b_j: a weighted mean of the samples active on neuron j (those with the
        largest |∂L/∂b_j| first, at most ``limit``)."""
        usable = (live & (grad_b != 0)).nonzero().flatten()
        order = grad_b[usable].abs().argsort(descending=True)[:limit]
        rows = usable[order]
        return grad_w[rows] / grad_b[rows, None]

    @staticmethod
    def _select(left: torch.Tensor, found: torch.Tensor, zero_tol: float) -> torch.Tensor:
        """SPEAR's greedy selection: most exact zeros first, skipping directions in the span of those taken."""
        if found.shape[1] == 0:
            return found
        zeros = exact_zeros(left @ found, zero_tol).to(found.dtype)
        counts = zeros.sum(0)
        # a mixture of samples is zero on their common zeros plus a few stray rows: drop a direction whose zeros
        # lie, but for a few stray rows, inside the zeros of a sparser one (two samples' zero sets differ far more)
        shared = zeros.T @ zeros
        dominated = ((counts[:, None] - shared <= strays(found.shape[0])) & (counts[None, :] > counts[:, None])).any(1)
        found, counts = found[:, ~dominated], counts[~dominated]
        found, counts = found[:, ~Spear._pair_mixtures(found, counts)], counts[~Spear._pair_mixtures(found, counts)]
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

    @staticmethod
    def _disagreements(left: torch.Tensor, right: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       grad_b: torch.Tensor, cols: torch.Tensor, zero_tol: float,
                       proj: torch.Tensor | None = None) -> torch.Tensor:
        """Per column of Q̂: neurons where the solved sample's activity (clear of the hinge) contradicts the zeros
        of its gradient L q̂ (SPEAR's sparsity matching); m for every sample when Q̂ is singular."""
        proj = right @ weight.T if proj is None else proj
        s, _ = scales(left, cols, grad_b)
        z = torch.linalg.solve(cols, proj) / s[:, None] + bias
        if not torch.isfinite(z).all():
            return torch.full((cols.shape[1],), weight.shape[0], device=cols.device)
        clear = z.abs() > zero_tol * z.abs().amax(1, keepdim=True)
        return (((z > 0) == exact_zeros(left @ cols, zero_tol).T) & clear).sum(1)

    @staticmethod
    def _repair(left: torch.Tensor, right: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                grad_b: torch.Tensor, selected: torch.Tensor, found: torch.Tensor, zero_tol: float,
                rounds: int = 2, limit: int = 16) -> tuple[torch.Tensor, int]:
        """Swap selected directions for other found ones while that makes more samples' activation patterns agree
        with their gradients' zeros (SPEAR's greedy step scored by sparsity matching).

        A wrong column (a sparse vector that is no sample's, e.g. one vanishing on the neurons every sample
        activates) mixes the samples it combines; only their patterns break, so the culprit is among the columns
        of the samples that disagree.  Each trial costs one B×B solve and B·m comparisons (X̂Wᵀ = Q̂⁻¹(RWᵀ)/s).
        """
        def disagreements(cols: torch.Tensor) -> torch.Tensor:
            return Spear._disagreements(left, right, weight, bias, grad_b, cols, zero_tol, proj=proj)

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

    @staticmethod
    def _pair_mixtures(found: torch.Tensor, counts: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
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

    @staticmethod
    def _complete(left: torch.Tensor, selected: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
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

    @staticmethod
    def _labels(obs: Observation, chain, inputs: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor | None:
        """Per sample, the class whose gradient at Z (the rest of the model on x̂_i) best reproduces δ̂_i."""
        if obs.num_classes < 2 or obs.loss not in ("ce", "mse"):
            return None
        model = attacker_model(obs)
        first = layer_chain(model, obs.input_shape).blocks[0]
        rest = nn.Sequential(*layer_chain(model, obs.input_shape).modules[first.start + 1:])
        loss_fn = get_loss(obs.loss)
        n = inputs.shape[0]
        with torch.no_grad():
            z = (inputs @ first.layer.weight.detach().double().T + first.layer.bias.detach().double())
        rest = rest.double()
        errors = []
        for cls in range(obs.num_classes):
            zc = z.clone().requires_grad_(True)
            target = torch.full((n,), cls, dtype=torch.long, device=z.device)
            loss = loss_fn(rest(zc), target) * n / obs.batch_size
            (grad,) = torch.autograd.grad(loss, zc)
            errors.append((grad - deltas).norm(dim=1) / deltas.norm(dim=1).clamp_min(1e-300))
        labels = torch.stack(errors, 1).argmin(1)
        out = torch.zeros(obs.batch_size, dtype=torch.long, device=obs.device)
        out[:n] = labels
        return out

    @staticmethod
    def _result(obs: Observation, images: torch.Tensor, certified: torch.Tensor, labels, trace: dict
                ) -> Reconstruction:
        trace["certified"] = certified.tolist()
        return Reconstruction(images=images.reshape(obs.batch_size, *obs.input_shape).to(obs.dtype), labels=labels,
                              confidence=certified.to(obs.dtype), trace=trace)
