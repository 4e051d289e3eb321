"""A model's size before it is built: its parameters and buffers counted on PyTorch's meta device.

Every spec (``gpt:``/``bert:``, ``mlp:``, ``cnn:``, the other families, and a user's ``module:Class``) is
sized by :func:`check_size` before its real construction, so one that would not fit in memory is refused in
one line instead of reaching the allocator.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError

#: the most bytes the parameters and buffers of a model built from a spec may take (:func:`check_size`).
MAX_MODEL_BYTES = 4 * 1024**3


class _SkipInPlace(TorchFunctionMode):
    """In-place calls on meta tensors (``nn.init.normal_``, ``tensor.uniform_``) return the tensor at once: on
    the meta device they compute nothing, and some (random fills) would load PyTorch's compiler to say so."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if name.endswith("_") and not name.endswith("__") and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def check_size(make: Callable[[], nn.Module], spec: str, dtype: torch.dtype = torch.float32, *,
               limit: int | None = None) -> int:
    """The parameters and buffers ``make()`` would allocate, counted by running it on the meta device (no
    memory); a :class:`ConfigError` when they take more than ``limit`` bytes (default :data:`MAX_MODEL_BYTES`).

    A constructor that cannot run on the meta device (it reads data, calls ``.item()``) is not sized: 0.
    """
    limit = MAX_MODEL_BYTES if limit is None else int(limit)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), _SkipInPlace():
            probe = make()
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - not sizeable without building it: built as before
        return 0
    if not isinstance(probe, nn.Module):
        return 0
    tensors = [*probe.parameters(), *probe.buffers()]
    count = sum(t.numel() for t in tensors)
    need = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)
    if need > limit:
        raise ConfigError(f"expected a model of at most {limit / 2**30:.3g} GiB of parameters and buffers in "
                          f"{str(dtype).removeprefix('torch.')}, got {spec!r} with {count:,} numbers "
                          f"({need / 2**30:.3g} GiB) (field model); make it smaller")
    return need


__all__ = ["check_size", "MAX_MODEL_BYTES"]
