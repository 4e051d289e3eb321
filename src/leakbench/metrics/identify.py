"""Identifiability and shift-tolerant scores: IIP (image identifiability precision) and registered PSNR.

- :func:`iip` — breaching's IIP (Geiping et al.'s ``breaching`` library): a reconstruction is *identified* when
  its nearest neighbour in a pool of candidate images (which holds the originals) is its own original.  The
  distance is Euclidean in pixel space (``space="pixel"``) or in the space of a fixed feature map
  (``space="features"``, e.g. :func:`random_features` or a model's penultimate layer).  Batched with
  :func:`torch.cdist`, no loop over samples or pixels.
- :func:`iip_chance` — the same metric on a flat image at the data mean: its nearest neighbour is one fixed pool
  image, so it identifies at most the originals equal to that image (≈ 1/pool size for a random batch).
- :func:`psnr_registered` — PSNR after the best integer shift (|dx|, |dy| ≤ ``max_shift``) of the reconstruction,
  circular (``torch.roll``, so no padding value enters the score), for attacks whose result is right but off by
  a few pixels.  A flat image is shift-invariant, so its chance level is its plain PSNR.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .image import MSE_FLOOR, _as_tensor, _f64

__all__ = ["IIPResult", "iip", "iip_chance", "iip_with_chance", "random_features", "penultimate_features", "psnr_registered",
           "registered_shift", "SPACES"]

#: the values of ``iip(..., space=)``
SPACES = ("pixel", "features")


FeatureFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class IIPResult:
    """``rate``: the fraction of reconstructions identified; ``identified`` (B,) bool; ``neighbour`` (B,) the pool
    index of each reconstruction's nearest neighbour."""

    rate: float
    identified: torch.Tensor
    neighbour: torch.Tensor


def _flat(t: torch.Tensor) -> torch.Tensor:
    return _f64(t.detach()).reshape(t.shape[0], -1)


def _embed(t: torch.Tensor, space: str, feature_fn: FeatureFn | None) -> torch.Tensor:
    if space == "pixel":
        return _flat(t)
    with torch.no_grad():
        out = feature_fn(t.detach().float())  # type: ignore[misc]
    if not isinstance(out, torch.Tensor) or out.shape[0] != t.shape[0]:
        raise ConfigError(f"expected feature_fn to return one feature row per image ({t.shape[0]}), got "
                          f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))} (field feature_fn)")
    return _f64(out).reshape(t.shape[0], -1)


def _checked(rec: object, x: object, pool: object, space: str,
             feature_fn: FeatureFn | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rec = _as_tensor(rec, "reconstructions")
    x = _as_tensor(x, "originals")
    pool = _as_tensor(pool, "pool")
    if space not in SPACES:
        raise ConfigError(f"expected space one of {', '.join(SPACES)}, got {space!r} (field space)")
    if space == "features" and not callable(feature_fn):
        raise ConfigError("expected a callable feature_fn(images) -> B×D with space='features', got "
                          f"{type(feature_fn).__name__} (field feature_fn)")
    if rec.shape != x.shape or x.ndim < 2 or x.shape[0] == 0:
        raise ConfigError(f"expected reconstructions and originals of the same shape B×…, got {tuple(rec.shape)} "
                          f"and {tuple(x.shape)} (field reconstructions)")
    if pool.ndim != x.ndim or pool.shape[1:] != x.shape[1:] or pool.shape[0] == 0:
        raise ConfigError(f"expected a pool of shape P×{'×'.join(map(str, x.shape[1:]))} like the originals, got "
                          f"{tuple(pool.shape)} (field pool)")
    return rec, x, pool.to(x.device)


def _owners(x: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """B×P bool: pool row j is an exact copy of original i.  Candidates by (fast) distance, then compared exactly,
    so the B×P×D comparison is never materialised."""
    xf, pf = _flat(x), _flat(pool)
    near = torch.cdist(xf, pf) <= 1e-3 * (xf.shape[1] ** 0.5)
    i, j = near.nonzero(as_tuple=True)
    same = torch.zeros_like(near)
    exact = (xf[i] == pf[j]).all(dim=1)
    same[i[exact], j[exact]] = True
    missing = (~same.any(1)).nonzero().flatten()
    if missing.numel():
        raise ConfigError(f"expected a pool that holds every original, but original {int(missing[0])} is not in it "
                          "(field pool: the batch's originals plus other images)")
    return same


def _result(same: torch.Tensor, queries: torch.Tensor, pool_emb: torch.Tensor) -> IIPResult:
    neighbour = torch.cdist(queries, pool_emb).argmin(dim=1)
    identified = same.gather(1, neighbour[:, None]).squeeze(1)
    return IIPResult(float(identified.double().mean()), identified.cpu(), neighbour.cpu())


def iip(reconstructions: torch.Tensor, originals: torch.Tensor, pool: torch.Tensor, *, space: str = "pixel",
        feature_fn: FeatureFn | None = None) -> IIPResult:
    """Image identifiability precision: is reconstruction ``i``'s nearest neighbour in ``pool`` original ``i``?

    ``reconstructions`` and ``originals`` are B×… paired row by row (match them first, as :func:`compare` does);
    ``pool`` is P×… with the same per-sample shape and holds every original (an exact copy).  A neighbour counts as
    the original when it equals it exactly, so duplicates of an original in the pool all count.  Ties go to the
    lowest pool index.  ``space="features"`` measures the distance between ``feature_fn(images)`` rows instead.
    """
    rec, x, pool = _checked(reconstructions, originals, pool, space, feature_fn)
    same = _owners(x, pool)
    return _result(same, _embed(rec, space, feature_fn).to(x.device), _embed(pool, space, feature_fn).to(x.device))


def iip_with_chance(reconstructions: torch.Tensor, originals: torch.Tensor, pool: torch.Tensor, level: float, *,
                    space: str = "pixel", feature_fn: FeatureFn | None = None) -> tuple[IIPResult, float]:
    """:func:`iip` and :func:`iip_chance` together, the pool compared and embedded once."""
    rec, x, pool = _checked(reconstructions, originals, pool, space, feature_fn)
    same = _owners(x, pool)
    pool_emb = _embed(pool, space, feature_fn).to(x.device)
    queries = _embed(torch.cat([rec.to(x.device, x.dtype), torch.full_like(x[:1], float(level))]), space,
                     feature_fn).to(x.device)
    flat = queries[-1:].expand(x.shape[0], -1)
    return _result(same, queries[:-1], pool_emb), _result(same, flat, pool_emb).rate


def iip_chance(originals: torch.Tensor, pool: torch.Tensor, level: float, *, space: str = "pixel",
               feature_fn: FeatureFn | None = None) -> float:
    """IIP of a flat image at ``level`` (the data mean) in place of every reconstruction: what an attack that
    learnt nothing scores.  The flat image has one nearest neighbour, so this is the fraction of originals equal to
    that one pool image (1/B at most for distinct originals, ≈ 1/pool size for a random batch)."""
    x = _as_tensor(originals, "originals")
    return iip(torch.full_like(x, float(level)), x, pool, space=space, feature_fn=feature_fn).rate


def random_features(shape: tuple[int, ...], *, dim: int = 256, seed: int = 0) -> FeatureFn:
    """A fixed random feature map for ``iip(space="features")``: ReLU of a seeded Gaussian projection of the
    centred, flattened image (``shape`` = C×H×W), ``dim`` features.  Deterministic for a seed."""
    if int(dim) < 1:
        raise ConfigError(f"expected dim ≥ 1, got {dim!r} (field dim)")
    n = 1
    for s in shape:
        n *= int(s)
    g = torch.Generator().manual_seed(int(seed))
    weight = torch.randn(n, int(dim), generator=g, dtype=torch.float64) / n ** 0.5

    def features(images: torch.Tensor) -> torch.Tensor:
        flat = _f64(images).reshape(images.shape[0], -1)
        if flat.shape[1] != n:
            raise ConfigError(f"expected images of {n} values each for these random features, got {flat.shape[1]} "
                              "(field images)")
        return torch.relu((flat - 0.5) @ weight.to(flat.device))

    return features


def penultimate_features(model: torch.nn.Module) -> FeatureFn:
    """The model's penultimate features for ``iip(space="features")``: the input of its last ``nn.Linear`` (in
    module order), taken in eval mode without gradients; the model's mode is restored and nothing is trained."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        raise ConfigError(f"expected a model with a linear output layer for penultimate features, got "
                          f"{type(model).__name__} without nn.Linear (field model)")
    layer = linears[-1]

    def features(images: torch.Tensor) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        hook = layer.register_forward_hook(lambda _m, inp, _out: seen.append(inp[0].detach()))
        was = model.training
        first = next(model.parameters())
        try:
            model.eval()
            with torch.no_grad():
                model(images.to(first.device, first.dtype))
        finally:
            hook.remove()
            model.train(was)
        return seen[-1].reshape(images.shape[0], -1)

    return features


def _shifted_mse(a: torch.Tensor, b: torch.Tensor, max_shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(S×B MSE of every circular shift of ``a`` against ``b``, the S×2 shifts (dy, dx))."""
    if a.shape != b.shape or a.ndim != 4 or a.shape[0] == 0:
        raise ConfigError(f"expected two image batches B×C×H×W of the same shape, got {tuple(a.shape)} and "
                          f"{tuple(b.shape)} (field reconstruction)")
    if isinstance(max_shift, bool) or not isinstance(max_shift, int) or max_shift < 0:
        raise ConfigError(f"expected max_shift an integer ≥ 0, got {max_shift!r} (field max_shift)")
    a, b = _f64(a), _f64(b)
    r = range(-max_shift, max_shift + 1)
    shifts = torch.tensor([(dy, dx) for dy in r for dx in r], dtype=torch.long)
    rolled = torch.stack([torch.roll(a, (dy, dx), dims=(2, 3)) for dy, dx in shifts.tolist()])  # S×B×C×H×W
    return (rolled - b).pow(2).flatten(2).mean(2), shifts


def psnr_registered(a: torch.Tensor, b: torch.Tensor, *, data_range: float = 1.0, max_shift: int = 2) -> torch.Tensor:
    """PSNR of each pair after the best circular integer shift of ``a`` (|dy|, |dx| ≤ ``max_shift``), shape (B,).

    Equal to :func:`leakbench.metrics.psnr` when ``max_shift=0``; MSE floored like it (200 dB cap for range 1)."""
    err, _ = _shifted_mse(_as_tensor(a, "a"), _as_tensor(b, "b"), max_shift)
    best = err.min(dim=0).values.clamp_min(MSE_FLOOR)
    return 10 * torch.log10(torch.as_tensor(float(data_range) ** 2, dtype=torch.float64, device=best.device) / best)


def registered_shift(a: torch.Tensor, b: torch.Tensor, *, max_shift: int = 2) -> torch.Tensor:
    """The (dy, dx) circular shift of each ``a[i]`` that best matches ``b[i]`` (``torch.roll(a, (dy, dx))``),
    shape (B, 2); the first of equal shifts in row-major order from (−max_shift, −max_shift)."""
    err, shifts = _shifted_mse(_as_tensor(a, "a"), _as_tensor(b, "b"), max_shift)
    return shifts[err.argmin(dim=0).cpu()]
