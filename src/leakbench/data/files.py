"""Loaders that read standard on-disk dataset formats themselves (no torchvision).

- ``cifar10`` / ``cifar100``: the "python version" pickle batches.
- ``mnist`` / ``fashion-mnist``: IDX files, gzipped or raw (torchvision's
  ``MNIST/raw`` layout is found too).
- ``folder``: one sub-folder of image files per class.
- ``npz``: arrays ``x`` (images) and ``y`` (labels) in one ``.npz``.

Absent files raise :class:`~leakbench.errors.DataNotFound` saying which files
were looked for and where to put them; ``download=True`` fetches the official
archives (md5-checked) where the network allows.  The default ``root`` is
``$LEAKBENCH_DATA`` or ``~/.cache/leakbench/data``; finding the root and downloading are in
:mod:`leakbench.data.download`, the option checks in :mod:`leakbench.data.checks`.
"""
from __future__ import annotations

import gzip
import os
import pickle
import warnings
import zipfile
import zlib
from pathlib import Path
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import ConfigError, DataNotFound
from .checks import MAX_BYTES, apply_limit, check_bytes, choice, int_option, set_channels
from .dataset import MAX_CLASSES, ImageDataset
from .download import PathLike, data_root, default_root, extract_tar, fetch, md5_of  # noqa: F401  (default_root: public here too)

CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
]
#: CIFAR-10 classes labelled "vehicle" (1) by ``binary="vehicles-animals"``; the rest are "animal" (0).
CIFAR10_VEHICLES = ("airplane", "automobile", "ship", "truck")
CIFAR100_FINE = (
    "apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus butterfly "
    "camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch crab crocodile cup "
    "dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo keyboard lamp lawn_mower "
    "leopard lion lizard lobster man maple_tree motorcycle mountain mouse mushroom oak_tree orange orchid "
    "otter palm_tree pear pickup_truck pine_tree plain plate poppy porcupine possum rabbit raccoon ray road "
    "rocket rose sea seal shark shrew skunk skyscraper snail snake spider squirrel streetcar sunflower "
    "sweet_pepper table tank telephone television tiger tractor train trout tulip turtle wardrobe whale "
    "willow_tree wolf woman worm"
).split()
CIFAR100_COARSE = (
    "aquatic_mammals fish flowers food_containers fruit_and_vegetables household_electrical_devices "
    "household_furniture insects large_carnivores large_man-made_outdoor_things large_natural_outdoor_scenes "
    "large_omnivores_and_herbivores medium_mammals non-insect_invertebrates people reptiles small_mammals "
    "trees vehicles_1 vehicles_2"
).split()
FASHION_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]

_CIFAR = {
    "cifar10": {
        "folder": "cifar-10-batches-py",
        "train": [f"data_batch_{i}" for i in range(1, 6)],
        "test": ["test_batch"],
        "url": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "md5": "c58f30108f718f92721af3b95e74349a",
    },
    "cifar100": {
        "folder": "cifar-100-python",
        "train": ["train"],
        "test": ["test"],
        "url": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        "md5": "eb9058c3a382ffc7106e4002c42a8d85",
    },
}
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
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


# ------------------------------------------------------------------ shared helpers
def _bool(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"expected True or False, got {value!r} (field {field})")
    return value


# ------------------------------------------------------------------ CIFAR
class _NumpyUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays and builtins (CIFAR batches need nothing else).

    The official batches are Python 2 pickles; re-pickled ones (any protocol) load too.
    Anything else a pickle could call is refused, so a dataset file cannot run code.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes in protocol-2 pickles written by Python 3
    }

    def find_class(self, module: str, name: str):
        legacy = module.replace("numpy._core.", "numpy.core.")
        if (legacy, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset pickle")
        if legacy.startswith("numpy.core.") and hasattr(np, "_core"):
            module = legacy.replace("numpy.core.", "numpy._core.")  # numpy >= 2: skip the deprecation shim
        return super().find_class(module, name)


def _read_cifar_pickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            raw = _NumpyUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise ConfigError(f"{path} is not a CIFAR python batch ({exc}); re-download it") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a CIFAR python batch (expected a dict, got {type(raw).__name__})")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}


def _find_cifar(which: str, root: Path, train: bool, download_: bool) -> list[Path]:
    spec = _CIFAR[which]
    names = spec["train"] if train else spec["test"]
    candidates = [root / spec["folder"], root]
    for folder in candidates:
        if all((folder / n).is_file() for n in names):
            return [folder / n for n in names]
    if download_:
        archive = root / spec["url"].rsplit("/", 1)[1]
        if not (archive.is_file() and md5_of(archive) == spec["md5"]):  # reuse a good earlier download
            fetch(spec["url"], archive, md5=spec["md5"])
        extract_tar(archive, root)
        folder = root / spec["folder"]
        if all((folder / n).is_file() for n in names):
            return [folder / n for n in names]
    raise DataNotFound(
        f"{which} files not found: looked for {', '.join(names)} in {candidates[0]} and {candidates[1]}. "
        f"Put the extracted '{spec['folder']}' folder of {spec['url']} in {root} "
        f"(pass root=... to look elsewhere), or pass download=True to fetch it where the network allows."
    )


def _cifar_arrays(paths: Sequence[Path], label_key: str, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    xs, ys, total = [], [], 0
    for path in paths:
        batch = _read_cifar_pickle(path)
        if "data" not in batch or label_key not in batch:
            raise ConfigError(f"{path} lacks 'data' or {label_key!r}; it is not a CIFAR python batch")
        try:
            data = np.asarray(batch["data"])
            labels = np.asarray(batch[label_key])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path} is not a CIFAR python batch ({exc}); re-download it") from None
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.ndim != 1 \
                or not np.issubdtype(labels.dtype, np.integer) or labels.shape[0] != data.shape[0]:
            raise ConfigError(f"expected CIFAR 'data' as uint8 N×3072 and {label_key!r} as N integers, got "
                              f"{data.dtype} {data.shape} and {labels.dtype} {labels.shape} in {path}; re-download it")
        xs.append(data.reshape(data.shape[0], 3, 32, 32))
        ys.append(labels.astype(np.int64))
        total += data.shape[0]
        if limit is not None and total >= limit:
            break
    return np.concatenate(xs), np.concatenate(ys)


def _cifar_tensors(x: np.ndarray, y: np.ndarray, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = apply_limit(torch.from_numpy(x), torch.from_numpy(y), limit)
    return images.to(torch.float32).div_(255.0), labels


def cifar10(
    *,
    root: PathLike | None = None,
    train: bool = True,
    download: bool = False,
    binary: str | None = None,
    limit: int | None = None,
) -> ImageDataset:
    """CIFAR-10 (32×32 colour, 10 classes) from ``root/cifar-10-batches-py``.

    ``binary="vehicles-animals"`` relabels to classes ["animal", "vehicle"]:
    airplane, automobile, ship and truck → 1 (vehicle), the six animals → 0.
    """
    train, download_ = _bool(train, "train"), _bool(download, "download")
    choice(binary, field="binary", allowed=(None, "vehicles-animals"))
    if limit is not None:
        limit = int_option(limit, field="limit", minimum=1)
    paths = _find_cifar("cifar10", data_root(root), train, download_)
    images, labels = _cifar_tensors(*_cifar_arrays(paths, "labels", limit), limit)
    classes = list(CIFAR10_CLASSES)
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= len(classes)):
        raise ConfigError(f"expected CIFAR-10 labels 0..9, got range {int(labels.min())}..{int(labels.max())} in "
                          f"{paths[0].parent}; re-download it")
    if binary == "vehicles-animals":
        vehicle = torch.tensor([c in CIFAR10_VEHICLES for c in CIFAR10_CLASSES], dtype=torch.int64)
        labels, classes = vehicle[labels], ["animal", "vehicle"]
    return ImageDataset(images, labels, classes, "cifar10")


def cifar100(
    *,
    root: PathLike | None = None,
    train: bool = True,
    download: bool = False,
    coarse: bool = False,
    limit: int | None = None,
) -> ImageDataset:
    """CIFAR-100 (32×32 colour) from ``root/cifar-100-python``: 100 fine labels, or 20 with ``coarse=True``."""
    train, download_, coarse = _bool(train, "train"), _bool(download, "download"), _bool(coarse, "coarse")
    if limit is not None:
        limit = int_option(limit, field="limit", minimum=1)
    paths = _find_cifar("cifar100", data_root(root), train, download_)
    key = "coarse_labels" if coarse else "fine_labels"
    images, labels = _cifar_tensors(*_cifar_arrays(paths, key, limit), limit)
    return ImageDataset(images, labels, list(CIFAR100_COARSE if coarse else CIFAR100_FINE), "cifar100")


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
