"""What every reproduction shares: the paper's quoted numbers, held-out images, the chance controls.

Chance controls (the rows a reader needs to see where an attack is at chance):

* **grey image** — a flat image at 0.5 on [0, 1] (no attack at all), scored like a reconstruction;
* **noise gradient** — the same attack run on an observation whose shared tensors are replaced by
  Gaussian noise of the same norm per tensor (the attack's own prior and post-processing, no signal);
* **non-member images** — for attacks on trained weights, the same matching applied to images the
  model never saw (here: the nearest-neighbour score of held-out images).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from rich.console import Console


import leakbench as lb

from .. import common as base
from ..common import table as shared_table

#: first index of the held-out CIFAR-10 images in ../shared/data (the rows no benchmark tunes on)
HELD_OUT = 500
PAPERS = "/work/shared/papers"


console = Console(width=200)


def table(title: str, columns, rows, note: str = "") -> None:
    """Print one table (floats with 4 significant digits) on a wide console, so columns are not cut."""
    shared_table(title, columns, rows, note, out=console)


@dataclass(frozen=True)
class Quote:
    """Where a paper's number comes from: file in ``../shared/papers``, table or figure, location."""

    file: str
    where: str
    stored: bool = True

    def __str__(self) -> str:
        where = f"../shared/papers/{self.file}" if self.stored else f"{self.file} (not in ../shared/papers)"
        return f"{self.where} — {where}"


def held_out_images(count: int, *, offset: int = 0) -> tuple[lb.ImageDataset, list[int], str]:
    """The dataset, ``count`` indices of held-out images and a description.

    CIFAR-10 (../shared/data): indices 500 + offset …, the half no benchmark tunes on.  Bundled photos
    (no ../shared): a seeded draw of patches (seed 0), the same for every entry.
    """
    ds, source = base.benchmark_images(count)
    if base.CIFAR_NPZ.exists():
        first = HELD_OUT + offset
        return ds, list(range(first, first + count)), source + f", held-out images {first}…{first + count - 1}"
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    return ds, order[offset:offset + count], source + " (a seeded draw)"


def score(images: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """PSNR (standard, peak 1 on [0, 1]), RMSE and SSIM after Hungarian matching, images clamped to [0, 1]."""
    s = lb.compare(images.float().clamp(0, 1), x.float(), match=True)
    return {k: float(s[k]) for k in ("psnr", "rmse", "ssim") if k in s}


def grey(x: torch.Tensor) -> dict[str, float]:
    """The grey-image control: a flat 0.5 image per sample."""
    return score(torch.full_like(x, 0.5), x)


def noise_observation(obs, *, seed: int = 0):
    """``obs`` with every shared tensor replaced by Gaussian noise of the same norm (the noise-gradient control)."""
    gen = torch.Generator().manual_seed(int(seed))
    noisy = []
    for t in obs.shared:
        z = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device, t.dtype)
        noisy.append(z * (t.norm() / z.norm().clamp_min(1e-30)))
    return dataclasses.replace(obs, shared=noisy)


def paper_vs_ours(title: str, columns, rows, *, quote: Quote, note: str = "") -> None:
    """A table whose caption names the paper's source."""
    table(title, columns, rows, note=(note + "; " if note else "") + f"paper: {quote}")


__all__ = ["HELD_OUT", "Quote", "console", "grey", "held_out_images", "noise_observation", "paper_vs_ours", "score",
           "table"]
