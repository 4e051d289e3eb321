"""The R-GAP recursion: per-layer linear systems (Zhu & Blaschko, ICLR 2021), as framed by Chen & Campbell (2022).

From the output towards the input, for one sample (Chen & Campbell, Sec. 3):

1. output layer: its input h and δ = ∂ℓ/∂z from Lemma 3.1 (eq. 4 with a bias, eq. 5
   otherwise; :func:`~.analytic.output_layer`);
2. at each layer below, the activation is inverted, z_i = σ⁻¹(h_i) (eq. 2; tanh and
   sigmoid clipped 1e-4 inside their range, leaky ReLU exactly, ReLU only where
   h_i > 0 — R-GAP drops the rows of inactive outputs), and the upstream gradient is
   back-propagated, δ_i = σ'(z_i) ⊙ W_{i+1}ᵀ δ_{i+1} (eq. 3; the shared bias
   gradient replaces it for a biased fully connected layer, where ∇b = δ);
3. a fully connected layer is inverted in closed form (Lemma 3.1); a convolution by
   least squares on the stacked weight and gradient constraints
   [W_circ; K(δ_i)] x_i = [z_i − b_i; vec(∇W_i)] (eqs. 6–8), the minimum-norm solution
   (eq. 8) of the sparse system (below);
4. x_i is the output of the layer below; repeat down to the image.

The solver (``solver="gram"``, the default): Chen & Campbell's point is that these systems are cheap —
the stacked matrix A (m×n) is sparse (a k×k convolution touches k² inputs per output row).  The Gram
matrix of its smaller side, G = CᵀC with C = A (m ≥ n) or Aᵀ, is formed by sparse products and
factorised by LAPACK's pivoted Cholesky (``dpstrf``, q³/3 flops for q = min(m, n), float64), which
reveals the numerical rank r — its tolerance q·ε·max diag(G) is the security metric's
(:func:`leakbench.analysis.security.numerical_rank`).  With Pᵀ G P = L Lᵀ, L = [L₁₁; L₂₁] (q×r) and
M = L₂₁ L₁₁⁻¹, C P = Q Lᵀ (Q orthonormal), so C⁺ = P L (LᵀL)⁻¹ Qᵀ and, with (LᵀL)⁻¹ =
L₁₁⁻¹ (I + MᵀM)⁻¹ L₁₁⁻ᵀ (Woodbury for the (q − r)-dimensional part), the minimum-norm least-squares
solution x = A⁺b costs triangular solves and sparse products; two steps of iterative refinement on
b − Ax bring it to ``gelsd``'s accuracy (the Gram squares the condition number).  Where no clear gap separates the kept pivots from the rest (a kept pivot below 1e4× the
tolerance) or the refined solution fails the least-squares test ‖Aᵀ(b − Ax)‖ ≤ 1e-8 ‖A‖_F (‖A‖_F‖x‖ +
‖b‖), the SVD solver ``gelsd`` decides instead (``trace["layers"][i]["solver"]`` says which ran).
``gelsd`` (LAPACK's SVD, the previous default), ``gelsy`` (pivoted QR; its rank estimate can miss on
rank-deficient systems, and its bits differ between processes: :mod:`.linalg`) and ``pinv`` (SVD
pseudo-inverse, any device) stay selectable.

R-GAP's "virtual constraints" are not used (Chen & Campbell, Sec. 2, found they add
little).  The per-layer rank of the system is recorded in ``trace["layers"]``:
rank < dim(x_i) (the security metric's rank deficiency) is where R-GAP must guess.
:func:`solve` takes an optional ``correct`` callback: the hybrid attack
(:mod:`.gradient.hybrid`) corrects each convolution's least-squares solution there.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ...models.matrices import Chain, ChainBlock, bias_vector, conv_system, layer_chain
from ...threat import Observation
from .analytic import (act_derivative, act_inverse, analytic_reasons, chain_or_reason, linear_input,
                       observed_output_layer)
from ..observed import layer_gradients, param_index

__all__ = ["RGAPOptions", "LayerSystem", "LeastSquares", "solve", "least_squares", "INVERTIBLE", "SOLVERS"]

#: activations R-GAP inverts (ReLU only on its active outputs).
INVERTIBLE = ("tanh", "sigmoid", "leaky-relu", "identity", "relu")
SOLVERS = ("auto", "gram", "gelsd", "gelsy", "pinv")


@dataclass
class RGAPOptions:
    """Options of ``rgap`` (and of the linear-system part of ``hybrid``)."""

    #: least-squares backend: ``gram`` (pivoted Cholesky of the sparse system's smaller Gram matrix,
    #: refined; falls back to gelsd where the rank is not clear-cut), ``gelsd`` (SVD, CPU), ``gelsy``
    #: (pivoted QR, CPU), ``pinv`` (SVD pseudo-inverse, any device); ``auto`` = gram.
    #: gelsy's incremental rank estimate can miss on rank-deficient systems (measured: rank
    #: 450 for an SVD rank of 546, residual 0.3 instead of 1e-15, varying with the thread
    #: count), so it is never the default.
    solver: str = "auto"
    #: singular values below rcond·σ_max count as zero (numerical rank of eq. 7).
    rcond: float = 1e-10
    #: tanh / sigmoid outputs are clipped this far inside their range before inversion (eq. 2).
    clip: float = 1e-4

    def check(self) -> None:
        if self.solver not in SOLVERS:
            raise ConfigError(f"expected solver in {SOLVERS}, got {self.solver!r} (option solver)")
        if not 0 < self.rcond < 1:
            raise ConfigError(f"expected 0 < rcond < 1, got {self.rcond} (option rcond)")
        if not 0 <= self.clip < 0.5:
            raise ConfigError(f"expected 0 ≤ clip < 0.5, got {self.clip} (option clip)")


@dataclass
class LayerSystem:
    """The linear system of one convolution (eq. 7) and its least-squares solution.

    ``matrix`` is sparse (scipy CSR, float64); :meth:`apply` multiplies it with a torch vector, differentiably.
    """

    block: int
    name: str
    matrix: sp.csr_matrix
    rhs: torch.Tensor
    solution: torch.Tensor
    rank: int
    unknowns: int
    solver: str = "gram"
    _torch: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self._torch is None or self._torch.device != x.device:
            with warnings.catch_warnings():  # torch calls its CSR support beta
                warnings.simplefilter("ignore", UserWarning)
                m = self.matrix
                rows, cols = torch.from_numpy(m.indptr).long(), torch.from_numpy(m.indices).long()
                self._torch = torch.sparse_csr_tensor(rows, cols, torch.from_numpy(m.data), m.shape, device=x.device)
        return self._torch @ x.reshape(-1).to(torch.float64)


@dataclass
class LeastSquares:
    """A minimum-norm least-squares solution, the numerical rank, and the solver that produced them."""

    solution: torch.Tensor
    rank: int
    solver: str


def _scipy(a) -> sp.csr_matrix:
    """A scipy sparse matrix or torch tensor (dense or sparse COO) as a float64 scipy CSR matrix."""
    if sp.issparse(a):
        return sp.csr_matrix(a, dtype=np.float64)
    if a.is_sparse:
        a = a.coalesce().cpu()
        i = a.indices().numpy()
        return sp.csr_matrix((a.values().double().numpy(), (i[0], i[1])), shape=tuple(a.shape))
    return sp.csr_matrix(a.detach().double().cpu().numpy())


#: a kept pivot must exceed the rank tolerance this many times, else gelsd decides the rank.
GAP = 1e4


def _gram_solve(a: sp.csr_matrix, b: np.ndarray, rcond: float) -> tuple[np.ndarray, int] | None:
    """x = A⁺b through the pivoted Cholesky of the smaller Gram matrix (see the module docstring);
    None when the rank is not clear-cut or the solution fails the least-squares test."""
    import scipy.linalg as sla  # here, not at import: scipy.linalg costs every CLI and worker start ~0.4 s
    from scipy.linalg import lapack
    from scipy.sparse.linalg import norm as sparse_norm

    m, n = a.shape
    tall = m >= n
    dense_rows = np.diff(a.indptr) > 0.05 * n  # K(δ)'s rows are dense: their Gram part goes to BLAS
    order = np.concatenate([np.flatnonzero(~dense_rows), np.flatnonzero(dense_rows)])
    a, b = a[order], b[order]
    s_, d_ = a[: int((~dense_rows).sum())], a[int((~dense_rows).sum()):].toarray()
    if tall:
        g = (s_.T @ s_).toarray() + d_.T @ d_
    else:
        sd = np.asarray(s_ @ d_.T)
        g = np.block([[(s_ @ s_.T).toarray(), sd], [sd.T, d_ @ d_.T]])
    c = a if tall else a.T.tocsr()
    q = g.shape[0]
    top = float(g.diagonal().max()) if q else 0.0
    if top == 0.0:
        return np.zeros(n), 0
    tol = max(q * np.finfo(np.float64).eps / 2, rcond ** 2) * top  # LAPACK's default: q·u·max diag
    factor, piv, r, info = lapack.dpstrf(g, lower=1, tol=tol)
    if info < 0:  # pragma: no cover - LAPACK argument error
        raise RuntimeError(f"dpstrf failed with info={info}")
    piv = piv[:q] - 1
    l11, l21 = np.asfortranarray(factor[:r, :r]), factor[r:, :r]  # only the lower triangle of l11 is read
    if r == 0 or float(np.diag(l11).min()) ** 2 < GAP * tol:
        return None
    cs = c[:, piv[:r]]

    def tri(v: np.ndarray, trans: str = "N") -> np.ndarray:
        return sla.solve_triangular(l11, v, lower=True, trans=trans, check_finite=False)

    mt = tri(l21.T, "T") if r < q else np.zeros((r, 0))  # Mᵀ = L₁₁⁻ᵀ L₂₁ᵀ
    k = sla.cho_factor(np.eye(q - r) + mt.T @ mt, lower=True) if r < q else None

    def basic(v: np.ndarray) -> np.ndarray:  # L₁₁⁻ᵀ L₁₁⁻¹ v, then (I + MᵀM)⁻¹
        w = tri(tri(v), "T")
        return w if k is None else w - mt @ sla.cho_solve(k, mt.T @ w)

    def pinv(v: np.ndarray) -> np.ndarray:
        if tall:  # x[piv] = [s; M s] with s = (I + MᵀM)⁻¹ L₁₁⁻ᵀ L₁₁⁻¹ C_Sᵀ v
            s_ = basic(cs.T @ v)
            x = np.empty(n)
            x[piv] = np.concatenate([s_, mt.T @ s_])
            return x
        vp = v[piv]  # C = Aᵀ: x = C_S L₁₁⁻ᵀ L₁₁⁻¹ (I + MᵀM)⁻¹ (v₁ + Mᵀ v₂) (the same operator, transposed)
        u = vp[:r] + mt @ vp[r:]
        if k is not None:
            u = u - mt @ sla.cho_solve(k, mt.T @ u)
        return cs @ tri(tri(u), "T")

    x = pinv(b)
    for _ in range(2):  # iterative refinement: the fixed point satisfies Aᵀ(b − Ax) = 0 in A's row space
        x = x + pinv(b - a @ x)
    normal = np.linalg.norm(a.T @ (b - a @ x))
    norm_a = sparse_norm(a)
    if not np.isfinite(normal) or normal > 1e-8 * norm_a * (norm_a * np.linalg.norm(x) + np.linalg.norm(b)):
        return None
    return x, int(r)


def least_squares(a, b: torch.Tensor, *, solver: str = "auto", rcond: float = 1e-10) -> LeastSquares:
    """Minimum-norm least-squares solution of a x ≈ b and the numerical rank of a (``a``: a torch tensor,
    dense or sparse COO, or a scipy sparse matrix)."""
    if solver in ("auto", "gram"):
        found = _gram_solve(_scipy(a), b.detach().double().cpu().numpy(), rcond)
        if found is not None:
            x, rank = found
            return LeastSquares(torch.from_numpy(x).to(b.device, b.dtype), rank, "gram")
        solver = "gelsd (fallback from gram)"
    if sp.issparse(a):
        a = torch.from_numpy(a.toarray()).to(b.device)
    dense = a.to_dense() if a.is_sparse else a
    if solver.startswith("gelsd") or solver == "gelsy":
        driver = "gelsy" if solver == "gelsy" else "gelsd"
        if solver in ("gelsd", "gelsy") and a.device.type != "cpu":
            raise ConfigError(f"solver {solver!r} runs on the CPU only; use solver='pinv' or 'gram' on {a.device}")
        out = torch.linalg.lstsq(dense.cpu(), b.cpu()[:, None], rcond=rcond, driver=driver)
        return LeastSquares(out.solution[:, 0].to(b.device), int(out.rank), solver)
    u, s, vh = torch.linalg.svd(dense, full_matrices=False)
    keep = s > rcond * s[0]
    coef = (u[:, keep].T @ b) / s[keep]
    return LeastSquares(vh[keep].T @ coef, int(keep.sum()), solver)


def _back(above: ChainBlock, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """W_{i+1}ᵀ δ_{i+1}: the gradient w.r.t. the input of block ``above`` (bias-free), shaped like h."""
    layer = above.layer
    w = layer.weight.detach().to(delta.dtype)
    if isinstance(layer, nn.Linear):
        return (w.T @ delta.reshape(-1)).reshape(h.shape)
    _, vjp = torch.func.vjp(lambda t: F.conv2d(t, w, None, layer.stride, layer.padding, layer.dilation),
                            h.reshape(1, *above.input_shape))
    (g,) = vjp(delta.reshape(1, *above.output_shape))
    return g.reshape(h.shape)


Corrector = Callable[[int, LayerSystem, torch.Tensor], torch.Tensor]


def rgap_reasons(obs: Observation, attack: str) -> tuple[list[str], Chain | None]:
    reasons = analytic_reasons(obs, attack=attack)
    chain, why = chain_or_reason(obs)
    if chain is None:
        return reasons + [why], None
    if chain.blocks[-1].kind != "linear" or chain.blocks[-1].act != "identity":
        reasons.append(f"{attack} needs a last fully connected layer that outputs the logits (no activation after it)")
    for b in chain.blocks[:-1]:
        if b.act not in INVERTIBLE:
            reasons.append(f"{attack} cannot invert activation {b.act!r} after {b.name!r}; supported: "
                           f"{', '.join(INVERTIBLE)}")
        if b.act == "leaky-relu" and b.slope == 0:
            reasons.append(f"leaky ReLU after {b.name!r} has slope 0 (not invertible)")
    index = param_index(obs)
    missing = [b.name for b in chain.blocks if id(b.layer.weight) not in index]
    if missing:
        reasons.append(f"the weight gradients of {', '.join(missing)} are not shared")
    return reasons, chain


def solve(obs: Observation, options: RGAPOptions, *, labels: torch.Tensor,
          correct: Corrector | None = None) -> tuple[torch.Tensor, dict]:
    """Run the recursion on ``obs`` (batch 1); returns the image (float64) and a trace.

    ``correct(block, system, x)`` may replace each convolution's least-squares
    solution ``x`` (the hybrid attack's gradient-matching correction).
    """
    chain = layer_chain(obs.model, obs.input_shape)
    index = param_index(obs)
    grads = obs.gradients
    blocks = chain.blocks
    top = blocks[-1]
    out = observed_output_layer(obs, chain, grads, index, labels)
    h, delta = out.inputs, out.delta
    layers = [{"block": top.name, "kind": "linear", "method": out.method, "residual": out.residual}]
    for i in range(len(blocks) - 2, -1, -1):
        start = time.perf_counter()
        block, above = blocks[i], blocks[i + 1]
        h = h.reshape(block.output_shape)
        upstream = _back(above, h, delta)
        gw_i, gb_i = layer_gradients(obs, block.layer, grads, index)
        if block.kind == "linear":
            delta = gb_i if gb_i is not None else act_derivative(block.act, h, block.slope) * upstream
            h = linear_input(gw_i, delta, block.name)
            layers.append({"block": block.name, "kind": "linear", "method": "Lemma 3.1",
                           "seconds": time.perf_counter() - start})
            continue
        delta = act_derivative(block.act, h, block.slope) * upstream
        system = _conv_system(i, block, h, delta, gw_i, options)
        x = system.solution
        if correct is not None:
            x = correct(i, system, x)
        layers.append({"block": block.name, "kind": "conv", "rank": system.rank, "unknowns": system.unknowns,
                       "rank_deficiency": system.rank - system.unknowns, "rows": int(system.matrix.shape[0]),
                       "solver": system.solver,
                       "residual": float((system.apply(x) - system.rhs).norm() / system.rhs.norm().clamp_min(1e-300)),
                       "seconds": time.perf_counter() - start})
        h = x
    return h.reshape(obs.input_shape), {"layers": layers[::-1]}


def _conv_system(position: int, block: ChainBlock, h: torch.Tensor, delta: torch.Tensor, grad_w: torch.Tensor,
                 options: RGAPOptions) -> LayerSystem:
    """Eq. (6)/(7) for one convolution (sparse) and its minimum-norm least-squares solution (eq. 8)."""
    w_circ, k = conv_system(block.layer, block.input_shape, delta)
    bias = bias_vector(block.layer, block.input_shape, dtype=torch.float64)
    flat = h.reshape(-1)
    z = act_inverse(block.act, flat, block.slope, options.clip)
    if block.act == "relu":  # only active outputs constrain the input
        rows = flat > 0
        w_circ = w_circ[rows.cpu().numpy()]
        z, bias = z[rows], bias[rows]
    a = sp.vstack([w_circ, k], format="csr")
    rhs = torch.cat([z - bias, grad_w.reshape(-1).to(z.dtype)])
    found = least_squares(a, rhs, solver=options.solver, rcond=options.rcond)
    return LayerSystem(block=position, name=block.name, matrix=a, rhs=rhs, solution=found.solution, rank=found.rank,
                       unknowns=a.shape[1], solver=found.solver)
