"""``ImageDataset``: the one in-memory dataset type every stage reads.

Images are a float32 tensor N×C×H×W with values in [0, 1]; vector data (the
synthetic sphere and Gaussian mixture) is N×d and unbounded.  Labels are int64
class indices 0..K-1 and ``classes`` names them.  ``batch`` draws the small
batches that gradient-inversion experiments attack, seeded with a local
generator so a trial is reproducible from its spec and never touches the
global RNG.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import ConfigError

IndexLike = Sequence[int] | np.ndarray | torch.Tensor
#: most classes a dataset may name (a label of 10⁹ would otherwise make 10⁹ class names and outputs).
MAX_CLASSES = 100_000


def _as_index_array(values: IndexLike, *, field: str, upper: int, what: str) -> np.ndarray:
    """Check that ``values`` are integers in 0..upper-1 and return them as an int64 array."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    if isinstance(values, (int, np.integer)):
        values = [int(values)]
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError):
        raise ConfigError(f"expected a sequence of {what} indices, got {values!r} (field {field})") from None
    if arr.dtype == bool or arr.dtype == object or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ConfigError(
            f"expected integer {what} indices, got dtype {arr.dtype} (field {field}); "
            "pass a list of ints or an integer tensor"
        )
    arr = arr.astype(np.int64).reshape(-1)
    bad = arr[(arr < 0) | (arr >= upper)]
    if bad.size:
        raise ConfigError(
            f"expected {what} indices in 0..{upper - 1}, got {bad[:5].tolist()} (field {field})"
        )
    return arr


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"expected a non-negative int seed, got {seed!r} (field seed)")
    return int(seed)


@dataclass(eq=False, repr=False)
class ImageDataset:
    """Samples, labels and class names of one dataset, held in memory as tensors.

    ``images``: float32, N×C×H×W in [0, 1] (or N×d for vector data);
    ``labels``: int64, N, class indices into ``classes``; ``name``: a short id.
    ``labels_known``: False when the labels are stand-ins nobody knows (an unlabelled folder:
    every sample label 0 of the one class "unknown"); a sweep then refuses to grant them to the
    attacker (``labels_known: true``).  One class is allowed; a model with one output trained
    with cross-entropy has a zero gradient, which :func:`leakbench.observe` refuses with the fix.
    """

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    name: str = "dataset"
    labels_known: bool = True

    def __post_init__(self) -> None:
        images = torch.as_tensor(self.images)
        if images.dim() not in (2, 4):
            raise ConfigError(
                f"expected images of shape N×C×H×W or N×d, got shape {tuple(images.shape)} (field images)"
            )
        labels = torch.as_tensor(self.labels)
        if labels.dim() != 1 or labels.shape[0] != images.shape[0]:
            raise ConfigError(
                f"expected one label per sample ({images.shape[0]}), got shape {tuple(labels.shape)} (field labels)"
            )
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise ConfigError(f"expected integer class indices, got dtype {labels.dtype} (field labels)")
        self.classes = [str(c) for c in self.classes]
        if not self.classes:
            raise ConfigError("expected at least one class name, got [] (field classes)")
        if len(self.classes) > MAX_CLASSES:
            raise ConfigError(f"expected at most {MAX_CLASSES} classes, got {len(self.classes)} (field classes)")
        if images.is_floating_point() and images.numel() and not bool(torch.isfinite(images).all()):
            bad = int((~torch.isfinite(images)).sum())
            raise ConfigError(
                f"expected finite pixel values, got {bad} NaN/inf value(s) in dataset {self.name!r} (field images); "
                "clean or drop those samples"
            )
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= len(self.classes)):
            raise ConfigError(
                f"expected labels in 0..{len(self.classes) - 1} (one per class name), "
                f"got range {int(labels.min())}..{int(labels.max())} (field labels)"
            )
        self.images = images.to(torch.float32)
        self.labels = labels.to(torch.int64)

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample ``(x, y)``; for many, use :meth:`batch` or :meth:`subset`."""
        return self.images[index], self.labels[index]

    def __repr__(self) -> str:
        return (
            f"ImageDataset(name={self.name!r}, n={len(self)}, shape={self.shape}, "
            f"classes={self.num_classes}, device={self.images.device})"
        )

    @property
    def shape(self) -> tuple[int, ...]:
        """Per-sample shape: (C, H, W) for images, (d,) for vectors."""
        return tuple(int(s) for s in self.images.shape[1:])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def is_image(self) -> bool:
        """True when samples are C×H×W images (False for N×d vector data)."""
        return self.images.dim() == 4

    @property
    def mean(self) -> torch.Tensor:
        """Per-channel mean (C,) for images, per-feature mean (d,) for vectors."""
        dims = (0, 2, 3) if self.is_image else (0,)
        return self.images.mean(dim=dims)

    @property
    def std(self) -> torch.Tensor:
        """Per-channel (or per-feature) population standard deviation."""
        dims = (0, 2, 3) if self.is_image else (0,)
        return self.images.std(dim=dims, correction=0)

    def class_counts(self) -> torch.Tensor:
        """Number of samples of each class, shape (num_classes,)."""
        return torch.bincount(self.labels.cpu(), minlength=self.num_classes)

    # ---------------------------------------------------------------- derived
    def subset(self, indices: IndexLike) -> ImageDataset:
        """A new dataset holding exactly the samples at ``indices`` (in that order)."""
        idx = _as_index_array(indices, field="indices", upper=len(self), what="sample")
        t = torch.from_numpy(idx).to(self.images.device)
        return replace(self, images=self.images[t], labels=self.labels[t], classes=list(self.classes))

    def to(self, device: torch.device | str) -> ImageDataset:
        """A copy with images and labels on ``device``."""
        return replace(self, images=self.images.to(device), labels=self.labels.to(device), classes=list(self.classes))

    def signed_labels(self) -> torch.Tensor:
        """Labels as float ±1 (class 0 → −1, class 1 → +1) for binary tasks."""
        if self.num_classes != 2:
            raise ConfigError(
                f"expected a binary dataset (2 classes) for ±1 labels, got {self.num_classes} classes "
                f"(dataset {self.name!r}); load a binary variant, e.g. binary='odd-even'"
            )
        return self.labels.to(torch.float32) * 2 - 1

    # ----------------------------------------------------------------- batches
    def batch(
        self,
        size: int | None = None,
        *,
        seed: int = 0,
        indices: IndexLike | None = None,
        classes: Sequence[int] | None = None,
        balanced: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw a batch ``(x, y)``.

        - ``indices``: exactly those samples, in that order.
        - ``classes``: one class index per batch slot; a distinct random sample of each.
        - otherwise ``balanced=True`` goes round-robin over the classes in a seeded
          random order, so a batch no larger than the number of classes holds
          distinct labels (as in DLG / Inverting Gradients); ``balanced=False``
          draws uniformly without replacement.
        """
        if indices is not None and classes is not None:
            raise ConfigError("expected either indices or classes, got both (fields indices, classes)")
        if indices is not None:
            idx = _as_index_array(indices, field="indices", upper=len(self), what="sample")
            if size is not None and size != idx.size:
                raise ConfigError(
                    f"expected size to match the {idx.size} given indices, got size={size} (field size); "
                    "omit size when passing indices"
                )
            if idx.size == 0:
                raise ConfigError("expected at least one index, got none (field indices)")
            return self._take(idx)

        seed = _check_seed(seed)
        rng = np.random.default_rng(seed)
        labels = self.labels.cpu().numpy()
        if classes is not None:
            wanted = _as_index_array(classes, field="classes", upper=self.num_classes, what="class")
            if size is not None and size != wanted.size:
                raise ConfigError(
                    f"expected size to match the {wanted.size} given classes (one per slot), "
                    f"got size={size} (field size); omit size when passing classes"
                )
            if wanted.size == 0:
                raise ConfigError("expected at least one class, got none (field classes)")
            idx = np.empty(wanted.size, dtype=np.int64)
            for c in np.unique(wanted):
                slots = np.flatnonzero(wanted == c)
                pool = np.flatnonzero(labels == c)
                if pool.size < slots.size:
                    raise ConfigError(
                        f"expected at least {slots.size} samples of class {c} ({self.classes[c]!r}), "
                        f"got {pool.size} (field classes); pick classes present in {self.name!r}"
                    )
                idx[slots] = rng.choice(pool, size=slots.size, replace=False)
            return self._take(idx)

        if size is None:
            raise ConfigError("expected a batch size, got None (field size)")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ConfigError(f"expected a positive int batch size, got {size!r} (field size)")
        if size > len(self):
            raise ConfigError(
                f"expected size <= {len(self)} (the dataset size), got {size} (field size); "
                "use a smaller batch or a larger dataset (limit=None)"
            )
        if not balanced:
            return self._take(rng.permutation(len(self))[:size])
        return self._take(_round_robin(labels, self.num_classes, size, rng))

    def _take(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(np.asarray(idx, dtype=np.int64)).to(self.images.device)
        return self.images[t], self.labels[t]


def _round_robin(labels: np.ndarray, num_classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Indices taking one sample per class in turn (seeded class order), skipping exhausted classes."""
    order = rng.permutation(num_classes)
    position = np.empty(num_classes, dtype=np.int64)
    position[order] = np.arange(num_classes)
    perm = rng.permutation(labels.size)
    shuffled = labels[perm]
    # rank of each shuffled sample within its class: stable sort by class, then subtract class start
    by_class = np.argsort(shuffled, kind="stable")
    counts = np.bincount(shuffled, minlength=num_classes)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.empty(labels.size, dtype=np.int64)
    rank[by_class] = np.arange(labels.size) - starts[shuffled[by_class]]
    # round r takes the r-th sample of every class, classes in the seeded order
    key = np.lexsort((position[shuffled], rank))
    return perm[key[:size]]
