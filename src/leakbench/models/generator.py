"""An untrained image generator for the deep image prior (Ulyanov et al. 2018) of Liu et al. (2024).

Liu et al. (Sec. 4.2, App. F) produce the candidate images with a randomly initialised CNN: a
U-Net (Ronneberger et al. 2015) of Wide-ResNet blocks with group normalisation, several
resolutions, two residual blocks per level.  :class:`UNetGenerator` is a compact version:
``depth`` resolution levels (channels ``width``·2^l), one GroupNorm residual block per level on
the way down and one after each skip concatenation on the way up, nearest upsampling, a 1×1
output convolution and a sigmoid.  App. F's self-attention at 16×16 and feature conditioning of
the blocks are left out (a compact net is enough at the image sizes leakbench attacks on a CPU).
Every sample is generated independently (group norm, no batch statistics).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

__all__ = ["UNetGenerator"]


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(channels, 8), channels)


class _ResBlock(nn.Module):
    """GN → LeakyReLU → conv3×3 → GN → LeakyReLU → conv3×3, plus a (1×1) shortcut."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_norm(c_in), nn.LeakyReLU(0.2), nn.Conv2d(c_in, c_out, 3, padding=1),
                                  _norm(c_out), nn.LeakyReLU(0.2), nn.Conv2d(c_out, c_out, 3, padding=1))
        self.skip = nn.Identity() if c_in == c_out else nn.Conv2d(c_in, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(x) + self.body(x)


class UNetGenerator(nn.Module):
    """Fixed noise z (B × noise_channels × H × W) ↦ images in (0, 1) of shape ``out_shape`` (C, H, W)."""

    def __init__(self, out_shape: Sequence[int], *, width: int = 32, depth: int = 3, noise_channels: int = 16,
                 seed: int = 0) -> None:
        super().__init__()
        shape = tuple(out_shape)
        if len(shape) != 3 or any(not isinstance(s, int) or s < 1 for s in shape):
            raise ConfigError(f"expected out_shape (C, H, W) of positive sizes, got {out_shape!r} (argument out_shape)")
        for name, value in (("width", width), ("depth", depth), ("noise_channels", noise_channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"expected a positive integer {name}, got {value!r} (argument {name})")
        smallest = min(shape[1:]) // 2 ** (depth - 1)
        if smallest < 1:
            raise ConfigError(f"depth {depth} halves {shape[1]}×{shape[2]} images below 1 pixel; use depth ≤ "
                              f"{int(math.log2(min(shape[1:]))) + 1} (argument depth)")
        self.out_shape, self.noise_channels = shape, noise_channels
        with torch.random.fork_rng(devices=[]):  # seeded initialisation, global RNG state restored
            torch.manual_seed(int(seed))
            chans = [width * 2 ** level for level in range(depth)]
            self.stem = nn.Conv2d(noise_channels, chans[0], 3, padding=1)
            self.down = nn.ModuleList(_ResBlock(chans[max(i - 1, 0)], c) for i, c in enumerate(chans))
            self.up = nn.ModuleList(_ResBlock(chans[i + 1] + chans[i], chans[i]) for i in range(depth - 1))
            self.head = nn.Sequential(_norm(chans[0]), nn.LeakyReLU(0.2), nn.Conv2d(chans[0], shape[0], 1))

    def noise(self, batch: int, *, seed: int = 0, device=None, dtype=None) -> torch.Tensor:
        """The fixed generator input: N(0, 1) noise of shape (batch, noise_channels, H, W)."""
        gen = torch.Generator().manual_seed(int(seed))
        z = torch.randn((batch, self.noise_channels, *self.out_shape[1:]), generator=gen)
        return z.to(device=device, dtype=dtype)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.stem(z)
        skips = []
        for i, block in enumerate(self.down):
            if i > 0:
                h = F.avg_pool2d(h, 2)
            h = block(h)
            skips.append(h)
        for i in reversed(range(len(self.up))):
            skip = skips[i]
            h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h = self.up[i](torch.cat([h, skip], dim=1))
        return torch.sigmoid(self.head(h))
