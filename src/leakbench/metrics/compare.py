"""``compare``: score a reconstruction against the batch it came from.

The reconstruction is first matched one-to-one to the originals (Hungarian
method on per-pair MSE, Liu et al. 2024 eq. (1); see
:mod:`leakbench.metrics.matching`), then every per-sample score is taken on
the matched pairs and averaged.  Attacks that flag exactly recovered samples
(``confidence`` of only 0/1 values, e.g. ``robbing-the-fed``, ``exclusivity``)
are matched flags-first by default, so an exact slot is never scored against
another sample's original; ``result["matching"]`` says which matching was used.  The result is a plain dict of Python floats
and lists, ready for ``json.dumps``, the result store and the report.

Reconstructions are scored as given: they are not clamped to [0, 1] here, so
an attack (or the caller) that wants box-constrained scores clamps first.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from ..errors import ConfigError
from .identify import iip_with_chance, psnr_registered
from .image import _as_tensor, mse, psnr, ssim
from .matching import METHODS
from .matching import match as _match
from .perceptual import LPIPS_NETS, lpips_available, lpips_distance
from .registered import METRICS
from .scores import BUILTIN_SCORES, SCORES

__all__ = ["compare", "exact_flags", "flat_chance", "MATCHINGS"]

#: Values of ``compare(..., matching=)``: "auto" and the methods of :func:`leakbench.metrics.match`.
MATCHINGS = ("auto", *METHODS)


def exact_flags(reconstruction: Any) -> torch.Tensor | None:
    """The per-slot "exactly recovered" flags of a reconstruction, or None when it has none.

    A ``confidence`` tensor counts as flags when it has one entry per image, every entry is
    0 or 1, and at least one is 1 (attacks with graded scores — KKT multipliers, membership
    outputs — are not flags).
    """
    conf = getattr(reconstruction, "confidence", None)
    images = getattr(reconstruction, "images", None)
    if not isinstance(conf, torch.Tensor) or not isinstance(images, torch.Tensor):
        return None
    conf = conf.detach().reshape(-1).cpu()
    if conf.numel() != images.shape[0] or conf.numel() == 0:
        return None
    if conf.dtype == torch.bool:
        return conf if bool(conf.any()) else None
    if not bool(((conf == 0) | (conf == 1)).all()) or not bool((conf == 1).any()):
        return None
    return conf == 1


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


#: the scores :func:`compare` computes itself (the others of ``METRICS`` by :func:`registered`)
OWN = ("mse", "rmse", "psnr", "ssim", "label_acc", "label_count_acc", "lpips", "psnr_registered")


def _metric_values(name: str, reconstruction: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The B values of the registered metric ``name``; a failing metric, a wrong count or a NaN is one line."""
    try:
        values = METRICS.get(name)(reconstruction, x)
        values = torch.as_tensor(values).detach().to("cpu", torch.float64).reshape(-1)
    except Exception as err:  # noqa: BLE001 - a plug-in's metric: one line naming it
        first = " ".join(str(err).split())[:160]
        raise ConfigError(f"metric {name!r} (from {METRICS.origin(name)}) failed: {type(err).__name__}: {first}; "
                          "a metric takes (reconstruction, original), both B×C×H×W, and returns B values") from None
    if values.numel() != x.shape[0]:
        raise ConfigError(f"metric {name!r} (from {METRICS.origin(name)}) returned {values.numel()} value(s) for a "
                          f"batch of {x.shape[0]}; a metric returns one value per sample (shape (B,))")
    if torch.isnan(values).any():  # NaN is a failure, not a score (±inf is a limit, e.g. PSNR of an exact copy)
        i = int(torch.isnan(values).nonzero()[0])
        raise ConfigError(f"metric {name!r} (from {METRICS.origin(name)}) returned NaN for sample {i}; a metric "
                          "returns a number for every pair (guard its divisions)")
    return values


def registered(matched: torch.Tensor, x: torch.Tensor, result: dict[str, Any], per_sample: dict[str, list], *,
               flat: torch.Tensor | None = None) -> None:
    """Every other metric of ``METRICS`` (a plug-in's too) on the matched pairs: its mean into ``result``, its
    per-sample values into ``per_sample``; with ``flat`` (a flat image at the chance level), its chance level
    ``result["chance_<name>"]`` (the same metric on that image).  A score listed in ``SCORES`` with no function
    is refused."""
    orphans = [n for n in SCORES if n not in BUILTIN_SCORES and n not in METRICS]
    if orphans:
        raise ConfigError(f"score {orphans[0]!r} is listed in SCORES but has no function in METRICS, so nothing can "
                          "compute it; register it with @leakbench.metrics.register(name, higher_is_better=...) "
                          "(docs/plugins.md)")
    for name in METRICS.names():
        if name in OWN:
            continue
        values = _metric_values(name, matched, x)
        per_sample[name] = values.tolist()
        result[name] = _mean(values)
        if flat is not None:
            result[f"chance_{name}"] = _mean(_metric_values(name, flat, x))


def flat_chance(x: torch.Tensor, level: float, *, data_range: float = 1.0) -> dict[str, Any]:
    """The chance level of a batch: the scores of a flat image at ``level`` (a sweep's is the dataset's mean pixel
    value) — what an attack that learnt nothing about the batch still gets.

    ``{"chance_rmse", "chance_psnr", "per_sample": [each image's own chance RMSE, original order]}``; the RMSE
    over the batch is sqrt(mean((x − level)²)), PSNR = 10·log10(data_range² / that MSE) (inf for a flat batch).
    """
    err = (x.detach().double() - float(level)).pow(2)
    mse_all = float(err.mean())
    return {"chance_rmse": mse_all ** 0.5,
            "chance_psnr": 10 * math.log10(data_range ** 2 / mse_all) if mse_all > 0 else math.inf,
            "per_sample": err.flatten(1).mean(1).sqrt().tolist()}


def _identify(matched: torch.Tensor, x: torch.Tensor, pool: Any, level: float, result: dict[str, Any],
              per_sample: dict[str, list], feature_fn: Any) -> None:
    """IIP (pixel, and features with ``feature_fn``) of the matched pairs against ``pool``, each with its chance."""
    pool = _as_tensor(pool, "pool").detach().to(x.device)
    spaces = [("pixel", None)] + ([("features", feature_fn)] if feature_fn is not None else [])
    for space, fn in spaces:
        found, chance = iip_with_chance(matched, x, pool, level, space=space, feature_fn=fn)
        per_sample[f"iip_{space}"] = found.identified.double().tolist()
        result[f"iip_{space}"] = found.rate
        result[f"chance_iip_{space}"] = chance


def compare(
    reconstruction: Any,
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    match: bool = True,
    lpips: bool = False,
    data_range: float = 1.0,
    cost: str = "mse",
    matching: str = "auto",
    chance_level: float | None = None,
    pool: torch.Tensor | None = None,
    feature_fn: Any = None,
    lpips_weights: Any = None,
) -> dict[str, Any]:
    """Score ``reconstruction`` against the original batch ``x`` (labels ``y``).

    ``reconstruction`` is a tensor of the same per-sample shape as ``x`` or any
    object with an ``images`` tensor and optionally ``labels`` (class indices
    of shape (N,) or scores of shape (N, K), argmax taken), such as
    ``leakbench.attacks.Reconstruction``.  There may be more reconstructions
    than originals when ``match`` is true.

    With ``match`` (default) the reconstructions are assigned one-to-one to the
    originals by ``matching``: ``"total-mse"`` minimises the total ``cost``
    ("mse" or "negcos"), Liu et al. 2024 eq. (1); ``"confident-first"`` matches
    the slots the attack flags as exact first (its ``confidence``, see
    :func:`exact_flags`), then eq. (1) on the rest; ``"minmax"`` minimises the
    largest per-pair cost; ``"auto"`` (default) is "confident-first" when the
    reconstruction carries exact flags and "total-mse" otherwise.  With
    ``match=False`` reconstruction i is compared with original i (counts must
    then be equal; ``matching`` is then "identity").

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
    - every other metric of ``leakbench.metrics.METRICS`` (``"cosine"``, a plug-in's registered with
      :func:`leakbench.metrics.register`): the mean of its per-sample values on the matched pairs, and for
      floating-point data ``"chance_<name>"``, the same metric on the flat image at ``chance_level``.  A metric
      that returns NaN is refused (one line naming it).
    - ``"lpips"``: mean LPIPS distance when ``lpips=True`` and LPIPS can run
      offline, else None; when it was asked for but cannot run,
      ``"lpips_missing"`` holds the reason.  ``lpips_weights``: a directory of user-supplied weights in the
      ``lpips`` package layout (default ``$LEAKBENCH_LPIPS_WEIGHTS``; :mod:`leakbench.metrics.perceptual`);
      ``"chance_lpips"``: the LPIPS of the flat image at ``chance_level``.
    - ``"chance_rmse"``, ``"chance_psnr"``: the chance level (:func:`flat_chance`),
      the scores of a flat image at ``chance_level``, by default the batch's
      mean pixel value; a sweep and ``leakbench attack`` pass the dataset's
      mean (``chance_level=float(data.images.mean())``).  An RMSE at or above
      ``chance_rmse`` (a PSNR at or below ``chance_psnr``) means the attack
      learnt nothing a flat image does not show — not that the data is safe.
    - ``"psnr_registered"``: mean PSNR after the best circular shift of at most 2 pixels each way
      (:func:`leakbench.metrics.identify.psnr_registered`), None for non-images; ``"chance_psnr_registered"``
      the same metric on the flat image at ``chance_level``.
    - with ``pool`` (P×… images holding every original, e.g. the batch plus a seeded draw of the dataset):
      ``"iip_pixel"``, the fraction of originals whose matched reconstruction's nearest pool image (pixel space)
      is that original (breaching's IIP, :func:`leakbench.metrics.identify.iip`), and ``"chance_iip_pixel"``,
      the IIP of the flat image at ``chance_level``; with ``feature_fn`` (images → B×D) also ``"iip_features"``
      and ``"chance_iip_features"`` in that feature space.  Per-sample 1.0/0.0 in ``per_sample``.
    - ``"per_sample"``: lists of the per-original values of each metric that
      is not None (label_acc as 1.0/0.0), and each image's ``chance_rmse``.
    - ``"order"``: the matching, ``order[i]`` = index of the reconstruction
      paired with original i.
    - ``"matching"``: the matching used: "total-mse", "confident-first",
      "minmax" or "identity".

    Scores are taken on the reconstruction as given (no clamping).  A
    reconstruction containing NaN gives NaN scores (``json.dumps`` writes them
    as NaN).
    """
    trace = getattr(reconstruction, "trace", None)
    if (isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() == 2
            or isinstance(trace, dict) and trace.get("modality") == "text"):
        raise ConfigError("expected images, got token ids (a text batch): score text with "
                          "leakbench.metrics.text_scores(rec.images, x, decode=data.tokenizer.decode, "
                          "pad_id=data.pad_id, eos_id=data.tokenizer.eos_id) (docs/text.md)")
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
    if matching not in MATCHINGS:
        raise ConfigError(f"expected matching one of {', '.join(MATCHINGS)}, got {matching!r} (field matching)")
    flags = exact_flags(reconstruction)
    if matching == "auto":
        matching = "confident-first" if flags is not None else "total-mse"
    if match:
        if matching == "confident-first" and flags is None:
            raise ConfigError("matching='confident-first' needs a reconstruction whose confidence flags exact "
                              "slots with 0/1 values (field matching; use 'auto' or 'total-mse')")
        order = _match(rec, x, cost=cost, method=matching, confident=flags)
    else:
        matching = "identity"
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
        pr = psnr_registered(matched, x, data_range=data_range)
        per_sample["psnr_registered"] = pr.tolist()
        result["psnr_registered"] = _mean(pr)
    else:
        result["ssim"] = result["psnr_registered"] = None

    if x.is_floating_point():
        level = float(x.double().mean()) if chance_level is None else float(chance_level)
    registered(matched, x, result, per_sample, flat=torch.full_like(x, level) if x.is_floating_point() else None)

    if x.is_floating_point():
        chance = flat_chance(x, level, data_range=data_range)
        per_sample["chance_rmse"] = chance.pop("per_sample")
        result.update(chance)
        if is_image:  # a flat image is shift-invariant: the same metric on it, per sample, then the mean
            result["chance_psnr_registered"] = _mean(psnr_registered(torch.full_like(x, level), x,
                                                                     data_range=data_range))
        if pool is not None:
            _identify(matched, x, pool, level, result, per_sample, feature_fn)

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
        ok, reason = lpips_available(weights=lpips_weights)
        min_side = LPIPS_NETS["alex"][2]
        if ok and not (is_image and x.shape[1] in (1, 3)):
            ok, reason = False, f"LPIPS needs grayscale or RGB images B×C×H×W, got shape {tuple(x.shape)}"
        elif ok and min(x.shape[2], x.shape[3]) < min_side:
            ok, reason = False, (
                f"LPIPS (AlexNet) needs images of at least {min_side}×{min_side} pixels, "
                f"got {x.shape[2]}×{x.shape[3]}"
            )
        if ok:
            lp = lpips_distance(matched, x, weights=lpips_weights)
            per_sample["lpips"] = lp.tolist()
            result["lpips"] = _mean(lp)
            level = float(x.double().mean()) if chance_level is None else float(chance_level)
            result["chance_lpips"] = _mean(lpips_distance(torch.full_like(x, level), x, weights=lpips_weights))
        else:
            result["lpips_missing"] = reason

    result["per_sample"] = per_sample
    result["order"] = order.tolist()
    result["matching"] = matching
    return result
