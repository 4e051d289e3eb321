"""Post-processing of reconstructions from trained weights (Haim et al. 2022, appendix B.3).

An attack on trained weights returns many candidates (several per training sample,
pooled across runs, in no order).  To pair them with the training set:

1. **Scaling** — each candidate is stretched to [0, 1] by its own min and max;
2. **Nearest neighbours** — for each training sample, the NCC of every candidate
   (:func:`ncc_matrix`, Lewis 1995);
3. **Voting** — the reconstruction of a training sample is the mean of the candidates
   whose NCC is at least ``ratio`` (0.9) of the best one's;
4. **Sorting** — each (training sample, reconstruction) pair gets its SSIM, and pairs
   are sorted by descending SSIM.

Haim et al.'s public code compares NCC *distances* with a ratio 1.1 after a bicubic
half-size downsampling; we follow the paper's text (similarity ≥ 0.9 × best, full size).
Vector data (N×d) has no SSIM: pairs are scored and sorted by NCC instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .image import _as_tensor, ssim

__all__ = ["scale_unit", "ncc_matrix", "vote", "VotingResult"]


def scale_unit(x: torch.Tensor) -> torch.Tensor:
    """Stretch each sample of ``x`` (N×…) linearly so its minimum is 0 and its maximum 1 (constant → 0)."""
    x = _as_tensor(x, "x")
    if x.dim() < 2 or x.shape[0] == 0:
        raise ConfigError(f"expected a batch N×… of samples, got shape {tuple(x.shape)} (argument x)")
    flat = x.reshape(x.shape[0], -1)
    lo = flat.min(dim=1, keepdim=True).values
    span = flat.max(dim=1, keepdim=True).values - lo
    out = (flat - lo) / torch.where(span > 0, span, torch.ones_like(span))
    return out.reshape(x.shape)


def ncc_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Normalised cross-correlation of every sample of ``a`` (Na×…) with every one of ``b`` (Nb×…); (Na, Nb)."""
    a, b = _as_tensor(a, "a"), _as_tensor(b, "b")
    if a.dim() < 2 or b.dim() < 2 or a.shape[1:] != b.shape[1:]:
        raise ConfigError(f"expected batches with the same per-sample shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    fa = a.reshape(a.shape[0], -1).to(torch.float64)
    fb = b.reshape(b.shape[0], -1).to(torch.float64).to(fa.device)
    fa = fa - fa.mean(1, keepdim=True)
    fb = fb - fb.mean(1, keepdim=True)
    fa = fa / fa.norm(dim=1, keepdim=True).clamp_min(1e-12)
    fb = fb / fb.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return fa @ fb.T


@dataclass
class VotingResult:
    """One reconstruction per training sample, paired and sorted.

    ``images[i]`` is the voted reconstruction of ``originals[i]`` (training order);
    ``nearest[i]`` the index of its best candidate, ``votes[i]`` how many candidates were
    averaged, ``ncc[i]`` the best NCC, ``score[i]`` the SSIM (NCC for vector data), and
    ``order`` the training indices sorted by descending score.
    """

    images: torch.Tensor
    nearest: torch.Tensor
    votes: torch.Tensor
    ncc: torch.Tensor
    score: torch.Tensor
    order: torch.Tensor
    metric: str

    def count(self, threshold: float) -> int:
        """Training samples whose reconstruction scores at least ``threshold``."""
        return int((self.score >= threshold).sum())


def vote(candidates: torch.Tensor, originals: torch.Tensor, *, ratio: float = 0.9, scale: bool = True,
         data_range: float = 1.0) -> VotingResult:
    """Pair each training sample with its best (voted) reconstruction (Haim et al. appendix B.3).

    ``candidates``: M×… reconstructions in any order and scale; ``originals``: N×… training
    samples in [0, data_range].  ``ratio``: candidates with NCC ≥ ratio × best NCC are averaged
    (a non-positive best NCC keeps only the best).  ``scale=False`` skips step 1.
    """
    cand, orig = _as_tensor(candidates, "candidates"), _as_tensor(originals, "originals")
    if cand.dim() < 2 or cand.shape[1:] != orig.shape[1:] or cand.shape[0] == 0 or orig.shape[0] == 0:
        raise ConfigError(f"expected candidates and originals with the same per-sample shape, got "
                          f"{tuple(cand.shape)} and {tuple(orig.shape)}")
    if not 0 < ratio <= 1:
        raise ConfigError(f"expected ratio in (0, 1], got {ratio!r} (argument ratio)")
    cand = cand.detach().to(torch.float64)
    orig = orig.detach().to(torch.float64).to(cand.device)
    if not torch.isfinite(cand).all():
        raise ConfigError("expected finite candidates (argument candidates)")
    if scale:
        cand = scale_unit(cand) * data_range
    sim = ncc_matrix(orig, cand)  # (N, M)
    best, nearest = sim.max(dim=1)
    cut = torch.where(best > 0, best * ratio, best)
    chosen = (sim >= cut[:, None]).to(cand.dtype)  # includes the best
    chosen[torch.arange(sim.shape[0]), nearest] = 1.0
    votes = chosen.sum(1)
    flat = (chosen @ cand.reshape(cand.shape[0], -1)) / votes[:, None]
    images = flat.reshape(orig.shape[0], *cand.shape[1:])
    if images.dim() == 4:
        score, metric = ssim(images, orig, data_range=data_range), "ssim"
    else:
        score = torch.diagonal(ncc_matrix(images, orig)).cpu()
        metric = "ncc"
    order = torch.argsort(score, descending=True)
    return VotingResult(images=images, nearest=nearest.cpu(), votes=votes.long().cpu(), ncc=best.cpu(),
                        score=score, order=order, metric=metric)
