"""Datasets: the ``ImageDataset`` type, the ``DATASETS`` registry and ``load``.

>>> from leakbench.data import load
>>> data = load("digits", size=16)
>>> data.shape
(1, 16, 16)

Offline datasets (no network, no files): ``digits``, ``photos``, ``sphere``,
``gaussian-mixture``, ``text`` (standard-library docstring sentences,
or your own text files with ``files=``; :mod:`.text`).  File datasets read a user-given ``root``: ``cifar10``,
``cifar100``, ``mnist``, ``fashion-mnist``, ``folder``, ``npz``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..errors import ConfigError
from ..registry import Registry
from . import cifar, files, folder, idx, offline, text as _text
from .dataset import ImageDataset
from .text import TextDataset

DATASETS: Registry[ImageDataset] = Registry("dataset")


@dataclass(frozen=True)
class DatasetInfo:
    """Metadata of a registered dataset (``DATASETS.info(name)``)."""

    offline: bool  # needs neither files nor network
    modality: str = "image"  # what a sample is: "image" (pixels) or "text" (token ids)


DATASETS.register("digits", offline.digits, info=DatasetInfo(offline=True))
DATASETS.register("photos", offline.photos, info=DatasetInfo(offline=True))
DATASETS.register("sphere", offline.sphere, info=DatasetInfo(offline=True))
DATASETS.register("gaussian-mixture", offline.gaussian_mixture, info=DatasetInfo(offline=True))
DATASETS.register("cifar10", cifar.cifar10, info=DatasetInfo(offline=False))
DATASETS.register("cifar100", cifar.cifar100, info=DatasetInfo(offline=False))
DATASETS.register("mnist", idx.mnist, info=DatasetInfo(offline=False))
DATASETS.register("fashion-mnist", idx.fashion_mnist, info=DatasetInfo(offline=False))
DATASETS.register("folder", folder.folder, info=DatasetInfo(offline=False))
DATASETS.register("npz", files.npz, info=DatasetInfo(offline=False))
DATASETS.register("text", _text.text, info=DatasetInfo(offline=True, modality="text"))

#: datasets that need neither files nor network (from the registry).
OFFLINE = tuple(name for name in DATASETS.names() if DATASETS.info(name).offline)


def modality(name: str) -> str:
    """What a sample of dataset ``name`` is: ``"image"`` or ``"text"`` (its :class:`DatasetInfo`)."""
    info = DATASETS.info(name)
    return getattr(info, "modality", "image") if info is not None else "image"


def options(name: str) -> dict[str, object]:
    """The options dataset ``name`` accepts, with their defaults (``inspect.Parameter.empty`` if required)."""
    params = inspect.signature(DATASETS.get(name)).parameters.values()
    return {p.name: p.default for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def load(name: str, **opts: object) -> ImageDataset:
    """Load the dataset registered as ``name`` with keyword options (e.g. ``size=32``, ``root=...``)."""
    accepted = options(name)
    unknown = [k for k in opts if k not in accepted]
    if unknown:
        raise ConfigError(
            f"unknown option {unknown[0]!r} for dataset {name!r}; accepted options: {', '.join(accepted)}"
        )
    missing = [k for k, v in accepted.items() if v is inspect.Parameter.empty and k not in opts]
    if missing:
        raise ConfigError(f"dataset {name!r} needs option {missing[0]!r} (e.g. load({name!r}, {missing[0]}=...))")
    return DATASETS.create(name, **opts)


__all__ = ["ImageDataset", "TextDataset", "DATASETS", "DatasetInfo", "load", "options", "modality", "OFFLINE"]
