"""The tensor method of Wang, Lee & Lei (2023) as used by Liu et al. (2024, Sec. 3, App. B.1, B.4).

For a two-layer block f(z) = Σ_j a_j σ(w_jᵀz) with w_j ~ N(0, I), the gradient with
respect to a_j is g(w_j) = Σ_i r_i σ(w_jᵀz_i) (App. B.4).  By Stein's lemma (eq. 5),
E[g(w) H_p(w)] = Σ_i r_i E[σ^(p)(wᵀz_i)] z_i^{⊗p} for unit-norm z_i, so the empirical moments

    P̂ = (1/m) Σ_j g(w_j) H_2(w_j)     (eq. 6),      T̂ = (1/m) Σ_j g(w_j) H_3(w_j)     (eq. 8)

approximate Σ_i ν r_i z_i z_iᵀ and Σ_i λ r_i z_i^{⊗3} (eqs. 7, 9), with H_2(w) = wwᵀ − I and
H_3(w) = w^{⊗3} − w ⊗̃ I.  Orders follow App. B.1: k₂ = the first order ≥ 2 whose Hermite
coefficient E[σ^(k)] is non-zero, k₃ the first ≥ 3; a higher order is contracted with an
extra unit vector (H_3(w)(I, I, a) for the matrix when k₂ = 3, as for tanh; H_4(w)(I, I, I, a)
for the tensor when k₃ = 4, as for ReLU).  The coefficients are computed numerically from
the block's own activation.

Steps: (1) the span V of the z_i = top-B eigenvectors of P̂ (of Σ_s P̂_s² when the block has
several outputs; each output row, or rather each left singular vector of the K×m gradient,
is one scalar observation); App. B.1 runs the power method on P̂, whose fixed point this
direct eigendecomposition computes.  (2) The projected moments P̂(V, V) and the slices
T̂(V, V, V)(·, ·, e_r) all have the form U diag(·) Uᵀ with U = [Vᵀz_1, …, Vᵀz_B]; U is found
by Jennrich's simultaneous diagonalisation of two random combinations of the slices
(the best of several seeded draws by least-squares fit), then refined by L-BFGS on the fit
of every slice — a robust rank-B decomposition in place of Kuleshov et al.'s Algorithm 1.
(3) ẑ_i = V u_i / ‖V u_i‖: unit norm.  The sign (App. F: the method "may have a sign opposite
to the actual features") is identified, where possible, from the first-order moment (1/m) Σ_j g(w_j) w_j
≈ μ₁ Σ_i r_i z_i (Stein at order 1; μ₁ = E[σ'] ≠ 0 for ReLU): its coordinates β_i on the u_i carry
r_i s_i, the matrix slices' diagonals carry r_i, so sign(Σ_s β_{s,i} D_{s,i}·μ₁μ₂) = s_i — an
addition of ours (``sign_from_moment``; needs k₂ = 2).  Otherwise (tanh, sigmoid) the sign is fixed
so that Σ ẑ_i > 0, the true sign for non-negative features such as ReLU outputs.  The error grows
as B·sqrt(d/m) (Theorem 3.1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable

import torch

from ...errors import UnsupportedThreatModel, expect
from .linalg import lstsq

__all__ = ["hermite_coefficients", "hermite_orders", "tensor_features", "TensorFeatureResult"]


# ----------------------------------------------------------------------------- Hermite coefficients
def hermite_coefficients(act: Callable[[torch.Tensor], torch.Tensor], orders: int = 4) -> list[float]:
    """E_{z~N(0,1)}[σ(z) He_k(z)] = E[σ^(k)(z)] (Stein, eq. 5) for k = 0..orders, by quadrature."""
    z = torch.linspace(-12.0, 12.0, 200_001, dtype=torch.float64)
    with torch.no_grad():
        s = act(z)
    phi = torch.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    he = [torch.ones_like(z), z]
    for k in range(2, orders + 1):
        he.append(z * he[k - 1] - (k - 1) * he[k - 2])
    return [float(torch.trapezoid(s * h * phi, z)) for h in he[: orders + 1]]


def hermite_orders(act: Callable[[torch.Tensor], torch.Tensor], *, tol: float = 1e-3) -> tuple[int, int] | None:
    """(k₂, k₃) of App. B.1 (first non-zero coefficient of order ≥ 2 and ≥ 3), if k₂ ≤ 3 and k₃ ≤ 4."""
    mu = hermite_coefficients(act, 4)
    scale = max(abs(m) for m in mu[1:]) or 1.0
    nonzero = [abs(m) > tol * scale for m in mu]
    k2 = next((k for k in (2, 3) if nonzero[k]), None)
    k3 = next((k for k in (3, 4) if nonzero[k]), None)
    if k2 is None or k3 is None:
        return None
    return k2, k3


# ----------------------------------------------------------------------------- moments
def _outer3(c: torch.Tensor, u: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """Σ_j c_j u_j ⊗ u_j ⊗ u_j for u (m×B), in chunks over j."""
    m, b = u.shape
    out = u.new_zeros(b, b * b)
    for s in range(0, m, chunk):
        uc, cc = u[s:s + chunk], c[s:s + chunk]
        pair = (uc[:, :, None] * uc[:, None, :]).reshape(uc.shape[0], b * b)
        out += (uc * cc[:, None]).T @ pair
    return out.reshape(b, b, b)


def _sym_vec_identity(v: torch.Tensor) -> torch.Tensor:
    """v ⊗̃ I: (p, q, r) ↦ v_p δ_qr + v_q δ_pr + v_r δ_pq."""
    eye = torch.eye(v.numel(), dtype=v.dtype, device=v.device)
    return v[:, None, None] * eye[None] + v[None, :, None] * eye[:, None, :] + v[None, None, :] * eye[:, :, None]


def _third_moment(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(1/m) Σ_j g_j H_3(u_j) for projected weights u (m×B)."""
    m = u.shape[0]
    return (_outer3(g, u) - _sym_vec_identity(g @ u)) / m


def _fourth_moment_along(g: torch.Tensor, u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(1/m) Σ_j g_j H_4(u_j)(I, I, I, b) for a unit b in the projected space (see the module docstring)."""
    m = u.shape[0]
    alpha = u @ b
    t = _outer3(g * alpha, u)
    ua = (g * alpha) @ u               # Σ_j g_j α_j u_j
    uu = (u * g[:, None]).T @ u        # Σ_j g_j u_j u_jᵀ
    eye = torch.eye(u.shape[1], dtype=u.dtype, device=u.device)
    t = t - (uu[:, :, None] * b[None, None, :] + uu[:, None, :] * b[None, :, None] + b[:, None, None] * uu[None, :, :])
    t = t - _sym_vec_identity(ua)
    t = t + g.sum() * (eye[:, :, None] * b[None, None, :] + eye[:, None, :] * b[None, :, None]
                       + b[:, None, None] * eye[None, :, :])
    return t / m


def _noise_level(weight: torch.Tensor, u: torch.Tensor, order: int) -> torch.Tensor:
    """Root-mean-square standard error of (1/m) Σ_j weight_j u_j^{⊗order} over its entries (leading term)."""
    m = u.shape[0]
    sq = u.pow(2)
    var = (sq * weight.pow(2)[:, None]).T @ sq if order == 2 else _outer3(weight.pow(2), sq)
    return var.mean().sqrt() / m


def _matrix_moment(g: torch.Tensor, w: torch.Tensor, order: int, a: torch.Tensor | None) -> torch.Tensor:
    """(1/m) Σ_j g_j H_2(w_j), or (1/m) Σ_j g_j H_3(w_j)(I, I, a) when ``order`` is 3 (d×d)."""
    m, d = w.shape
    eye = torch.eye(d, dtype=w.dtype, device=w.device)
    if order == 2:
        return ((w * g[:, None]).T @ w - g.sum() * eye) / m
    alpha = w @ a
    gw = g @ w
    return ((w * (g * alpha)[:, None]).T @ w - (g @ alpha) * eye - gw[:, None] * a[None, :] - a[:, None] * gw[None, :]) / m


# ----------------------------------------------------------------------------- decomposition
def _fit(slices: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Least-squares diagonals D (L×B) of slices ≈ U diag(D_l) Uᵀ and the relative residual."""
    b = u.shape[0]
    design = (u[:, None, :] * u[None, :, :]).reshape(b * b, b)  # column i = vec(u_i u_iᵀ)
    target = slices.reshape(slices.shape[0], b * b).T
    diag = lstsq(design, target)
    resid = float((design @ diag - target).norm() / target.norm().clamp_min(1e-300))
    return diag.T, resid


def _jennrich(slices: torch.Tensor, gen: torch.Generator, trials: int) -> list[tuple[float, torch.Tensor]]:
    """Candidate U (columns u_i shared by slices S_l = U diag(·) Uᵀ) from ``trials`` random Jennrich
    draws, as (relative residual, U) sorted best first."""
    L, b, _ = slices.shape
    found: list[tuple[float, torch.Tensor]] = []
    for _ in range(trials):
        alpha = torch.randn(L, generator=gen, dtype=slices.dtype).to(slices.device)
        beta = torch.randn(L, generator=gen, dtype=slices.dtype).to(slices.device)
        ma = torch.einsum("l,lpq->pq", alpha, slices)
        mb = torch.einsum("l,lpq->pq", beta, slices)
        try:
            prod = torch.linalg.solve(mb, ma).T   # (M_b⁻¹ M_a)ᵀ = M_a M_b⁻¹ for symmetric M's
        except RuntimeError:
            continue
        _, vecs = torch.linalg.eig(prod)
        u = vecs.real.to(slices.dtype)
        u = u / u.norm(dim=0, keepdim=True).clamp_min(1e-300)
        found.append((_fit(slices, u)[1], u))
    if not found:
        u = torch.linalg.eigh(slices.sum(0))[1]
        found.append((_fit(slices, u)[1], u))
    return sorted(found, key=lambda item: item[0])


def _refine(slices: torch.Tensor, u0: torch.Tensor, steps: int) -> tuple[torch.Tensor, float]:
    """L-BFGS on Σ_l ‖S_l − U diag(D_l) Uᵀ‖² over U and D, from Jennrich's U."""
    if steps <= 0:
        return u0, _fit(slices, u0)[1]
    diag0, r0 = _fit(slices, u0)
    u = u0.clone().contiguous().requires_grad_(True)
    dg = diag0.clone().contiguous().requires_grad_(True)
    scale = slices.pow(2).sum()
    opt = torch.optim.LBFGS([u, dg], lr=1, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        model = torch.einsum("pi,li,qi->lpq", u, dg, u)
        loss = (model - slices).pow(2).sum() / scale
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    refined = u.detach() / u.detach().norm(dim=0, keepdim=True).clamp_min(1e-300)
    r1 = _fit(slices, refined)[1]
    return (refined, r1) if r1 <= r0 else (u0, r0)


@dataclass
class TensorFeatureResult:
    """Unit-norm features (B×d, sign from the first moment if ``signed``, else by a positive sum), the span V
    (d×B) and diagnostics."""

    features: torch.Tensor
    span: torch.Tensor
    orders: tuple[int, int]
    residual: float
    eigenvalues: torch.Tensor
    signed: bool = False          # the sign came from the first Hermite moment (else: a positive sum)


def tensor_features(first: torch.Tensor, grad_second: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                    batch: int, *, seed: int = 0, trials: int = 16, refine: int = 100,
                    directions: int = 3, starts: int = 3, sign_from_moment: bool = True) -> TensorFeatureResult:
    """Recover the B unit-norm inputs z_i of f(z) = A σ(W z) from W (m×d) and ∇A (K×m).

    Pure function (float64 inside); ``trials`` Jennrich draws, ``refine`` L-BFGS iterations from
    each of the ``starts`` best draws,
    ``directions`` random unit vectors a for a fourth-order contraction (k₃ = 4);
    ``sign_from_moment``: signs from the first Hermite moment where identifiable (module docstring).
    """
    orders = hermite_orders(act)
    if orders is None:
        raise UnsupportedThreatModel("the tensor method needs an activation with non-zero Hermite coefficients "
                                     "of order ≤ 3 (matrix) and ≤ 4 (tensor); a linear block carries none")
    k2, k3 = orders
    dev = first.device
    w = first.detach().double()
    m, d = w.shape
    expect(batch <= d, f"the tensor method recovers at most d = {d} features, got batch {batch}",
           error=UnsupportedThreatModel)
    w = (w - w.mean()) / w.std()                       # standardise: w ~ N(0, I) (directions unchanged)
    grad = grad_second.detach().double().reshape(-1, m)
    gen = torch.Generator().manual_seed(int(seed))
    # Each left singular vector of ∇A (K×m) combines the outputs into one scalar observation g(w_j).
    left, sing, right = torch.linalg.svd(grad, full_matrices=False)
    keep = int((sing > 1e-9 * sing[0]).sum()) if sing.numel() and sing[0] > 0 else 0
    expect(keep > 0, "the output-layer gradient of the block is zero: nothing to recover",
           error=UnsupportedThreatModel)
    keep = min(keep, batch)
    gs = sing[:keep, None] * right[:keep]              # (keep, m)

    # (1) the span of the features
    mats, mat_weights = [], []
    for g in gs:
        a = None
        if k2 == 3:
            first_moment = g @ w / m                    # ≈ E[σ'] Σ_i r_i z_i, a vector in the span
            a = first_moment / first_moment.norm() if first_moment.norm() > 0 else None
            if a is None:
                a = torch.randn(d, generator=gen, dtype=w.dtype).to(dev)
                a = a / a.norm()
        mats.append(_matrix_moment(g, w, k2, a))
        mat_weights.append(g if a is None else g * (w @ a))
    gram = sum(p @ p for p in mats)
    evals, evecs = torch.linalg.eigh(gram)
    span = evecs[:, -batch:].flip(1)                   # d×B, orthonormal columns
    u = w @ span                                        # m×B projected weights

    # (2) slices U diag(·) Uᵀ from the projected matrix and tensor moments, each divided by the
    # standard deviation of its Monte-Carlo noise (estimated from the same m terms), so combinations
    # and fits weigh every slice by its signal-to-noise ratio.
    slices, noise = [], []
    for weight, p in zip(mat_weights, mats):
        slices.append(span.T @ p @ span)
        noise.append(_noise_level(weight, u, 2))
    for g in gs:
        if k3 == 3:
            t = _third_moment(g, u)
            level = _noise_level(g, u, 3)
            slices.extend(t.unbind(-1))
            noise.extend([level] * batch)
        else:
            for _ in range(directions):
                bvec = torch.randn(batch, generator=gen, dtype=w.dtype).to(dev)
                bvec = bvec / bvec.norm()
                t = _fourth_moment_along(g, u, bvec)
                level = _noise_level(g * (u @ bvec), u, 3)
                slices.extend(t.unbind(-1))
                noise.extend([level] * batch)
    stack = torch.stack([(s + s.T) / 2 for s in slices])
    stack = stack / torch.stack(noise).clamp_min(1e-300)[:, None, None]
    if batch == 1:
        coords, resid = torch.ones(1, 1, dtype=w.dtype, device=dev), 0.0
    else:
        # the best few Jennrich candidates are refined; the best final fit wins
        refined = [_refine(stack, u0, refine) for _, u0 in _jennrich(stack, gen, trials)[:starts]]
        coords, resid = min(refined, key=lambda item: item[1])

    # (3) back to feature space, unit norm; the sign from the first Hermite moment when it is
    # identifiable, else by a positive sum
    feats = (span @ coords).T
    feats = feats / feats.norm(dim=1, keepdim=True).clamp_min(1e-300)
    sign = None
    if sign_from_moment:
        sign = _moment_signs(act, k2, gs, w, span, coords, stack[:len(mats)])
    signed = sign is not None
    if sign is None:
        sign = torch.where(feats.sum(1) < 0, -1.0, 1.0).to(feats.dtype)
    feats = feats * sign[:, None]
    return TensorFeatureResult(features=feats.to(first.dtype), span=span.to(first.dtype), orders=orders,
                               residual=float(resid), eigenvalues=evals.flip(0)[: batch + 1].cpu(), signed=signed)


def _moment_signs(act, k2: int, gs: torch.Tensor, w: torch.Tensor, span: torch.Tensor, coords: torch.Tensor,
                  matrix_slices: torch.Tensor, *, tol: float = 1e-3) -> torch.Tensor | None:
    """Signs s_i of the features (z_i = s_i ‖z_i‖ ẑ_i) from the first-order moment, or None.

    Stein's lemma at order 1: (1/m) Σ_j g(w_j) w_j ≈ μ₁ Σ_i r_i z_i with μ₁ = E[σ'] (non-zero for
    ReLU), while the matrix slices' diagonals are D_i ∝ μ₂ r_i (a positive factor times r_i, blind
    to s_i).  Writing the projected first moment as Σ_i β_i u_i gives β_i ∝ μ₁ r_i s_i, so
    Σ_s β_{s,i} D_{s,i} ∝ μ₁ μ₂ s_i Σ_s r_{s,i}² has the sign of μ₁ μ₂ s_i.  Needs k₂ = 2 (for k₂ = 3,
    e.g. tanh, the matrix coefficient carries s_i too and the product is sign-blind).
    """
    if k2 != 2:
        return None
    mu = hermite_coefficients(act, 2)
    scale = max(abs(v) for v in mu[1:]) or 1.0
    if abs(mu[1]) <= tol * scale or abs(mu[2]) <= tol * scale:
        return None
    m = w.shape[0]
    diag, _ = _fit(matrix_slices, coords)                      # (keep, B)
    first = (gs @ w / m) @ span                                 # (keep, B): projected first moments
    beta = lstsq(coords, first.T).T       # first_s ≈ Σ_i β_{s,i} u_i
    votes = (beta * diag).sum(0) * math.copysign(1.0, mu[1] * mu[2])
    if bool((votes == 0).any()):
        return None
    return torch.where(votes < 0, -1.0, 1.0).to(coords.dtype)
