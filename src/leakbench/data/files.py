"""Loaders that read standard on-disk dataset formats themselves (no torchvision).

- ``cifar10`` / ``cifar100``: the "python version" pickle batches (:mod:`.cifar`).
- ``mnist`` / ``fashion-mnist``: IDX files, gzipped or raw (torchvision's
  ``MNIST/raw`` layout is found too) (:mod:`.idx`).
- ``folder``: one sub-folder of image files per class (:mod:`.folder`).
- ``npz``: arrays ``x`` (images) and ``y`` (labels) in one ``.npz`` (this module).

Absent files raise :class:`~leakbench.errors.DataNotFound` saying which files
were looked for and where to put them; ``download=True`` fetches the official
archives (md5-checked) where the network allows.  The default ``root`` is
``$LEAKBENCH_DATA`` or ``~/.cache/leakbench/data``; finding the root and downloading are in
:mod:`leakbench.data.download`, the option checks in :mod:`leakbench.data.checks`.
"""
from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DataNotFound
from .checks import MAX_BYTES, choice, int_option
from .dataset import MAX_CLASSES, ImageDataset
from .download import PathLike, data_root, default_root, extract_tar, fetch, md5_of  # noqa: F401  (default_root: public here too)


# ------------------------------------------------------------------ shared helpers
def _bool(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"expected True or False, got {value!r} (field {field})")
    return value


# ------------------------------------------------------------------ npz
def npz(
    *,
    path: PathLike,
    classes: Sequence[str] | None = None,
    layout: str | None = None,
    limit: int | None = None,
) -> ImageDataset:
    """Arrays ``x`` and ``y`` from an ``.npz`` file.

    ``x``: N×H×W×C (NHWC), N×C×H×W, N×H×W or N×d; uint8 is divided by 255, floats
    kept (images must lie in [0, 1]).  The layout of 4-D ``x`` is NHWC when its last
    axis has 1, 3 or 4 channels, else NCHW; ``layout="nchw"``/``"nhwc"`` overrides.
    ``y``: integer labels 0..K-1 (labels exactly {-1, +1} become classes 0/1 named
    "-1"/"+1").  Class names: ``classes``, else a ``classes`` array in the file, else
    "0".."K-1".
    """
    if path is None:
        raise ConfigError("expected the path of an .npz file, got None (field path)")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"expected the path of an .npz file, got {path!r} (field path)")
    file = Path(path).expanduser()
    choice(layout, field="layout", allowed=(None, "nhwc", "nchw"))
    if limit is not None:
        limit = int_option(limit, field="limit", minimum=1)
    if not file.is_file():
        raise DataNotFound(f"npz file not found: looked for {file}; put the file there or pass path=...")
    try:
        declared = npz_declared(file)  # shapes from the headers: nothing is decompressed before its size is known
        for name in ("x", "y", "classes"):
            if name in declared:
                shape, dtype = declared[name]
                count = int(np.prod(shape, dtype=object))
                if max(count * 4, count * dtype.itemsize) > MAX_BYTES:
                    raise ConfigError(f"expected arrays of at most {MAX_BYTES / 1024**3:.0f} GiB in memory, got "
                                      f"{name} of shape {shape} {dtype} declared in {file} (field {name}); store "
                                      "fewer or smaller samples, or split the file")
        with np.load(file, allow_pickle=False) as archive:
            stored = {k: archive[k] for k in ("x", "y", "classes") if k in archive.files}  # only what is used
    except ConfigError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:  # truncated, not a zip, pickled
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"cannot read {file} as .npz ({reason}); expected arrays x and y "
                          "(np.savez(path, x=..., y=...)); re-create or re-download it") from None
    missing = [k for k in ("x", "y") if k not in stored]
    if missing:
        raise ConfigError(f"expected arrays 'x' and 'y' in {file}, got {sorted(declared)} (missing {missing})")
    x, y = stored["x"], stored["y"]
    if limit is not None:
        x, y = x[:limit], y[:limit]
    images = _npz_images(x, layout, file)
    labels, names = _npz_labels(y, file)
    if images.shape[0] != labels.shape[0]:
        raise ConfigError(f"expected one label per image, got {images.shape[0]} images and {labels.shape[0]} labels in {file}")
    if classes is None and "classes" in stored:
        classes = [str(c) for c in stored["classes"].tolist()]
    if classes is not None:
        if isinstance(classes, str) or len(classes) < len(names):
            raise ConfigError(
                f"expected at least {len(names)} class names (labels go up to {len(names) - 1}), "
                f"got {classes!r} (field classes)"
            )
        names = [str(c) for c in classes]
    return ImageDataset(images, labels, names, file.stem)


def npz_declared(file: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name → (shape, dtype) of every array of an ``.npz`` file, read from the ``.npy`` headers only.

    A compressed member is inflated only as far as its header (a few hundred bytes), so a small file
    that expands to gigabytes is sized before any of it is decompressed.  Object (pickled) arrays are
    refused here.
    """
    out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    with zipfile.ZipFile(file) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                reader = {(1, 0): np.lib.format.read_array_header_1_0,
                          (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                if reader is None:
                    raise ValueError(f"unsupported .npy format version {version} in {info.filename}")
                shape, _, dtype = reader(member, max_header_size=10_000)
            if dtype.hasobject:
                raise ValueError(f"{info.filename} holds Python objects (allow_pickle=False)")
            out[info.filename[:-4]] = (tuple(int(n) for n in shape), dtype)
    return out


def _npz_images(x: np.ndarray, layout: str | None, file: Path) -> torch.Tensor:
    if x.dtype == np.uint8:
        arr = x.astype(np.float32) / 255.0
    elif x.dtype == np.uint16:
        arr = x.astype(np.float32) / 65535.0
    elif x.dtype == bool or np.issubdtype(x.dtype, np.floating):
        arr = x.astype(np.float32)
    else:
        raise ConfigError(f"expected x of dtype uint8, uint16 or float, got {x.dtype} in {file}")
    if arr.ndim == 3:
        arr = arr[:, None]
    elif arr.ndim == 4:
        nhwc = layout == "nhwc" or (layout is None and arr.shape[3] in (1, 3, 4))
        square_nhwc = arr.shape[1] == arr.shape[2] != arr.shape[3]
        if layout is None and nhwc and arr.shape[1] in (1, 3, 4) and not square_nhwc:
            raise ConfigError(  # (N, 3, 4, 4): 4×4 RGB images or 3×4 RGBA ones; reading one as the other is silent
                f"cannot tell the channel axis of x with shape {x.shape} in {file} (both axis 1 and axis 3 could "
                "hold channels); pass layout='nhwc' or 'nchw'")
        if layout is None and not nhwc and arr.shape[1] not in (1, 3):
            raise ConfigError(
                f"cannot tell the channel axis of x with shape {x.shape} in {file}; pass layout='nhwc' or 'nchw'"
            )
        if nhwc:
            arr = arr.transpose(0, 3, 1, 2)
        arr = arr[:, :3] if arr.shape[1] == 4 else arr  # drop alpha
    elif arr.ndim != 2:
        raise ConfigError(f"expected x of shape N×H×W×C, N×C×H×W, N×H×W or N×d, got {x.shape} in {file}")
    if not np.isfinite(arr).all():
        raise ConfigError(f"expected finite pixel values, got {int((~np.isfinite(arr)).sum())} NaN/inf value(s) in x "
                          f"of {file} (field x); clean or drop those samples")
    if arr.ndim == 4 and arr.size and (arr.min() < 0 or arr.max() > 1):
        raise ConfigError(
            f"expected float images in [0, 1], got range [{arr.min():.3g}, {arr.max():.3g}] in {file}; "
            "store uint8 pixels or rescale to [0, 1]"
        )
    return torch.from_numpy(np.ascontiguousarray(arr))


def _npz_labels(y: np.ndarray, file: Path) -> tuple[torch.Tensor, list[str]]:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y.reshape(-1)
    if y.ndim != 1:
        raise ConfigError(f"expected y of shape N (class indices), got {y.shape} in {file}")
    if np.issubdtype(y.dtype, np.floating) and y.size and np.all(np.mod(y, 1) == 0):
        y = y.astype(np.int64)
    if not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"expected integer labels, got dtype {y.dtype} in {file}")
    y = y.astype(np.int64)
    values = set(np.unique(y).tolist())
    if values and values <= {-1, 1} and -1 in values:
        return torch.from_numpy((y > 0).astype(np.int64)), ["-1", "+1"]
    if y.size and y.min() < 0:
        raise ConfigError(f"expected labels 0..K-1, got negative labels (min {y.min()}) in {file}")
    k = int(y.max()) + 1 if y.size else 1
    if k > MAX_CLASSES:
        raise ConfigError(f"expected labels 0..K-1 with K ≤ {MAX_CLASSES}, got label {int(y.max())} in {file} "
                          "(field y); store class indices, not ids")
    return torch.from_numpy(y), [str(c) for c in range(k)]
