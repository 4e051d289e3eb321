"""SPEAR's pattern test with the gradient's own error: zeros of L q̂ blurred by round-off or noise are forgiven
(``zero_band``), a wrong column is not."""
import torch

from leakbench.attacks.solvers.sparse_span import certify, decompose, entry_floor, scales, zero_band
from leakbench.attacks.solvers.spear_search import pattern_disagreements


def _noisy_layer(batch=12, inputs=60, width=240, classes=5, noise=1e-9, seed=0):
    """A ReLU layer's gradient Gᵀ X (float64) plus Gaussian error of std ``noise`` per entry (as round-off of a lower
    precision would add): (grad_w, grad_b, W, b, X, G)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, inputs, generator=g, dtype=torch.float64)
    w = torch.randn(width, inputs, generator=g, dtype=torch.float64) / inputs ** 0.5
    b = torch.randn(width, generator=g, dtype=torch.float64) * 0.1
    w2 = torch.randn(classes, width, generator=g, dtype=torch.float64) / width ** 0.5
    z = x @ w.T + b
    p = (z.clamp_min(0) @ w2.T).softmax(1)
    delta = (p - torch.nn.functional.one_hot(torch.arange(batch) % classes, classes).double()) / batch
    grads = (z > 0).double() * (delta @ w2)
    grad_w = grads.T @ x + noise * torch.randn(width, inputs, generator=g, dtype=torch.float64)
    return grad_w, grads.sum(0), w, b, x, grads


def test_the_entry_floor_reads_the_error_per_entry_from_the_spectrum():
    for noise in (1e-9, 1e-6):
        grad_w, *_ = _noisy_layer(noise=noise)
        spectrum = torch.linalg.svdvals(grad_w)
        assert abs(entry_floor(spectrum, 12, tuple(grad_w.shape)) / noise - 1) < 0.1
    assert entry_floor(torch.ones(5), 5, (40, 5)) == 0.0   # nothing past the rank: no error to read


def test_blurred_zeros_of_exact_directions_are_forgiven_and_a_mixture_is_not():
    grad_w, grad_b, w, b, x, grads = _noisy_layer(noise=1e-9)
    dec = decompose(grad_w, 12, 1e-12)
    left, right = dec.left, dec.right
    q = left.T @ grads.T                                          # the true directions, in the noisy basis
    floor = entry_floor(dec.spectrum, dec.rank, tuple(grad_w.shape))
    tight = 1e-13                                                 # a relative zero tolerance below the error
    blind = pattern_disagreements(left, right, w, b, grad_b, q, tight)
    assert (blind > 0).all()                                      # every exact sample "disagrees" without the band
    assert (pattern_disagreements(left, right, w, b, grad_b, q, tight, floor=floor, active_side=False) == 0).all()
    mixed = q.clone()
    mixed[:, 0] = q[:, 0] + q[:, 1]                               # a wrong column: two samples mixed
    wrong = pattern_disagreements(left, right, w, b, grad_b, mixed, tight, floor=floor, active_side=False)
    assert wrong[0] > 0 or wrong[1] > 0


def test_the_certificate_forgives_blurred_zeros_only_inside_the_band():
    grad_w, grad_b, w, b, x, grads = _noisy_layer(noise=1e-9, seed=1)
    dec = decompose(grad_w, 12, 1e-12)
    q = dec.left.T @ grads.T
    s, _ = scales(dec.left, q, grad_b)
    x_hat = torch.linalg.solve(q, dec.right) / s[:, None]
    deltas = (dec.left @ q * s[None, :]).T
    floor = entry_floor(dec.spectrum, dec.rank, tuple(grad_w.shape))
    band = zero_band(dec.right, q, floor) * s.abs()
    plain = certify(x_hat, deltas, w, b, grad_w, grad_b, zero_tol=1e-13, tol=1e-6)
    banded = certify(x_hat, deltas, w, b, grad_w, grad_b, zero_tol=1e-13, tol=1e-6, band=band)
    assert not plain.certified.any() and banded.certified.all()
    assert (band < deltas.abs().amax(1) * 1e-4).all()             # the band is far below every sample's scale
    mixed = q.clone()
    mixed[:, 0] = q[:, 0] + q[:, 1]
    s, _ = scales(dec.left, mixed, grad_b)
    x_mix = torch.linalg.solve(mixed, dec.right) / s[:, None]
    d_mix = (dec.left @ mixed * s[None, :]).T
    band = zero_band(dec.right, mixed, floor) * s.abs()
    wrong = certify(x_mix, d_mix, w, b, grad_w, grad_b, zero_tol=1e-13, tol=1e-6, band=band)
    assert not wrong.certified[:2].all()                          # the mixed pair is refused
