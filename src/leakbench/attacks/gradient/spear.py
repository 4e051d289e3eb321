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

Shared kernels (ours).  On similar images a candidate's most negative rows are often inactive for several samples
at once: the kernel of L there is a-dimensional (2 ≤ a ≤ ``spear_factorise.SPLIT``), span{q_i : i inactive on
every picked row}, and SPEAR's filter rejects it.  Restricted to that kernel V, L V is the layer gradient of
those a samples alone (the dual rows of every other sample vanish on V), so Pan et al.'s exclusivity only has to hold among the a:
rows active for one of them alone are parallel, one group per sample, and each q_i is the kernel of the other
groups (:func:`~leakbench.attacks.solvers.sparse_span.separate`).  Those proposals pass the same filter, refinement
and selection as the others, and a proposal must vanish on more rows than it was read from (plus the dead ones
and r/8): a kernel of rows that do not span vanishes on little more.

SPEAR's certificates (per sample, :func:`~leakbench.attacks.solvers.sparse_span.certify`): the recovered x̂_i's own
activation pattern reproduces the zero pattern of δ̂_i (SPEAR's sparsity matching), and Δ̂ᵀX̂ reproduces
∂L/∂W on the rows where i is active and Δ̂ᵀ1 reproduces ∂L/∂b (relative ``tol``).  With all B columns of
Q the residuals vanish for *any* Q (L Q Q⁻¹ R = L R), so here the pattern test carries the certificate:
a wrong column mixes samples, whose activation patterns then contradict their gradients' zeros.  A right
pattern does not make a precise sample: on similar images Q̂ is ill-conditioned and X̂ = Q̂⁻¹R/s amplifies
round-off (measured on CIFAR-10 at B = 64: pattern-certified samples 2e-4 to 4e-3 off).  So a sample is
certified only when its estimated error — row i of Q̂⁻¹ times σ_{B+1} of the gradient, plus the change of x̂_i
when every direction is re-solved from half of its zero rows — is at most ``PRECISION`` of the data range
(the estimate ran ~10× above the error of exact samples, and above that of the imprecise ones).  Imprecise
ones are subtracted provisionally (they drive later passes, which are then not certified on their own).  ``confidence`` is 1.0 for certified samples and 0.0
otherwise (0/1 flags, so :func:`leakbench.metrics.compare` matches exact slots first).  Labels are read by
matching each δ̂_i with the gradient at Z that the rest of the model gives for x̂_i and each class.

Beyond rank B — peeling (``leakbench.attacks.solvers.peeling``).  SPEAR's factorisation needs rank ∂L/∂W = B, i.e.
linearly independent inputs; 28×28 digits are 8×8 images upsampled and 64 of them span ~53 dimensions, so no
column of Q is exact there.  The attack therefore runs, in turn until neither certifies anything new:

1. peeling: every row j of the residual gradient proposes x̂ = ∂W_j/∂b_j (exact when neuron j is exclusive to
   one sample, Pan et al. 2022, eq. 6); it is certified when the rest of the model (known W, b and later
   layers) gives δ(x̂, y)_j = s·∂b_j for exactly one label y, at the precision the row carries (its float
   round-off and the observation's noise floor σ_{B+1}/(√m + √n), propagated through every subtraction), and
   x̂ lies in the data range; s is 1, or the one factor a clipped gradient shows on every exclusive row.  The
   sample's exact contribution δ(x̂, y) x̂ᵀ is subtracted, so neurons it shared with one other sample become
   exclusive to that one;
2. SPEAR (above) on the residual, whose batch is the samples not yet peeled (its rank equals their number
   once enough have left); what it certifies is subtracted too.

When every sample is found, or the certified ones and SPEAR's uncertified estimates make up the batch, the
whole batch is re-solved jointly: Gauss–Newton on ‖[∂L/∂W, ∂L/∂b] − Δ(X)ᵀ[X, 1]‖ through δ(X) and the labels
(``solvers.joint_fit``, ours), and the result kept only when it reproduces ∂L/∂W and ∂L/∂b to ``tol`` (a joint
certificate; with B ≤ m and Δ of full column rank no other batch gives the same first-layer gradient, Pan et al.'s
Theorem 2 with a zero-dimensional invariant space).  The residual bounds the batch, not a sample whose δ is tiny,
so each sample is then certified to its own precision: X re-solved from the even and from the odd rows apart
(``joint_fit.split_precision``, ``JOINT_HEADROOM``, ``trace["joint_imprecise"]``).

Large B — the span test (ours).  When ∂L/∂W has rank B and σ_{B+1} is round-off (linearly independent inputs,
undefended), the residual's column space S (m×r, inside the SVD's L, r = samples left) holds every remaining δ_i,
so a row's candidate x̂ with label y is tested by δ(x̂, y) ∈ S (m − r equations, ``SPAN_TOL``) instead of the one
scalar δ(x̂, y)_j = ∂b_j; rows whose round-off bound is above ``GATE`` then propose too, and their samples are
subtracted *provisionally*.  After a pass with provisional samples, all k found so far are re-solved by least
squares with the unknown rest, [Δ̂_Fᵀ S][X_F; Y] = ∂L/∂W, Δ̂_F recomputed from X̂_F (``_refine_found``), so their
errors do not pile up in the rows later passes read.  From the first provisional subtraction on nothing is
certified on its own (a re-solve at global round-off still left one sample 6e-4 off at B = 128): the batch is
certified only by the joint certificate once all B are found.

The whole gradient (ours).  When peeling and SPEAR on the residual stall with samples missing, the residual
carries the error of provisional subtractions and its zeros are no longer exact; the whole gradient's are.  SPEAR
then runs once more on the whole gradient (``trace["complete"]``, a budget of its own ``seconds``), every sample
found so far proposing first (its own direction, and the kernels it shares with the similar samples still
missing), then every earlier pass's estimates X̂, certified or not (a residual pass may find every direction and
still certify little: its zeros carry the subtractions' error).  With all B directions X = Q⁻¹R/s is exact, and the
batch is kept only under the joint certificate.
Re-solves of the found samples (``_refine_found``) hold the certified ones fixed.

The next layer (ours; option ``next_layer``).  When a linear layer W₂ follows the attacked ReLU layer, a sample's
column of ∂L/∂Z is g_i = D_i ⊙ W₂ᵀv_i (v_i = ∂L/∂z₂, m₂ numbers): every neuron satisfies L_j q = 0 or
L_j q = W₂[:, j]ᵀv.  :mod:`~leakbench.attacks.solvers.next_layer` solves that from the candidates' activation
patterns, re-assigning each neuron to the equation it fits until the pattern is stable, first without the least
certain neurons; it proposes before SPEAR's row subsets in every factorisation (whenever m ≥ 2(B + m₂)), and its
directions pass the same refinement, sparsity filter and certificates.  Once some directions are found its starts
are the rows of the gradient projected off their ∂L/∂z columns: weighted means of the missing samples only
(``spear_search.deflated_rows``).  Measured on digits-like batches where the kernels of similar samples stall
(docs/analytic.md).

The gradient's own error (ours).  At B = 256 an exact direction's zeros in L q̂ sit above the relative ``zero_tol``;
the pattern test counts an inactive neuron as contradicted only above ``sparse_span.zero_band`` (16 standard errors
of L's first-order error E V Σ⁻¹, E read from σ_{k>B}), and a sample at a neuron's hinge within its precision takes
the side the gradient fits when the whole batch is polished (``solvers.hinge``, ``trace["hinge_flips"]``).

Limits, said in ``trace``: ``rank`` and ``rank_deficient`` (SPEAR alone would stop there), ``passes`` (how many
each pass peeled and SPEAR certified), ``unrecovered`` (samples that share every neuron with another and sit
inside a linear dependency: neither route separates them; they come back as SPEAR's least-squares estimates,
or the data-range centre, with confidence 0), ``time_budget`` (option ``seconds``).  A noised gradient's rows
carry its noise: no row is precise enough to certify, and SPEAR's tolerance (30 ulps) withholds its
certificates, so noise never earns a certificate (tests), though the estimates may still be close.

Several local steps (FedAvg's client; ours, the issue's "SPEAR FedAvg extension").  The shared update after k
full-batch SGD steps of size η, divided by −ηk, gives the first layer Ḡᵀ X with Ḡ = (1/k) Σ_t Δ_t: still rank B in
the same inputs X, its bias part still Ḡᵀ 1, and ḡ_i still zero wherever sample i stayed inactive through all k
steps (most of the neurons it never activated at θ_0 for a small η).  SPEAR's factorisation and scale recovery
therefore hold unchanged and X̂ = Q̂⁻¹R/s is exact for right directions.  What no longer holds is every one-step test
(δ(x̂, ŷ) at θ_0 against a row or a span: peeling's proposals are exact on exclusive rows, but their certificate is
not), so the batch is then certified only as a whole, by replaying the client's k steps on (X̂, ŷ) from θ_0 and
comparing every shared tensor with the update (:mod:`~leakbench.attacks.solvers.local_replay`, after the one
positive factor a clipped update carries).  Labels are
read at θ_0 and, when the replay misfits, the least certain are tried at their second-best class.  The replay
proves the samples and labels right (``local_replay.REPLAY_TOL``), not precise: a sample is certified when, besides, SPEAR's
precision estimate from Q̂'s conditioning is within ``PRECISION`` of the data range, as on one step.  Minibatch epochs
are factorised the same way (the update is still rank B), but their replay needs each sample's slot, which the
factorisation does not give: those estimates are never certified, and ``trace["uncertified"]`` says why.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from ...models.matrices import layer_chain
from ...threat import Observation
from ..solvers.analytic import analytic_reasons, chain_or_reason
from ..solvers.linalg import lstsq
from ..base import Attack, Reconstruction, register
from ..observed import attacker_model, layer_gradients, param_index
from ..solvers.joint_fit import fit_batch, misfit, split_precision
from ..solvers.local_replay import replay_certificate
from ..solvers.spear_options import SpearOptions
from ..solvers.peeling import (UPDATE_ULPS, Residual, SampleGradients, candidate_scale, peel_pass, residual_span,
                               update_floor)
from ..solvers.spear_factorise import PRECISION, WHOLE_FACTORS, factorise

__all__ = ["Spear", "SpearOptions"]

#: ulps of the observation's dtype a peeled row's round-off bound starts at.
PEEL_ULPS = 4.0
#: at most this many earlier estimates start the whole-gradient pass (found samples first)
MAX_GUESSES = 4096
#: on an update of several local steps a sample is certified only when its precision estimate is this many times
#: below ``PRECISION`` (the estimate reached 1.2× the true error there; on one-step gradients it runs ~10× above)
LOCAL_HEADROOM = 3.0
#: the joint certificate certifies a sample when its split precision (``joint_fit.split_precision``) is this many
#: times below ``PRECISION``: the split ran at 0.24–2.9× the true error (trained mlp:2000, B = 256, the fitted batch)
JOINT_HEADROOM = 4.0
#: the found samples' joint re-solve is kept when it reproduces ∂L/∂W to this many times the round-off bound.
REFINED = 30.0


def _tolerances(o: SpearOptions, dtype: torch.dtype) -> tuple[float, float, float, float]:
    """rcond, zero_tol, null_tol, tol from the options, or from the precision the gradient was computed in."""
    eps = torch.finfo(dtype).eps
    return (o.rcond or max(8 * eps, 1e-12), o.zero_tol or max(16 * eps, 1e-7), o.null_tol or max(64 * eps, 1e-6),
            o.tol or max(30 * eps, 1e-9))


def _next_weight(chain) -> torch.Tensor | None:
    """W₂ of a linear layer right after the attacked ReLU layer (its outputs reach W₂ only through the ReLU)."""
    if len(chain.blocks) < 2 or chain.blocks[0].act != "relu" or chain.blocks[1].kind != "linear":
        return None
    return chain.blocks[1].layer.weight.detach()


def _deadline(seconds: float) -> float:
    """``time.perf_counter()`` after which SPEAR's rounds stop (option ``seconds``; 0 = none)."""
    return time.perf_counter() + seconds if seconds else float("inf")


@register
class Spear(Attack):
    """SPEAR: exact batch recovery from a ReLU linear layer's low-rank, sparse weight gradient (+ certificates)."""

    name = "spear"
    tags = ("gradient", "update")
    Options = SpearOptions
    presets = {"quick": {"rounds": 2}}
    preset_revisions = {"default": 7, "quick": 7}  # 1: peeling, precision-gated certificates, option seconds;
    # 2: updates of several local steps (replay certificate), an update's storage round-off in the row bounds;
    # 3: shared kernels split, SPEAR on the whole gradient when the residual stalls; 4: directions from the next
    # linear layer's structure (option next_layer); 5: its starts deflated off the directions found, and the
    # whole-gradient pass started from every pass's estimates; 6: the pattern test's zeros within the gradient's
    # error (sparse_span.zero_band), neurons at a sample's hinge set by the gradient (solvers.hinge); 7: zeros
    # within that error in refinement, selection and the next layer's acceptance; the joint fit by Gauss–Newton,
    # each sample certified to its split precision (solvers.joint_fit)

    def requirements(self, obs: Observation) -> list[str]:
        reasons = analytic_reasons(obs, attack=self.name, batch_one=False, several_steps=True)
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
        self._deadline = _deadline(o.seconds)
        chain = layer_chain(obs.model, obs.input_shape)
        first = chain.blocks[0]
        self._next_weight = _next_weight(chain) if o.next_layer else None
        grad_w, grad_b = layer_gradients(obs, first.layer, obs.gradients, param_index(obs))
        weight = first.layer.weight.detach().double()
        bias = first.layer.bias.detach().double()
        batch = obs.batch_size
        spectrum = torch.linalg.svdvals(grad_w)
        trace: dict = {"spectrum": spectrum[: batch + 1].tolist(), "rounds": 0, "passes": []}
        noise = 0.0
        if spectrum.numel() > batch and float(spectrum[0]) > 0:
            # singular values past B are noise (or round-off): σ_{B+1} ≈ s(√m + √n) for entries of std s
            trace["noise_level"] = float(spectrum[batch] / spectrum[0])
            noise = float(spectrum[batch]) / (grad_w.shape[0] ** 0.5 + grad_w.shape[1] ** 0.5)
        rank = int((spectrum > rcond * spectrum[0]).sum()) if float(spectrum[0]) > 0 else 0
        # a full-rank gradient whose σ_{B+1} is round-off (below rcond·σ_1): every remaining sample's δ lies in the
        # residual's column span, a test of m − r equations that lets peeling use rows too imprecise to certify on
        # their own (see peel_pass); the round-off is then relative to each row (its own bound, eps·‖row‖) — the
        # even floor σ_{B+1}/(√m + √n) buried the rows of small samples (at B = 128 on CIFAR-10 every exclusive row
        # sat at 2–5e-5, above the gate, with a true error of 1e-6)
        spanned = rank >= batch and spectrum.numel() > batch and float(spectrum[batch]) <= rcond * float(spectrum[0])
        left = torch.linalg.svd(grad_w, full_matrices=False)[0][:, :batch] if spanned else None
        if spanned:
            noise = 0.0
        trace.update({"rank": min(rank, batch), "gradient_norm": float(grad_w.norm())})
        if rank < batch:
            trace["rank_deficient"] = (f"∂L/∂W has rank {rank} < batch {batch}: the inputs are linearly dependent; "
                                       "SPEAR's factorisation (Theorem 3.2) needs rank B, peeling does not")
        if obs.kind == "update" and obs.local_steps > 1:
            return self._run_local(obs, chain, grad_w, grad_b, weight, bias, (rcond, zero_tol, null_tol, tol), trace)
        grads = self._sample_gradients(obs, chain)
        lo, hi = obs.data_range
        res = Residual.start(grad_w, grad_b, PEEL_ULPS * torch.finfo(obs.dtype).eps, noise,
                             update_floor(obs, weight, bias, UPDATE_ULPS))
        scale = candidate_scale(res, grads, obs.data_range) if grads is not None else None
        trace["scale"] = scale
        estimates = None       # SPEAR's last (uncertified) estimates of the samples it could not certify
        tainted = False        # a provisional (imprecise) sample was subtracted: later finds are not certified alone
        guesses: list[torch.Tensor] = []   # every pass's X̂ (certified or not): starts for the whole-gradient pass
        for _ in range(batch + 1):  # each round certifies at least one sample, or stops
            before = res.count
            if scale is not None:
                self._peel(res, grads, scale, obs.data_range, batch, left, certified=not tainted,
                           refine=(grad_w, grad_b), trace=trace)
            peeled = res.count - before
            remaining = batch - res.count
            trace["passes"].append({"peeled": peeled})
            if progress is not None:
                progress(res.count, batch, float(remaining))
            if remaining == 0:
                break
            x_hat, deltas, found, precise, info = factorise(
                res.grad_w, res.grad_b, weight, bias, remaining, (rcond, zero_tol, null_tol, tol), obs.device, hi - lo,
                options=o, deadline=self._deadline, next_weight=self._next_weight)
            trace["passes"][-1].update({"spear": int((found & precise).sum()) if x_hat is not None else 0, **info})
            trace["rounds"] += info.get("rounds", 0)
            if x_hat is None:
                break
            guesses.append(x_hat[torch.isfinite(x_hat).all(1)])
            estimates = (x_hat[~found], deltas[~found])
            if not bool(found.any()):
                break
            labels = self._labels_of(grads, x_hat[found], deltas[found], obs)
            # a residual that carries a provisional peel carries its error too: SPEAR's per-sample precision
            # estimate sees only the residual's spectrum, not that error (measured: digits-like B = 128, one BLAS
            # thread, 44 samples pattern-certified and "precise" after provisional peels, 3e-4 to 1e-2 off)
            tainted = tainted or res.provisional
            # a pattern-certified sample that is not precise is subtracted provisionally (it drives the next passes);
            # after it the residual carries its error, so nothing found later is certified on its own
            for x_i, y_i, d_i, ok in zip(x_hat[found], labels.tolist(), deltas[found], precise[found].tolist()):
                res.subtract(x_i, int(y_i), d_i, "spear" if ok and not tainted else "spear (provisional)",
                             certified=ok and not tainted)
            tainted = tainted or not bool(precise[found].all())
            if scale is None and grads is not None:
                scale = self._scale_from(grads, x_hat[found], labels, deltas[found])
                trace["scale"] = scale
            estimates = None
        if res.count == batch and not all(res.certified) and grads is not None:
            res = self._joint(res, grads, None, obs, trace, newton=not spanned)   # all found, some provisionally
        # a batch found whole but not certified (provisional peels the joint certificate refuses: a trained model's
        # residual) is re-solved from the whole gradient too, every found sample proposing first
        if (res.count < batch or not all(res.certified)) and spanned and grads is not None and scale is not None:
            res, estimates = self._complete(obs, grad_w, grad_b, weight, bias, res, estimates, grads,
                                            (rcond, zero_tol, null_tol, tol), trace, guesses)
        return self._assemble(obs, chain, res, estimates, grads, trace)

    def _complete(self, obs: Observation, grad_w: torch.Tensor, grad_b: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor, res: Residual, estimates, grads: SampleGradients,
                  tolerances: tuple[float, float, float, float], trace: dict, guesses: list[torch.Tensor]):
        """SPEAR on the whole gradient once peeling and the residual's SPEAR stall (ours): the residual carries the
        error of provisional subtractions (its zeros are no longer exact), the whole gradient does not.  Every
        sample found so far proposes its own direction (the kernel of L on the rows it leaves inactive) and, with the
        gradient's rows, the kernels shared with the similar samples still missing, which
        :func:`~leakbench.attacks.solvers.sparse_span.separate` tells apart.  With all B directions X = Q⁻¹R/s, and the
        batch is kept only under the joint certificate (:meth:`_joint`); otherwise nothing changes."""
        batch = obs.batch_size
        lo, hi = obs.data_range
        self._deadline = _deadline(self.options.seconds)
        # the samples found, then every pass's estimates: a residual pass whose certificate failed only for the
        # residual's inexact zeros leaves estimates next to the samples, and the whole gradient's next-layer pass
        # finds their directions from them at once (digits-like B = 256: 197 directions on a residual, 1 certified)
        starts = [torch.stack(res.inputs)] if res.count else []
        starts += [g.reshape(g.shape[0], -1).to(grad_w.dtype) for g in guesses]
        extra = torch.cat(starts)[: MAX_GUESSES] if starts else None
        x_hat, deltas, _, _, info = factorise(grad_w, grad_b, weight, bias, batch, tolerances, obs.device, hi - lo,
                                              options=self.options, deadline=self._deadline, extra=extra,
                                              factors=WHOLE_FACTORS, next_weight=self._next_weight)
        trace["complete"] = {k: v for k, v in info.items() if not isinstance(v, list)}
        if x_hat is None or info.get("found", 0) < batch:
            return res, estimates
        fresh = Residual.start(grad_w, grad_b, res.eps, 0.0, res.floor)   # spanned: σ_{B+1} is round-off
        trial = self._joint(fresh, grads, (x_hat, deltas), obs, trace)
        if trial is not fresh and sum(trial.certified) > sum(res.certified):   # the joint certificate held
            trial.how = ["spear (whole gradient)"] * batch
            return trial, None
        return res, estimates

    def _run_local(self, obs: Observation, chain, grad_w: torch.Tensor, grad_b: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, tolerances: tuple[float, float, float, float], trace: dict) -> Reconstruction:
        """An update of several local steps: SPEAR's factorisation of the averaged first-layer update, labels at
        θ_0, and the batch certified as a whole when the replay of the client's steps reproduces the update."""
        lo, hi = obs.data_range
        batch, n = obs.batch_size, grad_w.shape[1]
        images = torch.full((batch, n), (lo + hi) / 2, dtype=torch.float64, device=obs.device)
        labels = torch.zeros(batch, dtype=torch.long, device=obs.device)
        grads = self._sample_gradients(obs, chain)
        x_hat, deltas, _, _, info = factorise(grad_w, grad_b, weight, bias, batch, tolerances, obs.device, hi - lo,
                                              options=self.options, deadline=self._deadline)
        # on updates the precision estimate ran at up to 1.2× the true error (trained mlp:1000, 5 and 20 steps),
        # not ~10× above it as on gradients: the certificate asks for headroom
        precise = torch.tensor(info.get("precision", []), dtype=torch.float64, device=obs.device) <= \
            PRECISION * (hi - lo) / LOCAL_HEADROOM
        trace["passes"].append({"peeled": 0, **info})
        trace["rounds"] += info.get("rounds", 0)
        k = 0 if x_hat is None else x_hat.shape[0]
        errors = None
        if k:
            images[:k] = x_hat.clamp(lo, hi)
        if k and grads is not None:
            errors = self._label_errors(grads, images[:k], deltas, obs)
            labels[:k] = errors.argmin(1)
        cert = replay_certificate(obs, images, labels, errors, precise, found=k, deadline=self._deadline,
                                  precision=PRECISION / LOCAL_HEADROOM)
        trace.update(cert.trace)
        trace.update({"found": int(cert.certified.sum()), "how": ["spear (local steps)"] * k,
                      "local_steps": obs.local_steps})
        return self._result(obs, images, cert.certified, labels if grads is not None else None, trace)

    @staticmethod
    def _peel(res: Residual, grads: SampleGradients, scale: float, data_range: tuple[float, float], batch: int,
              left: torch.Tensor | None, *, certified: bool, refine: tuple[torch.Tensor, torch.Tensor] | None = None,
              trace: dict | None = None) -> None:
        """Peeling passes until one finds nothing (with the residual's span as the test when ``left`` is given).

        With ``left``, a pass that subtracted provisional samples is followed by :meth:`_refine_found` while
        samples remain: re-solved while the rest still dominates the residual, their errors do not pile up in
        the rows later passes read (at B = 256 on CIFAR-10 they reached 6e-3 by the end without it)."""
        while res.count < batch:
            found = peel_pass(res, grads, scale, data_range, batch - res.count, certified=certified,
                              span=None if left is None else residual_span(res, left, batch - res.count))
            if not found:
                break
            if left is not None and refine is not None and res.count < batch and not all(res.certified[-found:]):
                fit = Spear._refine_found(res, grads, scale, left, batch, *refine)
                if trace is not None:
                    trace.setdefault("refined", []).append(fit)

    @staticmethod
    def _refine_found(res: Residual, grads: SampleGradients, scale: float, left: torch.Tensor, batch: int,
                      grad_w: torch.Tensor, grad_b: torch.Tensor, steps: int = 4) -> float:
        """Re-solve the k samples found so far by least squares, with the r = B − k left unknown.

        ∂L/∂W = Δ_Fᵀ X_F + Δ_Rᵀ X_R, and the columns of Δ_Rᵀ span the residual's column space S (m×r, inside
        the original one): with Δ_F fixed, [Δ_Fᵀ S] (m×(k+r), full column rank) times [X_F; Y] = ∂L/∂W is linear
        and its least-squares solution gives X_F exactly once Δ_F and S are exact; Δ_F is recomputed from X_F
        and the labels and S from the new residual, a few times.  Kept only when the fit reproduces ∂L/∂W better
        than before; the residual's bounds are then those of round-off.  Certified samples are held fixed (their
        contribution is known): a fit at round-off of the whole gradient moved them by up to 1e-5 (relative) on a
        narrow layer, which a later exact step (the features' inversion of ``spear-features``) does not survive.
        Returns the relative misfit."""
        x_all = torch.stack(res.inputs)
        labels_all = torch.tensor(res.labels, dtype=torch.long, device=x_all.device)
        deltas_all = torch.stack(res.deltas)
        free = ~torch.tensor(res.certified, dtype=torch.bool, device=x_all.device)
        target = grad_w - deltas_all[~free].T @ x_all[~free]
        x, deltas, labels = x_all[free], deltas_all[free], labels_all[free]
        r = batch - x_all.shape[0]
        norm = float(grad_w.norm().clamp_min(torch.finfo(grad_w.dtype).tiny))
        best = float((target - deltas.T @ x).norm())
        kept = None
        for _ in range(steps if x.shape[0] else 0):
            resid = target - deltas.T @ x
            span = left @ torch.linalg.svd(left.T @ resid, full_matrices=False)[0][:, :r]
            system = torch.cat([deltas.T, span], 1)
            try:
                solved = lstsq(system, target)
            except (RuntimeError, torch.linalg.LinAlgError):
                break
            trial = solved[:x.shape[0]]
            if not bool(torch.isfinite(trial).all()):
                break
            trial_deltas = scale * grads(trial, labels)
            fit = float((target - torch.cat([trial_deltas.T, span], 1) @ torch.cat([trial, solved[x.shape[0]:]])).norm())
            if not fit < best:
                break
            best, x, deltas = fit, trial, trial_deltas
            kept = float((target - deltas.T @ x).norm())
        if kept is None or best / norm > REFINED * res.eps:
            return best / norm        # not at round-off: a found sample is off (or a pattern flipped); keep the state
        x_all[free], deltas_all[free] = x, deltas
        x, deltas = x_all, deltas_all
        res.inputs, res.deltas = list(x), list(deltas)
        res.grad_w, res.grad_b = grad_w - deltas.T @ x, grad_b - deltas.sum(0)
        # every found sample is now exact to the gradient's round-off: the bounds of a subtraction at that precision
        res.err_w = res.eps * (grad_w.norm(dim=1) + deltas.abs().T @ x.norm(dim=1))
        res.err_b = res.eps * (grad_b.abs() + deltas.abs().sum(0))
        # …yet the residual stays provisional: a fit at round-off of the whole gradient is not every sample at
        # round-off (measured at B = 128 on deformed digits: a fit of 5e-7 with one found sample 6e-4 off), so
        # only the joint certificate of the whole batch certifies what is found from here on
        return best / norm

    @staticmethod
    def _sample_gradients(obs: Observation, chain) -> SampleGradients | None:
        """δ(x, y) through the rest of a copy of the model (losses with class labels only)."""
        if obs.loss not in ("ce", "mse") or obs.num_classes < 2:
            return None
        model = attacker_model(obs)
        copy_chain = layer_chain(model, obs.input_shape)
        first = copy_chain.blocks[0]
        rest = nn.Sequential(*copy_chain.modules[first.start + 1:]).double()
        return SampleGradients(rest, first.layer.weight.detach().double(), first.layer.bias.detach().double(),
                               obs.loss, obs.batch_size, obs.num_classes)

    @staticmethod
    def _labels_of(grads: SampleGradients | None, inputs: torch.Tensor, deltas: torch.Tensor, obs: Observation
                   ) -> torch.Tensor:
        """Per sample, the class whose δ(x̂, c) is most nearly parallel to the recovered δ̂ (any global scale)."""
        if grads is None or inputs.shape[0] == 0:
            return torch.zeros(inputs.shape[0], dtype=torch.long, device=inputs.device)
        return Spear._label_errors(grads, inputs, deltas, obs).argmin(1)

    @staticmethod
    def _label_errors(grads: SampleGradients, inputs: torch.Tensor, deltas: torch.Tensor, obs: Observation
                      ) -> torch.Tensor:
        """1 − |cos| between δ̂_i and δ(x̂_i, c), per sample and class (K×C)."""
        errors = []
        unit = deltas / deltas.norm(dim=1, keepdim=True).clamp_min(1e-300)
        for cls in range(obs.num_classes):
            d = grads(inputs, torch.full((inputs.shape[0],), cls, dtype=torch.long, device=inputs.device))
            errors.append(1 - (d * unit).sum(1).abs() / d.norm(dim=1).clamp_min(1e-300))
        return torch.stack(errors, 1)

    @staticmethod
    def _scale_from(grads: SampleGradients, inputs: torch.Tensor, labels: torch.Tensor, deltas: torch.Tensor
                    ) -> float | None:
        """The global factor between recovered δ̂ and δ(x̂, y) (1 undefended, the factor of a clipped gradient)."""
        d = grads(inputs, labels)
        ratio = (d * deltas).sum(1) / d.pow(2).sum(1).clamp_min(1e-300)
        return float(ratio.median()) if bool(torch.isfinite(ratio).all()) else None

    def _assemble(self, obs: Observation, chain, res: Residual, estimates: torch.Tensor | None,
                  grads: SampleGradients | None, trace: dict) -> Reconstruction:
        """Certified samples first, then SPEAR's uncertified estimates (clamped), then the data-range centre; the
        whole batch's gradient against the observation when every sample was found."""
        lo, hi = obs.data_range
        batch, n = obs.batch_size, res.grad_w.shape[1]
        images = torch.full((batch, n), (lo + hi) / 2, dtype=torch.float64, device=obs.device)
        certified = torch.zeros(batch, dtype=torch.bool, device=obs.device)
        labels = torch.zeros(batch, dtype=torch.long, device=obs.device)
        # SPEAR's estimates complete the batch: the joint certificate (a batch found whole was tried in ``run``)
        completes = estimates is not None and res.count < batch and res.count + estimates[0].shape[0] == batch
        if grads is not None and completes:
            res = self._joint(res, grads, estimates, obs, trace)
            if res.count == batch:
                estimates = None
        k = res.count
        if k == batch and grads is not None and all(res.certified):
            self._polish(res, grads, trace, PRECISION * (hi - lo), _tolerances(self.options, obs.dtype)[3])
        if k:
            images[:k] = torch.stack(res.inputs)
            labels[:k] = torch.tensor(res.labels, dtype=torch.long, device=obs.device)
            certified[:k] = torch.tensor(res.certified, dtype=torch.bool, device=obs.device)
        if estimates is not None and estimates[0].shape[0] and k < batch:
            extra, extra_deltas = estimates[0][: batch - k], estimates[1][: batch - k]
            images[k:k + extra.shape[0]] = extra.clamp(lo, hi)
            if grads is not None:
                labels[k:k + extra.shape[0]] = self._labels_of(grads, extra.clamp(lo, hi), extra_deltas, obs)
        trace["found"] = k
        trace["how"] = res.how
        trace["gradient_residual"] = float(res.grad_w.norm()) / max(trace["gradient_norm"], 1e-300)
        if k == batch and not all(res.certified) and trace.get("joint_imprecise"):
            trace["unrecovered"] = (f"{res.certified.count(False)} of {batch} samples found but not certified: the "
                                    "batch reproduces the gradient, but their gradients are too small to pin them "
                                    "to the certified precision")
        if k < batch:
            last = trace["passes"][-1] if trace["passes"] else {}
            trace["unrecovered"] = (f"{batch - k} of {batch} samples not certified: no row of the residual gradient "
                                    "is exclusive to one of them" + (
                                        f", and its rank {last['rank']} is below their number" if
                                        "rank_deficient" in last else ""))
        return self._result(obs, images, certified, labels if grads is not None else None, trace)

    def _joint(self, res: Residual, grads: SampleGradients, estimates: tuple[torch.Tensor, torch.Tensor] | None,
               obs: Observation, trace: dict, newton: bool = True) -> Residual:
        """The certified refinement: SPEAR's uncertified estimates join the certified samples, the whole batch is
        re-solved by :meth:`_polish`, and it is kept only when it reproduces the first layer's whole gradient to
        the certification tolerance (a joint certificate: ∂L/∂W and ∂L/∂b of B samples through the model)."""
        tol = _tolerances(self.options, obs.dtype)[3]
        scale = trace.get("scale") or 1.0
        trial = Residual(res.grad_w.clone(), res.grad_b.clone(), res.err_w.clone(), res.err_b.clone(), res.eps,
                         list(res.inputs), list(res.labels), list(res.deltas), list(res.how), list(res.certified))
        if estimates is not None and estimates[0].shape[0]:
            x, spear_deltas = estimates
            if not bool(torch.isfinite(x).all() and torch.isfinite(spear_deltas).all()):
                return res
            labels = self._labels_of(grads, x, spear_deltas, obs)
            for x_i, y_i, d_i in zip(x, labels.tolist(), scale * grads(x, labels)):   # ≤ B samples
                trial.subtract(x_i, int(y_i), d_i, "joint", certified=False)
        if trial.count != obs.batch_size:
            return res
        width = obs.data_range[1] - obs.data_range[0]
        before, alone = list(trial.inputs), list(trial.certified)
        precision, trace["joint_residual"] = self._polish(trial, grads, trace, PRECISION * width, tol, newton)
        if not trace["joint_residual"] <= tol:
            return res
        # the residual bounds the batch, not a sample whose δ is tiny: each is certified to its own precision
        precise = (JOINT_HEADROOM * precision <= PRECISION * width).tolist()
        for i, (ok, own) in enumerate(zip(precise, alone)):
            if own and not ok:   # certified on its own row before: that certificate and value stand
                trial.inputs[i] = before[i]
        trial.certified = [ok or own for ok, own in zip(precise, alone)]
        trace["joint_imprecise"] = trial.certified.count(False)
        return trial

    @staticmethod
    def _polish(res: Residual, grads: SampleGradients, trace: dict, reach: float, tol: float, newton: bool = True
                ) -> tuple[torch.Tensor, float]:
        """With every sample found, the whole batch is fitted to the whole first-layer gradient: the fixed-Δ
        re-solve, then, unless that reproduces the gradient to ``tol`` (relative), Gauss–Newton
        through δ(X) (``solvers.joint_fit``); neurons within ``reach`` (max-abs, the certified precision) of a
        sample's hinge take the side the gradient fits (``solvers.hinge``).  Returns each sample's precision
        (``joint_fit.split_precision``) and the fit's relative misfit (``joint_fit.misfit``)."""
        x = torch.stack(res.inputs)
        labels = torch.tensor(res.labels, dtype=torch.long, device=x.device)
        deltas = torch.stack(res.deltas)
        target_w = res.grad_w + deltas.T @ x
        target_b = res.grad_b + deltas.sum(0)
        scale = trace.get("scale") or 1.0
        fit = fit_batch(grads, x, labels, target_w, target_b, reach, scale=scale, steps=3, newton=False)
        relative = misfit(target_w, target_b, fit.inputs, fit.deltas)
        if newton and not relative <= tol:   # for a sample with a small δ the fixed-Δ re-solve stalls
            fit = fit_batch(grads, fit.inputs, labels, target_w, target_b, reach, scale=scale)
            relative = misfit(target_w, target_b, fit.inputs, fit.deltas)
        trace.update({"joint_steps": fit.steps, "hinge_flips": fit.flipped})
        res.inputs, res.deltas = list(fit.inputs), list(fit.deltas)
        res.grad_w, res.grad_b = target_w - fit.deltas.T @ fit.inputs, target_b - fit.deltas.sum(0)
        return split_precision(fit.deltas, target_w), relative

    @staticmethod
    def _result(obs: Observation, images: torch.Tensor, certified: torch.Tensor, labels, trace: dict
                ) -> Reconstruction:
        trace["certified"] = certified.tolist()
        return Reconstruction(images=images.reshape(obs.batch_size, *obs.input_shape).to(obs.dtype), labels=labels,
                              confidence=certified.to(obs.dtype), trace=trace)
