"""Checks shared by the dataset loaders: option values, the in-memory size cap, limits and channels.

Every refusal is a :class:`~leakbench.errors.ConfigError` naming the field.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import ConfigError

__all__ = ["MAX_BYTES", "int_option", "float_option", "check_bytes", "choice", "apply_limit", "set_channels"]

#: largest in-memory dataset a generating loader builds (float32 bytes); larger sizes are refused up front.
MAX_BYTES = 2 * 1024**3


def int_option(value: object, *, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"expected an int >= {minimum}, got {value!r} (field {field})")
    return int(value)


def float_option(value: object, *, field: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigError(f"expected a number, got {value!r} (field {field})")
    if not math.isfinite(float(value)) or (positive and value <= 0):
        raise ConfigError(f"expected a {'positive ' if positive else ''}finite number, got {value!r} (field {field})")
    return float(value)


def check_bytes(samples: int, per_sample: int, *, field: str, value: object, fix: str) -> None:
    """Refuse before allocating when ``samples × per_sample`` float32 values pass :data:`MAX_BYTES`."""
    need = 4 * int(samples) * int(per_sample)
    if need > MAX_BYTES:
        raise ConfigError(f"expected a dataset of at most {MAX_BYTES / 1024**3:.0f} GiB in memory, got "
                          f"{need / 1024**3:,.1f} GiB for {field}={value!r} (field {field}); {fix}")


def choice(value: object, *, field: str, allowed: tuple) -> object:
    if value not in allowed:
        raise ConfigError(f"expected {field} to be one of {', '.join(map(repr, allowed))}; got {value!r} (field {field})")
    return value


def apply_limit(images: torch.Tensor, labels: torch.Tensor, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the first ``limit`` samples (all when ``limit`` is None)."""
    if limit is None:
        return images, labels
    n = int_option(limit, field="limit", minimum=1)
    return images[:n], labels[:n]


def set_channels(images: torch.Tensor, channels: int) -> torch.Tensor:
    """Convert N×C×H×W images in [0,1] to 1 (luminance) or 3 (repeated grey) channels."""
    choice(channels, field="channels", allowed=(1, 3))
    c = images.shape[1]
    if c == channels:
        return images
    if channels == 3 and c == 1:
        return images.expand(-1, 3, -1, -1).contiguous()
    if channels == 1 and c >= 3:
        weights = torch.tensor([0.2125, 0.7154, 0.0721], dtype=images.dtype)  # ITU-R 709, as skimage.rgb2gray
        return torch.einsum("nchw,c->nhw", images[:, :3], weights).unsqueeze(1).clamp_(0, 1)
    raise ConfigError(f"cannot convert {c}-channel images to {channels} channels (field channels)")
