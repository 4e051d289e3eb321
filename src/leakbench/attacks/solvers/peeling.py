"""Peeling a batch off a ReLU layer's gradient, one certified sample at a time: the rank-free half of ``spear``.

A linear layer Z = X Wᵀ + b followed by a ReLU shares ∂L/∂W = Σ_i δ_i x_iᵀ and ∂L/∂b = Σ_i δ_i (δ_i = ∂L/∂z_i,
zero wherever sample i leaves a neuron off).  Pan et al. (USENIX Security 2022, "Exploring the security boundary
of data reconstruction via neuron exclusivity analysis", Sec. 4 and the proofs' initial step): when neuron j is
activated by one sample only (an exclusively activated neuron, ExAN), row j of the gradient is δ_ij x_iᵀ and

    x_i = ∂L/∂W_j / ∂L/∂b_j                                                      (Pan et al., eq. 6)

Which rows are exclusive is not observed.  Here every row proposes a candidate, and a candidate is *certified*
by the rest of the model: with W, b and the later layers known, the per-sample gradient δ(x̂, y) of a sample x̂
with label y is computable, and an exclusive row must satisfy δ(x̂, y)_j = ∂L/∂b_j (times one global factor,
1 for an undefended gradient, the clipping factor for a clipped one).  A weighted mean of several samples
(a non-exclusive row) meets this scalar equation only by coincidence; the test is run at the precision the
row itself carries (its float round-off and the observation's noise floor, propagated through every
subtraction), the label must be the only one that passes, and the candidate must lie in the data range.

Peeling (ours; the composition of exact contributions, not in either paper): a certified sample's exact
contribution δ(x̂, y) x̂ᵀ and δ(x̂, y) is subtracted from the gradient; neurons it shared with one other
sample become exclusive to that sample, so the next pass certifies more, and the residual is the gradient of
the remaining samples only.  Nothing here needs ∂L/∂W to have rank B: it reaches batches whose inputs are
linearly dependent (e.g. digits that live in ~55 dimensions at B = 64), where SPEAR's factorisation cannot
separate them; SPEAR then runs on the residual, whose batch is smaller (``leakbench.attacks.gradient.spear``).
Every pass is batched: candidates × classes forward/backward passes through the rest of the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...losses import get_loss
from ...threat import Observation

__all__ = ["SampleGradients", "Residual", "peel_pass", "residual_span", "candidate_scale"]

#: the candidate must lie in the data range up to this fraction of its width.
RANGE_SLACK = 1e-3
#: a true row's mismatch stays below MATCH × its estimated relative error (measured: ≤ 10×).
MATCH = 30.0
#: rows whose estimated relative error exceeds this are not used (their candidate is not exact).
GATE = 1e-5
#: the second-best label must mismatch by at least this many times the tolerance.
MARGIN = 100.0
#: with the residual's span given (full rank), rows up to this estimated relative error propose candidates;
#: those above ``GATE`` are subtracted provisionally (not certified on their own).  The bound compounds through
#: every subtraction and ran 10⁴× above the true error late in a B = 128 peel (0.13 for a row 1e-5 off), so
#: the span test, not this bound, decides there.
LOOSE_GATE = float("inf")
#: with the span test, candidates this close (relative) are one sample: a second, less precise row of a sample
#: in the same pass, or the leftover of one already peeled (its subtraction is exact only to its precision) —
#: measured 6e-3 off on digits at B = 128; two samples of a batch differ by O(0.1–1).
NEAR = 2e-2
#: a candidate's own gradient δ(x̂, y) must lie in the residual's column span to this relative distance (a true
#: sample's does, to its precision; a mixture's is O(1) away: m − r equations, not one).
SPAN_TOL = 1e-3


class SampleGradients:
    """δ(x, y) = ∂ℓ(x, y)/∂z at the first layer's output, through the rest of the model (1/B of the batch loss).

    ``rest`` maps the first layer's pre-activations to the outputs (the first activation included).
    """

    def __init__(self, rest: nn.Module, weight: torch.Tensor, bias: torch.Tensor, loss: str, batch: int,
                 classes: int, chunk: int = 256):
        self.rest, self.weight, self.bias = rest, weight, bias
        self.loss_fn, self.batch, self.classes, self.chunk = get_loss(loss), batch, classes, chunk

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-sample δ (K×m) for inputs (K×n) and labels (K)."""
        return self.at_pre(inputs @ self.weight.T + self.bias, labels)

    def at_pre(self, pre: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """δ from the pre-activations (K×m) directly."""
        out = []
        for start in range(0, pre.shape[0], self.chunk):
            with torch.enable_grad():
                z = pre[start:start + self.chunk].detach().requires_grad_(True)
                loss = self.loss_fn(self.rest(z), labels[start:start + self.chunk]) * z.shape[0] / self.batch
                out.append(torch.autograd.grad(loss, z)[0])
        return torch.cat(out) if out else pre.new_zeros(0, self.weight.shape[0])

    def at_rows(self, inputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """δ(x̂_k, c)_{rows_k} for every candidate k and class c (K×C): the layer once, one backward pass of the
        rest of the model per class."""
        pre = inputs @ self.weight.T + self.bias
        cols = []
        for cls in range(self.classes):
            labels = torch.full((inputs.shape[0],), cls, dtype=torch.long, device=inputs.device)
            cols.append(self.at_pre(pre, labels).gather(1, rows[:, None])[:, 0])
        return torch.stack(cols, 1)

    def hessian_product(self, inputs: torch.Tensor, labels: torch.Tensor):
        """u ↦ H u (K×m → K×m): each sample's Hessian of its loss term with respect to its pre-activations at
        ``inputs`` (K×n), by double backward through the rest of the model (H is symmetric, so this is also
        the transpose's product).  The graph is built once and kept for every product."""
        graphs = []
        for start in range(0, inputs.shape[0], self.chunk):
            with torch.enable_grad():
                z = (inputs[start:start + self.chunk] @ self.weight.T + self.bias).detach().requires_grad_(True)
                loss = self.loss_fn(self.rest(z), labels[start:start + self.chunk]) * z.shape[0] / self.batch
                graphs.append((z, torch.autograd.grad(loss, z, create_graph=True)[0]))

        def product(u: torch.Tensor) -> torch.Tensor:
            out, start = [], 0
            for z, g in graphs:
                part = u[start:start + z.shape[0]]
                start += z.shape[0]
                h = torch.autograd.grad(g, z, grad_outputs=part, retain_graph=True, allow_unused=True)[0] \
                    if g.requires_grad else None                  # a loss linear in z: H = 0
                out.append(torch.zeros_like(part) if h is None else h)
            return torch.cat(out) if out else u.new_zeros(0, self.weight.shape[0])

        return product


#: an update's storage round-off per row, in ulps of the rows of θ (measured on mlp:1000 after one step of 0.1,
#: untrained and trained: 0.22–0.24 ulp of ‖W_j‖ against the float64 replay; 4 ulps of ‖∂W_j‖, the bound of a
#: gradient's rows, ran 10× (median) to 3 400× below it)
UPDATE_ULPS = 0.5


def update_floor(obs: Observation, weight: torch.Tensor, bias: torch.Tensor, ulps: float = UPDATE_ULPS
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An update's storage round-off in gradient units, per row of ∂W and entry of ∂b (None for a gradient).

    The client sends θ_k − θ_0 with θ_k stored in its dtype after each of k steps, so each entry carries
    ≈ √k·eps·|θ| of round-off, and the gradient read from it (÷ ηk) that over ηk: far above eps·|∂W| when the
    update is small beside the weights (measured on a trained mlp:1000, one step of 0.1: the update's first
    layer 3e-6 off relatively, 25 ulps; 4-ulp row bounds then certified samples 1e-4 to 4e-4 off)."""
    if obs.kind != "update":
        return None
    steps = obs.local_steps
    scale = ulps * torch.finfo(obs.dtype).eps * steps ** 0.5 / (obs.local_lr * steps)
    return scale * weight.norm(dim=1), scale * bias.abs()


@dataclass
class Residual:
    """The first layer's gradient minus the contributions peeled so far, and each row's absolute error bound."""

    grad_w: torch.Tensor
    grad_b: torch.Tensor
    err_w: torch.Tensor      # bound on the error of ‖row j of grad_w‖
    err_b: torch.Tensor      # bound on the error of grad_b_j
    eps: float               # relative round-off of the observation (a few ulps of its dtype)
    inputs: list[torch.Tensor] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    deltas: list[torch.Tensor] = field(default_factory=list)
    how: list[str] = field(default_factory=list)
    certified: list[bool] = field(default_factory=list)
    #: an uncertified (provisional) sample was subtracted and not yet re-solved to round-off: the rows carry its
    #: error, which the per-row bounds do not see when the sample is wrong rather than imprecise
    provisional: bool = False
    #: absolute per-row bounds (∂W row norms, ∂b entries) of round-off the observation carries besides its own
    #: (an update's storage round-off): not in the proposals' gates, only in the decision to certify
    floor: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def start(cls, grad_w: torch.Tensor, grad_b: torch.Tensor, eps: float, noise: float,
              floor: tuple[torch.Tensor, torch.Tensor] | None = None) -> Residual:
        """``noise``: the absolute per-entry noise level of the observation (0 for an exact one); ``floor``: absolute
        per-row bounds (∂W row norms, ∂b entries) the observation carries besides, as an update's storage
        round-off."""
        n = grad_w.shape[1]
        return cls(grad_w.clone(), grad_b.clone(), eps * grad_w.norm(dim=1) + noise * n ** 0.5,
                   eps * grad_b.abs() + noise, eps, floor=floor)

    @property
    def count(self) -> int:
        return len(self.inputs)

    def relative_error(self, *, floor: bool = False) -> torch.Tensor:
        """Per row, the estimated relative error of its candidate ∂W_j/∂b_j (with ``floor``: the observation's
        extra round-off as well)."""
        tiny = torch.finfo(self.grad_b.dtype).tiny
        err_w, err_b = self.err_w, self.err_b
        if floor and self.floor is not None:
            err_w, err_b = err_w + self.floor[0], err_b + self.floor[1]
        return err_b / self.grad_b.abs().clamp_min(tiny) + err_w / self.grad_w.norm(dim=1).clamp_min(tiny)

    def subtract(self, x: torch.Tensor, label: int, delta: torch.Tensor, how: str, certified: bool = True,
                 error: float = 0.0) -> None:
        """Remove one sample's exact contribution (``delta`` already carries the global scale); ``error``: the
        sample's own relative error when above the round-off ``eps``."""
        self.grad_w -= delta[:, None] * x[None, :]
        self.grad_b -= delta
        # the subtraction is exact only to the sample's own precision: widen the bounds of the rows it touched
        rel = max(self.eps, float(error))
        self.err_w += rel * delta.abs() * x.norm()
        self.err_b += rel * delta.abs()
        self.inputs.append(x)
        self.labels.append(label)
        self.deltas.append(delta)
        self.how.append(how)
        self.certified.append(certified)
        self.provisional = self.provisional or not certified


def _distinct(inputs: torch.Tensor, order: torch.Tensor, tol: float) -> torch.Tensor:
    """Indices (in ``order``'s order of preference) of inputs not within ``tol``·‖x‖ of an earlier one."""
    keep: list[int] = []
    if order.numel() == 0:
        return order
    x = inputs[order]
    dist = torch.cdist(x, x)
    close = dist <= tol * x.norm(dim=1).clamp_min(torch.finfo(x.dtype).tiny)[:, None]
    for k in range(order.numel()):       # K ≤ the batch: accepted candidates only
        if not any(bool(close[k, j]) for j in keep):
            keep.append(k)
    return order[torch.tensor(keep, dtype=torch.long, device=order.device)]


def candidate_scale(res: Residual, grads: SampleGradients, data_range: tuple[float, float]) -> float | None:
    """The global factor s with ∂L/∂b_j = s·δ(x̂, y)_j on exclusive rows: 1 when one row certifies at s = 1,
    else the value shared by the most rows (at least three, to the rows' precision); None when none is."""
    rel = res.relative_error()
    rows = (rel <= GATE).nonzero().flatten()
    if rows.numel() == 0:
        return None
    cand = res.grad_w[rows] / res.grad_b[rows, None]
    lo, hi = data_range
    inside = ((cand >= lo - RANGE_SLACK * (hi - lo)) & (cand <= hi + RANGE_SLACK * (hi - lo))).all(1)
    rows, cand = rows[inside], cand[inside]
    if rows.numel() == 0:
        return None
    ratio = res.grad_b[rows, None] / grads.at_rows(cand, rows)          # K×C
    tol = MATCH * rel[rows][:, None].expand_as(ratio)
    finite = torch.isfinite(ratio)                                       # δ(x̂, c)_j = 0: no factor from that row
    ratio, tol = torch.where(finite, ratio, torch.zeros_like(ratio)), torch.where(finite, tol, torch.zeros_like(tol))
    if bool(((ratio - 1).abs() <= tol).any()):
        return 1.0
    # a clipped gradient: every exclusive row shows the same factor; count, per (row, label), the rows whose
    # best label agrees with it to their precision (sorted log-ratios and a window search: K·C·log(K·C))
    positive = ratio > 0
    logs, tols = ratio[positive].log(), tol[positive]
    if logs.numel() == 0:
        return None
    order = logs.argsort()
    logs, tols = logs[order], tols[order]
    lo_i = torch.searchsorted(logs, logs - tols)
    hi_i = torch.searchsorted(logs, logs + tols, right=True)
    support = hi_i - lo_i
    k = int(support.argmax())
    if int(support[k]) < 3:
        return None
    return float(logs[k].exp())


def residual_span(res: Residual, left: torch.Tensor, count: int) -> torch.Tensor:
    """An orthonormal basis (m×count) of the residual gradient's column space, inside the original one (``left``,
    m×r): the span of the remaining samples' δ when their inputs are linearly independent."""
    u = torch.linalg.svd(left.T @ res.grad_w, full_matrices=False)[0]
    return left @ u[:, :count]


def peel_pass(res: Residual, grads: SampleGradients, scale: float, data_range: tuple[float, float], budget: int,
              *, certified: bool = True, span: torch.Tensor | None = None) -> int:
    """One pass: certify every row whose candidate meets its own bias gradient, subtract the distinct samples
    found (at most ``budget``).  Returns how many were peeled.  ``certified=False``: the residual carries an
    imprecise earlier subtraction, so what is found is subtracted but not certified on its own.

    ``span`` (m×k, orthonormal: the residual's column space, k = the samples left, from a full-rank residual):
    a candidate's whole gradient δ(x̂, y) must then lie in it (``SPAN_TOL``), and rows up to ``LOOSE_GATE`` are
    used; a candidate from a row above ``GATE`` is subtracted provisionally (its error propagated to the rows it
    touches), to be certified by the joint certificate of the whole batch."""
    if budget <= 0:
        return 0
    # a residual that carries a provisional subtraction certifies nothing on its own (measured: at B = 128 on
    # deformed digits, 4 samples read after provisional ones were 2e-4 to 9e-4 off with row bounds ≤ 1e-5)
    certified = certified and not res.provisional
    rel = res.relative_error()
    # the certificate's precision: with the observation's extra round-off, when it carries any
    sure = rel if res.floor is None else res.relative_error(floor=True)
    rows = (rel <= (GATE if span is None else LOOSE_GATE)).nonzero().flatten()
    if rows.numel() == 0:
        return 0
    cand = res.grad_w[rows] / res.grad_b[rows, None]
    lo, hi = data_range
    slack = RANGE_SLACK * (hi - lo)
    inside = ((cand >= lo - slack) & (cand <= hi + slack)).all(1)
    rows, cand = rows[inside], cand[inside]
    if rows.numel() == 0:
        return 0
    predicted = scale * grads.at_rows(cand, rows)                         # K×C
    mismatch = (predicted - res.grad_b[rows, None]).abs() / res.grad_b[rows, None].abs()
    tol = MATCH * rel[rows]
    two = mismatch.topk(min(2, mismatch.shape[1]), dim=1, largest=False)
    best, label = two.values[:, 0], two.indices[:, 0]
    unique = two.values[:, 1] > MARGIN * tol if mismatch.shape[1] > 1 else torch.ones_like(best, dtype=torch.bool)
    if span is not None:   # the span test below checks the label too (a wrong label's δ leaves the span)
        unique = torch.ones_like(unique)
    ok = (best <= tol) & unique
    if res.count:   # a sample already peeled cannot come back (its row would be round-off): skip look-alikes
        taken = torch.stack(res.inputs)
        near = torch.cdist(cand, taken).min(1).values <= (1e-3 if span is None else NEAR) * cand.norm(dim=1)
        ok &= ~near
    idx = ok.nonzero().flatten()
    if idx.numel() == 0:
        return 0
    idx = idx[rel[rows[idx]].argsort()]                                   # the most precise row of each sample
    if span is not None:
        deltas = grads(cand[idx], label[idx])
        off = (deltas - (deltas @ span) @ span.T).norm(dim=1) / deltas.norm(dim=1).clamp_min(
            torch.finfo(deltas.dtype).tiny)
        idx = idx[off <= SPAN_TOL]
    # distinct samples: a loose row's candidate is within its own error of a precise one's
    idx = _distinct(cand, idx, 1e-4 if span is None else NEAR)[:budget]
    labels = label[idx]
    deltas = scale * grads(cand[idx], labels)
    for k in range(idx.numel()):                                          # ≤ budget samples
        r = float(rel[rows[idx[k]]])
        res.subtract(cand[idx[k]], int(labels[k]), deltas[k], f"row {int(rows[idx[k]])}",
                     certified=certified and float(sure[rows[idx[k]]]) <= GATE, error=r if span is not None else 0.0)
    return int(idx.numel())
