"""CIFAR-10 and CIFAR-100 from the "python version" pickle batches, read with an unpickler that admits numpy
arrays and nothing else (no code runs from the file); ``download=True`` fetches the official archive (md5
checked)."""
from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DataNotFound
from .checks import apply_limit, choice, int_option
from .dataset import ImageDataset
from .download import PathLike, data_root, default_root, extract_tar, fetch, md5_of  # noqa: F401  (default_root: public here too)
from .files import _bool

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
