"""MNIST and Fashion-MNIST from IDX files, gzipped or raw (torchvision's ``MNIST/raw`` layout is found too);
``download=True`` fetches the official files (md5 checked)."""
from __future__ import annotations

import gzip
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DataNotFound
from .checks import MAX_BYTES, apply_limit, choice, int_option
from .dataset import ImageDataset
from .download import PathLike, data_root, default_root, extract_tar, fetch, md5_of  # noqa: F401  (default_root: public here too)
from .files import _bool

FASHION_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
_IDX = {
    "mnist": {
        "subdir": "MNIST/raw",
        "mirrors": ["https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"],
        "md5": {
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
    },
    "fashion-mnist": {
        "subdir": "FashionMNIST/raw",
        "mirrors": [
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
            "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
        ],
        "md5": {
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
    },
}


# ------------------------------------------------------------------ IDX (MNIST family)
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: PathLike) -> np.ndarray:
    """Read one IDX file (raw or ``.gz``) into an array of its declared shape and type."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:  # the header first: the declared size is checked before the body is read (or inflated)
        with opener(path, "rb") as f:
            magic = f.read(4)
            if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
                raise ConfigError(f"{path} is not an IDX file (bad magic number); re-download it")
            ndim = magic[3]
            dims = f.read(4 * ndim)
            if len(dims) < 4 * ndim:
                raise ConfigError(f"{path} is truncated (header of {ndim} dimensions incomplete); re-download it")
            shape = tuple(int(s) for s in np.frombuffer(dims, dtype=">u4", count=ndim))
            dtype = np.dtype(_IDX_DTYPES[magic[2]])
            count = int(np.prod(shape, dtype=object))
            expected = count * dtype.itemsize
            if max(expected, 4 * count) > MAX_BYTES:
                raise ConfigError(f"{path} declares shape {shape} ({max(expected, 4 * count) / 1024**3:,.1f} GiB in "
                                  f"memory), more than the {MAX_BYTES / 1024**3:.0f} GiB cap; use a real IDX file "
                                  "or a smaller one")
            data = f.read(expected + 1)  # one byte more tells a longer body from an exact one
    except ConfigError:
        raise
    except (OSError, EOFError, zlib.error) as exc:  # includes gzip.BadGzipFile
        raise ConfigError(f"cannot read IDX file {path} ({exc}); re-download it") from None
    if len(data) != expected:
        got = f"{len(data)}" if len(data) <= expected else f"more than {expected}"
        raise ConfigError(f"{path} holds {got} data bytes, expected {expected} for shape {shape}; re-download it")
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def _find_idx(which: str, root: Path, stems: Sequence[str], download_: bool) -> list[Path]:
    """Paths of the IDX files ``stems`` (raw or .gz) under root or root/<subdir>, downloading if asked."""
    spec = _IDX[which]
    folders = [root, root / spec["subdir"]]

    def locate(stem: str) -> Path | None:
        for folder in folders:
            for name in (stem, stem + ".gz"):
                if (folder / name).is_file():
                    return folder / name
        return None

    found = {stem: locate(stem) for stem in stems}
    missing = [stem for stem, p in found.items() if p is None]
    if missing and download_:
        for stem in missing:
            dest = root / spec["subdir"] / (stem + ".gz")
            errors = []
            for mirror in spec["mirrors"]:
                try:
                    found[stem] = fetch(mirror + stem + ".gz", dest, md5=spec["md5"][stem + ".gz"])
                    break
                except DataNotFound as exc:
                    errors.append(str(exc))
            else:
                raise DataNotFound(
                    f"could not download {stem}.gz from any mirror ({'; '.join(errors)}); "
                    f"put the file in {root} or {dest.parent}"
                )
        missing = []
    if missing:
        raise DataNotFound(
            f"{which} files not found: looked for {' and '.join(f'{m}[.gz]' for m in missing)} "
            f"in {folders[0]} and {folders[1]}. Put the IDX files (gzipped or not) in {root} "
            f"(pass root=... to look elsewhere), or pass download=True to fetch them where the network allows."
        )
    return [found[stem] for stem in stems]


def _idx_dataset(
    which: str, root: PathLike | None, train: bool, download_: bool, limit: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    train, download_ = _bool(train, "train"), _bool(download_, "download")
    if limit is not None:
        limit = int_option(limit, field="limit", minimum=1)
    base = data_root(root)
    prefix = "train" if train else "t10k"
    image_path, label_path = _find_idx(
        which, base, [f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"], download_
    )
    x, y = read_idx(image_path), read_idx(label_path)
    if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0] or x.dtype != np.uint8:
        raise ConfigError(
            f"expected uint8 images N×H×W and N labels, got {x.dtype} {x.shape} in {image_path} "
            f"and {y.shape} in {label_path}"
        )
    images, labels = apply_limit(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64)), limit)
    return images.unsqueeze(1).to(torch.float32).div_(255.0), labels


def mnist(
    *,
    root: PathLike | None = None,
    train: bool = True,
    download: bool = False,
    binary: str | None = None,
    limit: int | None = None,
) -> ImageDataset:
    """MNIST digits (28×28 grey) from IDX files in ``root`` or ``root/MNIST/raw``.

    ``binary="odd-even"`` relabels even digits 0 and odd digits 1 (classes ["even", "odd"]).
    """
    choice(binary, field="binary", allowed=(None, "odd-even"))
    images, labels = _idx_dataset("mnist", root, train, download, limit)
    classes = [str(k) for k in range(10)]
    if binary == "odd-even":
        labels, classes = labels % 2, ["even", "odd"]
    return ImageDataset(images, labels, classes, "mnist")


def fashion_mnist(
    *,
    root: PathLike | None = None,
    train: bool = True,
    download: bool = False,
    limit: int | None = None,
) -> ImageDataset:
    """Fashion-MNIST (28×28 grey, 10 clothing classes) from IDX files in ``root`` or ``root/FashionMNIST/raw``."""
    images, labels = _idx_dataset("fashion-mnist", root, train, download, limit)
    return ImageDataset(images, labels, list(FASHION_CLASSES), "fashion-mnist")
