"""Optional LPIPS perceptual distance (Zhang et al. 2018), used by Liu et al. 2024.

LPIPS needs the optional ``lpips`` package, its linear-layer weights (shipped
inside the package as ``lpips/weights/v0.1/<net>.pth``) and the ImageNet
weights of the torchvision backbone, which torchvision fetches into the torch
hub cache (``<torch hub dir>/checkpoints``) on first use.  leakbench never
triggers a download: :func:`lpips_available` checks that every file is already
on disk and otherwise says what is missing and how to install it; callers
(``compare``) then report LPIPS as missing instead of failing.

Neither ``lpips`` nor ``torchvision`` is imported when this module is imported.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from ..errors import ConfigError
from .image import _as_tensor

__all__ = ["lpips_available", "lpips_distance", "LPIPS_NETS"]

#: backbone → (glob of its torchvision ImageNet weights in the hub cache, the file torchvision
#: names it, smallest image side the backbone accepts)
LPIPS_NETS: dict[str, tuple[str, str, int]] = {
    "alex": ("alexnet-owt-*.pth", "alexnet-owt-7be5be79.pth", 31),
    "vgg": ("vgg16-*.pth", "vgg16-397923af.pth", 16),
}

_INSTALL = "pip install 'leakbench[lpips]'"


def _module_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(spec.origin).parent if spec.origin else None


def _hub_checkpoints() -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints"


def lpips_available(*, net: str = "alex") -> tuple[bool, str]:
    """Whether LPIPS with backbone ``net`` can run offline here, and why not if it cannot.

    Returns ``(True, "")`` or ``(False, reason)``; the reason names the
    missing piece, the install command and where to place the weights.
    """
    if net not in LPIPS_NETS:
        raise ConfigError(f"expected net one of {', '.join(LPIPS_NETS)}, got {net!r} (field net)")
    pattern, backbone, _ = LPIPS_NETS[net]
    checkpoints = _hub_checkpoints()
    package = _module_dir("lpips")
    if package is None:
        return False, (
            f"LPIPS unavailable: the optional package 'lpips' is not installed. Install it with {_INSTALL}; "
            f"it ships its linear weights (lpips/weights/v0.1/{net}.pth) and also needs torchvision's "
            f"ImageNet {backbone} weights placed in {checkpoints} (torch hub cache)."
        )
    weights = package / "weights" / "v0.1" / f"{net}.pth"
    if not weights.is_file():
        return False, (
            f"LPIPS unavailable: the lpips weights file {weights} is missing. Reinstall with {_INSTALL} "
            f"or copy {net}.pth from the lpips distribution to {weights}."
        )
    if _module_dir("torchvision") is None:
        return False, (
            f"LPIPS unavailable: torchvision (the LPIPS backbone) is not installed. Install it with "
            f"pip install torchvision (matching your torch), then place the ImageNet {backbone} weights "
            f"in {checkpoints}."
        )
    if not any(checkpoints.glob(pattern)):
        return False, (
            f"LPIPS unavailable: torchvision's ImageNet weights for the {net} backbone ({backbone}) are not in "
            f"the torch hub cache {checkpoints}; leakbench does not download them. Place the file there "
            f"(e.g. copy it from a machine where torchvision downloaded it) or set TORCH_HOME to a "
            f"directory whose hub/checkpoints holds it."
        )
    return True, ""


@functools.cache
def _model(net: str) -> torch.nn.Module:
    import lpips  # optional dependency, imported only when used

    model = lpips.LPIPS(net=net, pretrained=True, verbose=False)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def lpips_distance(a: torch.Tensor, b: torch.Tensor, *, net: str = "alex") -> torch.Tensor:
    """LPIPS distance per image pair (lower is more similar); images B×C×H×W in [0, 1], shape (B,).

    Grayscale images (C = 1) are repeated to three channels; values are mapped
    to [-1, 1] as LPIPS expects.  The AlexNet backbone needs images of at
    least 31×31 pixels, VGG at least 16×16.  Raises ConfigError with the
    reason from :func:`lpips_available` when LPIPS cannot run offline.
    Computed on the CPU in float32 without gradients; returned as float64.
    """
    a = _as_tensor(a, "a")
    b = _as_tensor(b, "b")
    if a.shape != b.shape:
        raise ConfigError(
            f"expected tensors of the same shape for lpips, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.ndim != 4 or a.shape[0] == 0 or a.shape[1] not in (1, 3):
        raise ConfigError(
            f"expected a non-empty batch of grayscale or RGB images B×C×H×W (C = 1 or 3) for lpips, "
            f"got shape {tuple(a.shape)}"
        )
    ok, reason = lpips_available(net=net)
    if not ok:
        raise ConfigError(reason)
    min_side = LPIPS_NETS[net][2]
    if min(a.shape[2], a.shape[3]) < min_side:
        raise ConfigError(
            f"expected images of at least {min_side}×{min_side} pixels for LPIPS ({net}), "
            f"got {a.shape[2]}×{a.shape[3]}"
        )
    ta = a.detach().to("cpu", torch.float32)
    tb = b.detach().to("cpu", torch.float32)
    if ta.shape[1] == 1:
        ta, tb = ta.expand(-1, 3, -1, -1), tb.expand(-1, 3, -1, -1)
    with torch.no_grad():
        d = _model(net)(ta, tb, normalize=True)
    return d.reshape(a.shape[0]).to(torch.float64)
