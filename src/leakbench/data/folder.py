"""``folder``: one sub-folder of image files per class, every image's size checked from its header before it
is decoded (:data:`MAX_PIXELS`)."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DataNotFound
from .checks import check_bytes, choice, int_option, set_channels
from .dataset import ImageDataset
from .download import PathLike, data_root, default_root, extract_tar, fetch, md5_of  # noqa: F401  (default_root: public here too)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


# ------------------------------------------------------------------ image folder
#: the largest image (pixels) the folder loader decodes; a bigger one is refused from its header.
MAX_PIXELS = 4096 * 4096
#: image modes read as what they are (grey, palette, RGB, with or without alpha); CMYK, YCbCr, LAB, HSV... are not.
_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "I;16", "I;16B", "I;16L", "I", "F")


def image_pixels(path: Path) -> int:
    """Width × height of the image at ``path`` from its header, refusing what the loader would read wrongly.

    Refused with the fix: anything but a regular file (a FIFO would block), animated or multi-frame
    images (GIF, TIFF stacks), channel orders other than grey/RGB(A) (CMYK, YCbCr, LAB), and images
    over :data:`MAX_PIXELS` (decoding and resizing them takes minutes).
    """
    import stat

    from PIL import Image, UnidentifiedImageError

    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read image {path} ({exc.strerror or exc}); remove or replace it") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"expected a regular image file, got a {'FIFO' if stat.S_ISFIFO(mode) else 'special file'}"
                          f" at {path} (field root); remove it from the class folder")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                frames = int(getattr(img, "n_frames", 1) or 1)
                width, height = img.size
                kind = img.mode
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ConfigError(f"cannot read image {path} ({' '.join(str(exc).split())[:200]}); remove or replace "
                          "it") from None
    except Image.DecompressionBombError:
        width = height = MAX_PIXELS  # refused below with the fix
        frames, kind = 1, "RGB"
    if frames > 1:
        raise ConfigError(f"expected single-frame images, got {frames} frames in {path} (field root); keep one frame "
                          "(e.g. save the first frame as PNG)")
    if kind not in _MODES:
        raise ConfigError(f"expected grey or RGB(A) images, got mode {kind} in {path} (field root); convert it to "
                          "RGB first (e.g. PIL: Image.open(p).convert('RGB').save(...))")
    if width * height > MAX_PIXELS or width * height == 0:
        raise ConfigError(f"expected images of at most {MAX_PIXELS:,} pixels, got {width}×{height} in {path} (field "
                          "root); downscale it before loading")
    return width * height

def folder(
    *,
    root: PathLike,
    size: int | None = None,
    channels: int | None = None,
    limit: int | None = None,
) -> ImageDataset:
    """Images under ``root/<class name>/`` (png, jpg, ...); classes are the sorted sub-folder names.

    One class folder is one class.  A flat folder (images directly in ``root``, no class
    folders) is unlabelled: every image gets label 0 of the one class ``"unknown"`` and the
    dataset says ``labels_known=False`` — the labels are unknown to everyone, so a sweep refuses to
    grant them to the attacker.  A model needs ≥ 2 outputs to share a cross-entropy gradient:
    use your own class with its ``num_classes`` (docs/data.md).

    ``size`` resizes every image to size×size (anti-aliased); without it all images
    must share one shape.  ``channels`` 1 or 3 (default: 3 if any image is colour).
    """
    from skimage.io import imread
    from skimage.transform import resize
    from skimage.util import img_as_float32

    if root is None:
        raise ConfigError("expected a directory with one sub-folder per class, got None (field root)")
    base = data_root(root)
    if size is not None:
        size = int_option(size, field="size", minimum=1)
    if channels is not None:
        choice(channels, field="channels", allowed=(1, 3))
    if limit is not None:
        limit = int_option(limit, field="limit", minimum=1)
    class_dirs = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")) if base.is_dir() else []
    files = [
        (label, f)
        for label, d in enumerate(class_dirs)
        for f in sorted(d.iterdir())
        if f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith(".")
    ]
    loose = sorted(f for f in base.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith(".")
                   and not f.is_dir()) if base.is_dir() else []
    if loose and files:
        raise ConfigError(f"expected class sub-folders or a flat folder of images in {base}, got both ({len(loose)} "
                          f"image(s) such as {loose[0].name} beside class folders {[d.name for d in class_dirs][:3]}) "
                          "(field root); move the loose images into a class folder, or the class folders away")
    labels_known = True
    if loose:  # unlabelled: one class, "unknown", label 0 for every image
        files, class_dirs, labels_known = [(0, f) for f in loose], [Path("unknown")], False
    present = {label for label, _ in files}
    empty = [d.name for label, d in enumerate(class_dirs) if files and label not in present]
    if empty:
        raise ConfigError(f"class folder {base / empty[0]} holds no images ({', '.join(IMAGE_SUFFIXES)}) (field root); "
                          f"put images in it or remove it{f' (also empty: {empty[1:4]})' if len(empty) > 1 else ''}")
    if not files:
        raise DataNotFound(
            f"no images found: looked for {', '.join(IMAGE_SUFFIXES)} files in {base} and its sub-folders. "
            f"Put one folder per class there ({base}/<class name>/<image>.png), or the images themselves "
            "(unlabelled)."
        )
    files = files[:limit] if limit is not None else files
    if size is not None:
        check_bytes(len(files), 3 * size * size, field="size", value=size, fix="use a smaller size or limit=...")
    total = 0
    for _, f in files:  # headers only: the kind of file, frames, channel order and size, before any decoding
        total += 3 * image_pixels(f)
    if size is None:
        check_bytes(1, total, field="root", value=str(base), fix="pass size=... or limit=...")
    arrays = []
    for _, f in files:
        try:
            img = img_as_float32(imread(f))
        except Exception as exc:  # unreadable or corrupt image file
            raise ConfigError(f"cannot read image {f} ({exc}); remove or replace it") from None
        if img.ndim == 2:
            img = img[..., None]
        if img.ndim != 3 or img.shape[-1] not in (1, 2, 3, 4):
            raise ConfigError(f"expected one grey, grey+alpha, RGB or RGBA image in {f}, got an array of shape "
                              f"{img.shape} (field root); save it as a single-frame PNG")
        img = img[..., :3] if img.shape[-1] >= 3 else img[..., :1]  # drop alpha
        if size is not None and img.shape[:2] != (size, size):
            img = resize(img, (size, size), anti_aliasing=True, preserve_range=True)
        arrays.append(np.clip(img, 0, 1).astype(np.float32).transpose(2, 0, 1))
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) > 1:
        raise ConfigError(
            f"expected images of one size, got {len(shapes)} sizes (e.g. {sorted(shapes)[:3]}) in {base}; "
            "pass size=... to resize them"
        )
    want = channels if channels is not None else (3 if any(a.shape[0] == 3 for a in arrays) else 1)
    images = torch.cat([set_channels(torch.from_numpy(a).unsqueeze(0), want) for a in arrays])
    labels = torch.tensor([label for label, _ in files], dtype=torch.int64)
    return ImageDataset(images.contiguous(), labels, [d.name for d in class_dirs], base.name or "folder",
                        labels_known=labels_known)
