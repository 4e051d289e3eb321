"""Datasets that need no network and no files.

- ``digits``: scikit-learn's 1 797 handwritten 8×8 digits, optionally upsampled and (``deform``) each given
  its own seeded affine and elastic deformation (Simard, Steinkraus & Platt 2003), so that 28×28 batches are
  linearly independent like real MNIST digits (upsampled alone, any number of them span ~55 dimensions).
- ``photos``: patches cut from scikit-image's bundled colour photographs; natural
  image statistics for gradient-inversion tests without CIFAR on disk.
- ``sphere``: points uniform on the sphere of radius √d with ±1 labels (the
  membership experiment of the provable-attacks-on-shallow-networks paper).
- ``gaussian-mixture``: isotropic Gaussian classes in R^d.
"""
from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .checks import MAX_BYTES, apply_limit, check_bytes, choice, float_option, int_option, set_channels
from .dataset import ImageDataset

#: scikit-image photos that ship with the package (``cat`` duplicates ``chelsea``).
PHOTO_NAMES: tuple[str, ...] = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "immunohistochemistry",
    "hubble_deep_field",
    "retina",
    "colorwheel",
)

#: patches whose pixel standard deviation is below this are dropped (near constant).
MIN_PATCH_STD = 0.02


# ------------------------------------------------------------------ digits
def digits(
    *,
    size: int = 8,
    channels: int = 1,
    binary: str | None = None,
    limit: int | None = None,
    deform: float = 0.0,
    seed: int = 0,
    offset: int = 0,
) -> ImageDataset:
    """scikit-learn's handwritten digits (1 797 images, 8×8, 10 classes), scaled to [0,1].

    ``offset`` skips the first images (then ``limit`` keeps the next ones): ``offset=1000`` is the range the
    library's learned image prior never trains on (:data:`leakbench.models.prior.PUBLIC_DIGITS` is 0–999), so a
    sweep that attacks with ``gias`` or ``gifd`` draws its images there.
    ``size`` > 8 upsamples bilinearly; ``channels=3`` repeats the grey channel;
    ``binary="odd-even"`` relabels even digits 0 and odd digits 1; ``deform`` > 0 (1 = MNIST-like variation)
    gives every image its own random affine and elastic deformation drawn from ``seed`` (see :func:`deformed`).
    """
    from sklearn.datasets import load_digits

    size = int_option(size, field="size", minimum=8)
    deform = float_option(deform, field="deform")
    if not 0 <= deform <= 4:
        raise ConfigError(f"expected 0 ≤ deform ≤ 4 (0 = none, 1 = MNIST-like), got {deform!r} (field deform)")
    seed = int_option(seed, field="seed", minimum=0)
    choice(channels, field="channels", allowed=(1, 3))
    choice(binary, field="binary", allowed=(None, "odd-even"))
    bunch = load_digits()
    offset = int_option(offset, field="offset", minimum=0)
    if offset >= len(bunch.target):
        raise ConfigError(f"expected offset < {len(bunch.target)} (the digits there are), got {offset} (field offset)")
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    if not deform:   # deformed: every image's draw is the same with or without a limit or offset (applied after)
        images, labels = apply_limit(images[offset:], labels[offset:], limit)
    largest = int(math.sqrt(MAX_BYTES / 4 / (channels * len(images))))
    check_bytes(len(images), channels * size * size, field="size", value=size,
                fix=f"use size ≤ {largest} or fewer images (limit=...)")
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False).clamp_(0, 1)
    if deform > 0:
        images, labels = apply_limit(deformed(images, deform, seed)[offset:], labels[offset:], limit)
    images = set_channels(images, channels)
    classes = [str(k) for k in range(10)]
    if binary == "odd-even":
        labels, classes = labels % 2, ["even", "odd"]
    return ImageDataset(images.contiguous(), labels, classes, "digits")


#: at deform = 1: rotation (degrees), log-scale, shear and translation (fraction of the side) standard deviations,
#: and the elastic field's amplitude α and smoothing σ in pixels of a 28×28 image (Simard et al. 2003 use σ = 4).
_AFFINE = {"rotate": 8.0, "scale": 0.08, "shear": 0.1, "shift": 0.05}
_ELASTIC = {"alpha": 1.0, "sigma": 4.0}


def deformed(images: torch.Tensor, strength: float, seed: int) -> torch.Tensor:
    """Each N×C×H×W image in [0,1] warped by its own random affine map and elastic field (one generator, ``seed``).

    The elastic field is Simard et al.'s (ICDAR 2003, Sec. 2): uniform displacements in [−1, 1] per pixel,
    smoothed by a Gaussian of σ pixels and scaled by α; the affine part draws rotation, anisotropic scale, shear
    and translation.  Both are applied in one bilinear resampling (zeros outside); deterministic given ``seed``.
    """
    n, _, h, w = images.shape
    gen = torch.Generator().manual_seed(seed)
    normal = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    angle = torch.deg2rad(strength * _AFFINE["rotate"] * normal(n))
    sx, sy = (strength * _AFFINE["scale"] * normal(2, n)).exp()
    shear = strength * _AFFINE["shear"] * normal(n)
    tx, ty = 2 * strength * _AFFINE["shift"] * normal(2, n)
    cos, sin = angle.cos(), angle.sin()
    theta = torch.stack([torch.stack([sx * cos, sx * (shear * cos - sin), tx], 1),
                         torch.stack([sy * sin, sy * (shear * sin + cos), ty], 1)], 1)
    grid = F.affine_grid(theta, [n, 1, h, w], align_corners=False)
    # elastic: smoothed uniform noise per pixel, in pixels of a 28-pixel side (scaled to this size)
    sigma = _ELASTIC["sigma"] * h / 28
    radius = max(1, int(3 * sigma))
    taps = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=torch.float64) / sigma) ** 2)
    taps = taps / taps.sum()
    field = 2 * torch.rand(n * 2, 1, h, w, generator=gen, dtype=torch.float64) - 1
    field = F.conv2d(F.pad(field, (radius, radius, 0, 0), mode="reflect"), taps.view(1, 1, 1, -1))
    field = F.conv2d(F.pad(field, (0, 0, radius, radius), mode="reflect"), taps.view(1, 1, -1, 1))
    field = field / field.flatten(1).std(1).clamp_min(1e-12).view(-1, 1, 1, 1)   # unit std, then α pixels
    shift = (strength * _ELASTIC["alpha"] * field).view(n, 2, h, w).permute(0, 2, 3, 1)
    grid = grid + shift * torch.tensor([2.0 / w, 2.0 / h], dtype=torch.float64)
    out = F.grid_sample(images.double(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.clamp_(0, 1).to(images.dtype).contiguous()


# ------------------------------------------------------------------ photos
@functools.lru_cache(maxsize=64)
def _photo(name: str, scale: int | None, size: int) -> np.ndarray | None:
    """One bundled photo as float H×W×3 in [0,1], downscaled; None if it cannot be loaded offline."""
    import skimage.data
    from skimage.transform import resize
    from skimage.util import img_as_float32

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = getattr(skimage.data, name)()
    except Exception:  # not bundled and no network: skip this photo
        return None
    img = img_as_float32(img)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    img = img[..., :3]
    h, w = img.shape[:2]
    factor = (min(h, w) / (8 * size)) if scale is None else float(scale)
    if factor > 1:
        shape = (max(1, round(h / factor)), max(1, round(w / factor)))
        img = resize(img, shape, anti_aliasing=True, preserve_range=True).astype(np.float32)
    img = np.clip(img, 0, 1)
    img.setflags(write=False)
    return img


def _patches(img: np.ndarray, size: int) -> np.ndarray:
    """Non-overlapping size×size patches of an H×W×C image, row-major, as P×C×size×size."""
    h, w, c = img.shape
    nh, nw = h // size, w // size
    tiles = img[: nh * size, : nw * size].reshape(nh, size, nw, size, c)
    return tiles.transpose(0, 2, 4, 1, 3).reshape(nh * nw, c, size, size)


def photos(
    *,
    size: int = 32,
    per_photo: int | None = None,
    scale: int | None = None,
    grayscale: bool = False,
    limit: int | None = None,
) -> ImageDataset:
    """Non-overlapping ``size``×``size`` patches of scikit-image's bundled colour photos.

    Label = source photo (class names are the photo names).  Each photo is first
    downscaled: by the integer factor ``scale``, or by default so that its shorter
    side is 8·size (never upscaled), so a patch holds recognisable structure.
    Near-constant patches (std < 0.02) are dropped; ``per_photo`` keeps at most that
    many evenly spaced patches per photo.  ``grayscale=True`` gives one channel.
    """
    size = int_option(size, field="size", minimum=8)
    if scale is not None:
        scale = int_option(scale, field="scale", minimum=1)
    if per_photo is not None:
        per_photo = int_option(per_photo, field="per_photo", minimum=1)
    if not isinstance(grayscale, bool):
        raise ConfigError(f"expected True or False, got {grayscale!r} (field grayscale)")

    names, chunks, labels = [], [], []
    largest = 0
    for name in PHOTO_NAMES:
        img = _photo(name, scale, size)
        if img is None:
            continue
        label = len(names)
        names.append(name)
        largest = max(largest, min(img.shape[:2]))
        if min(img.shape[:2]) < size:
            continue
        patches = _patches(img, size)
        keep = np.flatnonzero(patches.std(axis=(1, 2, 3)) >= MIN_PATCH_STD)
        if per_photo is not None and keep.size > per_photo:
            keep = keep[np.round(np.linspace(0, keep.size - 1, per_photo)).astype(np.int64)]
        chunks.append(patches[keep])
        labels.append(np.full(keep.size, label, dtype=np.int64))
    if not names:
        raise ConfigError("no scikit-image photo could be loaded offline; reinstall scikit-image")
    if not chunks or sum(len(c) for c in chunks) == 0:
        raise ConfigError(
            f"expected a patch size that fits the photos (shorter side {largest} px at scale={scale}), "
            f"got size={size} (field size); use a smaller size or scale"
        )
    images = torch.from_numpy(np.ascontiguousarray(np.concatenate(chunks), dtype=np.float32))
    y = torch.from_numpy(np.concatenate(labels))
    images, y = apply_limit(images, y, limit)
    if grayscale:
        images = set_channels(images, 1)
    return ImageDataset(images.contiguous(), y, names, "photos")


# ------------------------------------------------------------------ synthetic vectors
SPHERE_RULES = ("random-halfspace", "first-coordinate", "random")


def sphere(
    *,
    n: int = 20,
    d: int = 10,
    rule: str = "random-halfspace",
    seed: int = 0,
    rule_seed: int = 0,
    limit: int | None = None,
) -> ImageDataset:
    """``n`` points uniform on the sphere of radius √d in R^d, labelled ±1.

    Labels are stored as classes 0/1 named "-1"/"+1" (see ``signed_labels``).
    ``rule``: "random-halfspace" = sign of ⟨w, x⟩ for a random unit w drawn from
    ``rule_seed`` (kept apart from ``seed`` so train and test draws share the rule);
    "first-coordinate" = sign of x₁; "random" = independent fair coins.
    """
    n = int_option(n, field="n", minimum=1)
    d = int_option(d, field="d", minimum=1)
    choice(rule, field="rule", allowed=SPHERE_RULES)
    seed = int_option(seed, field="seed", minimum=0)
    rule_seed = int_option(rule_seed, field="rule_seed", minimum=0)
    check_bytes(2 * n, d, field="n" if n >= d else "d", value=max(n, d), fix="use a smaller n or d")
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((n, d))
    norms = np.linalg.norm(g, axis=1, keepdims=True)
    x = g / np.maximum(norms, 1e-12) * math.sqrt(d)
    if rule == "random-halfspace":
        w = np.random.default_rng([rule_seed, 1]).standard_normal(d)
        y = (x @ w > 0).astype(np.int64)
    elif rule == "first-coordinate":
        y = (x[:, 0] > 0).astype(np.int64)
    else:
        y = rng.integers(0, 2, size=n).astype(np.int64)
    images, labels = apply_limit(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y), limit)
    return ImageDataset(images, labels, ["-1", "+1"], "sphere")


def gaussian_mixture(
    *,
    n: int = 200,
    d: int = 2,
    classes: int = 2,
    separation: float = 3.0,
    std: float = 1.0,
    seed: int = 0,
    limit: int | None = None,
) -> ImageDataset:
    """``n`` points from ``classes`` isotropic Gaussians N(μ_k, std²·I) in R^d, balanced.

    Adjacent means are ``separation`` apart: they sit on a circle in the first two
    coordinates (on a line, centred at 0, when d = 1).
    """
    n = int_option(n, field="n", minimum=1)
    d = int_option(d, field="d", minimum=1)
    k = int_option(classes, field="classes", minimum=2)
    separation = float_option(separation, field="separation")
    std = float_option(std, field="std", positive=True)
    seed = int_option(seed, field="seed", minimum=0)
    check_bytes(3 * n, d, field="n" if n >= d else "d", value=max(n, d), fix="use a smaller n or d")
    means = np.zeros((k, d))
    if d == 1:
        means[:, 0] = (np.arange(k) - (k - 1) / 2) * separation
    else:
        radius = separation / (2 * math.sin(math.pi / k))
        angle = 2 * math.pi * np.arange(k) / k
        means[:, 0], means[:, 1] = radius * np.cos(angle), radius * np.sin(angle)
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % k).astype(np.int64)
    x = means[y] + std * rng.standard_normal((n, d))
    images, labels = apply_limit(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y), limit)
    return ImageDataset(images, labels, [str(c) for c in range(k)], "gaussian-mixture")
