"""Optional LPIPS perceptual distance (Zhang et al. 2018), used by Liu et al. 2024.

LPIPS needs the optional ``lpips`` package, its linear-layer weights (shipped
inside the package as ``lpips/weights/v0.1/<net>.pth``) and the ImageNet
weights of the torchvision backbone, which torchvision fetches into the torch
hub cache (``<torch hub dir>/checkpoints``) on first use.  leakbench never
triggers a download: :func:`lpips_available` checks that every file is already
on disk and otherwise says what is missing and how to install it; callers
(``compare``) then report LPIPS as missing instead of failing.

Weights the user supplies (they cannot always be downloaded): pass ``weights=DIR`` (``compare(...,
lpips_weights=DIR)``) or set ``LEAKBENCH_LPIPS_WEIGHTS=DIR``, a directory in the ``lpips`` package layout:
``DIR/weights/v0.1/<net>.pth`` (LPIPS's linear heads) and the backbone's torchvision file (``alexnet-owt-*.pth``
or ``vgg16-*.pth``) in ``DIR`` itself or in the torch hub cache.  Both are read with
``torch.load(weights_only=True)`` (tensors only, no pickled code); the ``lpips`` package still provides the
network code.

Neither ``lpips`` nor ``torchvision`` is imported when this module is imported.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import torch

from ..errors import ConfigError
from .image import _as_tensor

__all__ = ["lpips_available", "lpips_distance", "LPIPS_NETS", "LPIPS_WEIGHTS_ENV", "user_weights"]

#: the environment variable naming a directory of user-supplied LPIPS weights (the ``lpips`` package layout)
LPIPS_WEIGHTS_ENV = "LEAKBENCH_LPIPS_WEIGHTS"

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


def user_weights(weights: str | os.PathLike | None = None) -> Path | None:
    """The user's LPIPS weights directory: ``weights``, else ``$LEAKBENCH_LPIPS_WEIGHTS``, else None."""
    chosen = weights if weights is not None else os.environ.get(LPIPS_WEIGHTS_ENV) or None
    return None if chosen is None else Path(chosen).expanduser()


def _user_files(root: Path, net: str) -> tuple[Path, Path | None, str]:
    """(linear heads file, backbone file or None, reason when something is missing) of a user directory."""
    pattern, backbone, _ = LPIPS_NETS[net]
    lin = root / "weights" / "v0.1" / f"{net}.pth"
    if not root.is_dir():
        return lin, None, f"LPIPS unavailable: the weights directory {root} does not exist (option lpips_weights / " \
                          f"${LPIPS_WEIGHTS_ENV})"
    if not lin.is_file():
        return lin, None, (f"LPIPS unavailable: {lin} is missing; a weights directory follows the lpips package "
                           f"layout, weights/v0.1/{net}.pth (option lpips_weights / ${LPIPS_WEIGHTS_ENV})")
    found = sorted(root.glob(pattern)) or sorted(_hub_checkpoints().glob(pattern))
    if not found:
        return lin, None, (f"LPIPS unavailable: the {net} backbone's ImageNet weights ({backbone}) are neither in "
                           f"{root} nor in the torch hub cache {_hub_checkpoints()}; place the file in {root}")
    return lin, found[0], ""


def lpips_available(*, net: str = "alex", weights: str | os.PathLike | None = None) -> tuple[bool, str]:
    """Whether LPIPS with backbone ``net`` can run offline here, and why not if it cannot.

    ``weights``: a directory of user-supplied weights (default ``$LEAKBENCH_LPIPS_WEIGHTS``; see the module).
    Returns ``(True, "")`` or ``(False, reason)``; the reason (one line) names the
    missing piece, the install command and where to place the weights.
    """
    if net not in LPIPS_NETS:
        raise ConfigError(f"expected net one of {', '.join(LPIPS_NETS)}, got {net!r} (field net)")
    root = user_weights(weights)
    if root is not None:
        if _module_dir("lpips") is None:
            return False, (f"LPIPS unavailable: weights are given ({root}) but the optional package 'lpips', which "
                           f"holds the network code, is not installed; install it with {_INSTALL}")
        if _module_dir("torchvision") is None:
            return False, ("LPIPS unavailable: torchvision (the LPIPS backbone's code) is not installed; install it "
                           "with pip install torchvision (matching your torch)")
        return (False, reason) if (reason := _user_files(root, net)[2]) else (True, "")
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


def _tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a user's file: one line naming it
        raise ConfigError(f"expected {what} readable with torch.load(weights_only=True), got {path}: "
                          f"{type(err).__name__}: {' '.join(str(err).split())[:160]} (option lpips_weights)") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"expected {what} to hold a state dict of tensors, got {type(state).__name__} in {path} "
                          "(option lpips_weights)")
    return state


def _load_user(model: torch.nn.Module, root: Path, net: str) -> None:
    """Load the user's linear heads and backbone (torchvision's ``features.<i>.*`` keys into LPIPS's
    ``net.slice<k>.<i>.*``) into an LPIPS model built without pretrained weights."""
    lin, backbone, reason = _user_files(root, net)
    if reason:
        raise ConfigError(reason)
    heads = _tensors(lin, "LPIPS's linear heads")
    own = {k for k in model.state_dict() if k.startswith("lin")}
    if set(heads) != own:
        odd = sorted(set(heads) ^ own)[:3]
        raise ConfigError(f"expected {lin} to hold LPIPS's linear heads ({len(own)} tensors), got keys that differ: "
                          f"{odd} (option lpips_weights)")
    model.load_state_dict(heads, strict=False)
    tv = _tensors(backbone, f"the {net} backbone's weights")
    wanted = {k: "features." + k.split(".", 1)[1] for k in model.net.state_dict()}  # slice<k>.<i>.weight
    missing = [v for v in wanted.values() if v not in tv]
    if missing:
        raise ConfigError(f"expected {backbone} to hold torchvision's {net} weights, but {missing[0]!r} is missing "
                          "(option lpips_weights)")
    model.net.load_state_dict({k: tv[v] for k, v in wanted.items()})


@functools.cache
def _model(net: str, weights: str | None = None) -> torch.nn.Module:
    import lpips  # optional dependency, imported only when used

    if weights is None:
        model = lpips.LPIPS(net=net, pretrained=True, verbose=False)
    else:  # nothing fetched or unpickled: the bare network, then the user's tensors
        model = lpips.LPIPS(net=net, pretrained=False, pnet_rand=True, verbose=False)
        _load_user(model, Path(weights), net)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def lpips_distance(a: torch.Tensor, b: torch.Tensor, *, net: str = "alex",
                   weights: str | os.PathLike | None = None) -> torch.Tensor:
    """LPIPS distance per image pair (lower is more similar); images B×C×H×W in [0, 1], shape (B,).

    Grayscale images (C = 1) are repeated to three channels; values are mapped
    to [-1, 1] as LPIPS expects.  The AlexNet backbone needs images of at
    least 31×31 pixels, VGG at least 16×16.  ``weights``: the user's weights directory (default
    ``$LEAKBENCH_LPIPS_WEIGHTS``, see the module).  Raises ConfigError with the
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
    ok, reason = lpips_available(net=net, weights=weights)
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
        root = user_weights(weights)
        d = _model(net, None if root is None else str(root.resolve()))(ta, tb, normalize=True)
    return d.reshape(a.shape[0]).to(torch.float64)
