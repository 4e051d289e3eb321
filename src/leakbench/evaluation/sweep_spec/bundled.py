"""The sweep specs shipped with leakbench (``presets/*.yaml``), by name.

``demo`` is what ``leakbench demo`` (``make demo``) runs on bundled photos in minutes;
``liu2024`` is Liu et al. (2024)'s own setting (CIFAR-10, ResNet-18 trained one epoch,
Table 4's grids and budgets) for a GPU or a Ray cluster: ``leakbench evaluate --preset liu2024``;
``malicious`` is the malicious server's active attacks (trap weights, class fishing, the imprint block) under
secure aggregation and FedAvg local epochs, with the client's check of every shipped model;
``learned-prior`` is the generative attacks (``gias``, ``gifd``, ``ggl``) against pixel-space matching on a ConvNet trained
on digits the image prior never saw, centrally and along a FedAvg run.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from ...errors import ConfigError

__all__ = ["preset_names", "preset_path"]


def _folder() -> Path:
    return Path(str(resources.files("leakbench.evaluation").joinpath("presets")))


def preset_names() -> list[str]:
    """Names of the bundled sweep specs."""
    return sorted(p.stem for p in _folder().glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The YAML file of bundled preset ``name``; a :class:`ConfigError` listing the known ones otherwise."""
    path = _folder() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; bundled presets: {', '.join(preset_names())} (option --preset)")
    return path
