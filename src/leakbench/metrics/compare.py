"""``compare``: score a reconstruction against the batch it came from.

The reconstruction is first matched one-to-one to the originals (Hungarian
method on per-pair MSE, Liu et al. 2024 eq. (1); see
:mod:`leakbench.metrics.matching`), then every per-sample score is taken on
the matched pairs and averaged.  The result is a plain dict of Python floats
and lists, ready for ``json.dumps``, the result store and the report.

Reconstructions are scored as given: they are not clamped to [0, 1] here, so
an attack (or the caller) that wants box-constrained scores clamps first.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ..errors import ConfigError
from .image import _as_tensor, mse, psnr, ssim
from .matching import match as _match
from .perceptual import LPIPS_NETS, lpips_available, lpips_distance

__all__ = ["compare"]


def _unpack(reconstruction: Any) -> tuple[torch.Tensor, Any]:
    """(images, labels) of a tensor or of any object with ``.images`` (and maybe ``.labels``)."""
    if isinstance(reconstruction, torch.Tensor):
        return reconstruction, None
    if hasattr(reconstruction, "images"):
        return _as_tensor(reconstruction.images, "reconstruction.images"), getattr(reconstruction, "labels", None)
    try:
        return _as_tensor(reconstruction, "reconstruction"), None
    except ConfigError:
        raise ConfigError(
            "expected a tensor or an object with an `images` tensor (e.g. a Reconstruction), "
            f"got {type(reconstruction).__name__} (field reconstruction)"
        ) from None


def _class_indices(labels: Any, n: int, field: str) -> torch.Tensor:
    """Labels as a 1-D int64 CPU tensor of length ``n``: argmax of 2-D scores, rounding of floats."""
    t = labels if isinstance(labels, torch.Tensor) else torch.as_tensor(labels)
    t = t.detach().cpu()
    if t.ndim == 2:
        t = t.argmax(dim=1)
    if t.ndim != 1 or t.shape[0] != n:
        raise ConfigError(
            f"expected {n} labels (shape ({n},) of class indices or ({n}, K) of scores), "
            f"got shape {tuple(t.shape)} (field {field})"
        )
    if t.is_floating_point():
        t = t.round()
    return t.to(torch.int64)


def _mean(values: torch.Tensor) -> float:
    return float(values.mean().item())


def compare(
    reconstruction: Any,
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    match: bool = True,
    lpips: bool = False,
    data_range: float = 1.0,
    cost: str = "mse",
) -> dict[str, Any]:
    """Score ``reconstruction`` against the original batch ``x`` (labels ``y``).

    ``reconstruction`` is a tensor of the same per-sample shape as ``x`` or any
    object with an ``images`` tensor and optionally ``labels`` (class indices
    of shape (N,) or scores of shape (N, K), argmax taken), such as
    ``leakbench.attacks.Reconstruction``.  There may be more reconstructions
    than originals when ``match`` is true.

    With ``match`` (default) the reconstructions are assigned one-to-one to the
    originals minimising the total ``cost`` ("mse" or "negcos"), Liu et al.
    2024 eq. (1); with ``match=False`` reconstruction i is compared with
    original i (counts must then be equal).

    Returns a JSON-serialisable dict:

    - ``"mse"``, ``"psnr"``, ``"ssim"``: means over the B matched pairs of the
      per-sample scores (ssim is None for non-image data, i.e. not B×C×H×W).
      PSNR uses ``data_range`` and is capped at 200 dB for range 1 (see
      :func:`leakbench.metrics.psnr`).
    - ``"rmse"``: ``sqrt(mse)`` of the batch, i.e. the per-pixel version of
      Liu et al.'s reconstruction error (eq. (1)); the per-sample RMSEs are in
      ``per_sample["rmse"]`` (their mean is ≤ this value).
    - ``"label_acc"``: fraction of originals whose matched reconstruction's
      label equals ``y``; None without recovered labels or without ``y``.
    - ``"label_count_acc"``: |multiset of matched recovered labels ∩ multiset
      of y| / B — batch-level label recovery, independent of the pairing when
      there are as many reconstructions as originals; None like label_acc.
    - ``"lpips"``: mean LPIPS distance when ``lpips=True`` and LPIPS can run
      offline, else None; when it was asked for but cannot run,
      ``"lpips_missing"`` holds the reason.
    - ``"per_sample"``: lists of the per-original values of each metric that
      is not None (label_acc as 1.0/0.0).
    - ``"order"``: the matching, ``order[i]`` = index of the reconstruction
      paired with original i.

    Scores are taken on the reconstruction as given (no clamping).  A
    reconstruction containing NaN gives NaN scores (``json.dumps`` writes them
    as NaN).
    """
    rec, rec_labels = _unpack(reconstruction)
    x = _as_tensor(x, "x")
    if x.ndim < 2 or x.shape[0] == 0 or x[0].numel() == 0:
        raise ConfigError(f"expected a non-empty batch x of shape B×…, got {tuple(x.shape)} (field x)")
    if rec.ndim != x.ndim or rec.shape[1:] != x.shape[1:]:
        raise ConfigError(
            f"expected reconstruction of per-sample shape {tuple(x.shape[1:])} like x, "
            f"got reconstruction {tuple(rec.shape)} and x {tuple(x.shape)}"
        )
    b = x.shape[0]
    if match:
        order = _match(rec, x, cost=cost)
    else:
        if rec.shape[0] != b:
            raise ConfigError(
                f"expected as many reconstructions as originals with match=False, got {rec.shape[0]} and {b} "
                "(pass match=True, or slice the reconstruction)"
            )
        order = torch.arange(b)
    matched = rec[order.to(rec.device)]

    per_sample: dict[str, list] = {}
    result: dict[str, Any] = {}

    err = mse(matched, x)
    per_sample["mse"] = err.tolist()
    per_sample["rmse"] = err.sqrt().tolist()
    result["mse"] = _mean(err)
    result["rmse"] = float(err.mean().sqrt().item())
    ps = psnr(matched, x, data_range=data_range)
    per_sample["psnr"] = ps.tolist()
    result["psnr"] = _mean(ps)
    is_image = x.ndim == 4
    if is_image:
        ss = ssim(matched, x, data_range=data_range)
        per_sample["ssim"] = ss.tolist()
        result["ssim"] = _mean(ss)
    else:
        result["ssim"] = None

    result["label_acc"] = None
    result["label_count_acc"] = None
    if rec_labels is not None and y is not None:
        got = _class_indices(rec_labels, rec.shape[0], "reconstruction.labels")[order]
        want = _class_indices(y, b, "y")
        correct = (got == want).to(torch.float64)
        per_sample["label_acc"] = correct.tolist()
        result["label_acc"] = _mean(correct)
        common = Counter(got.tolist()) & Counter(want.tolist())
        result["label_count_acc"] = sum(common.values()) / b

    result["lpips"] = None
    if lpips:
        ok, reason = lpips_available()
        min_side = LPIPS_NETS["alex"][2]
        if ok and not (is_image and x.shape[1] in (1, 3)):
            ok, reason = False, f"LPIPS needs grayscale or RGB images B×C×H×W, got shape {tuple(x.shape)}"
        elif ok and min(x.shape[2], x.shape[3]) < min_side:
            ok, reason = False, (
                f"LPIPS (AlexNet) needs images of at least {min_side}×{min_side} pixels, "
                f"got {x.shape[2]}×{x.shape[3]}"
            )
        if ok:
            lp = lpips_distance(matched, x)
            per_sample["lpips"] = lp.tolist()
            result["lpips"] = _mean(lp)
        else:
            result["lpips_missing"] = reason

    result["per_sample"] = per_sample
    result["order"] = order.tolist()
    return result
