"""Shared helpers for benchmarks: tables, timing, the benchmark images."""
from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

import leakbench as lb

CIFAR_NPZ = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10-test-1000.npz"
console = Console()


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], note: str = "", *,
          out: Console | None = None) -> None:
    """Print one benchmark table (floats with 4 significant digits) on ``out`` (default: the shared console)."""
    t = Table(title=title, caption=note or None, caption_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r])
    (out or console).print(t)


def benchmark_images(count: int, *, seed: int = 0) -> tuple[lb.ImageDataset, str]:
    """CIFAR-10 test images from ../shared/data when present, else bundled photo patches; says which."""
    if CIFAR_NPZ.exists():
        from leakbench.data.cifar import CIFAR10_CLASSES

        ds = lb.load("npz", path=str(CIFAR_NPZ), classes=list(CIFAR10_CLASSES))
        source = f"CIFAR-10 test images from {CIFAR_NPZ.relative_to(CIFAR_NPZ.parents[2])}"
    else:
        ds = lb.load("photos", size=32)
        source = "bundled scikit-image photo patches (32×32); ../shared/data/cifar10-test-1000.npz absent"
    return ds, source


def resized(ds: lb.ImageDataset, size: int) -> lb.ImageDataset:
    """``ds`` at ``size`` × ``size`` px (bilinear, antialiased, clamped to [0, 1]); ``ds`` itself at its own size."""
    if size == ds.shape[-1]:
        return ds
    images = torch.nn.functional.interpolate(ds.images, size=(size, size), mode="bilinear", antialias=True,
                                             align_corners=False).clamp(0, 1)
    return lb.ImageDataset(images.contiguous(), ds.labels, ds.classes, ds.name)


def public_images(ds: lb.ImageDataset, x: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` images of ``ds`` (the last ones) that are not in the batch ``x``: the server's public data."""
    flat = ds.images.reshape(len(ds.images), -1)
    inside = (flat[:, None, :] == x.reshape(x.shape[0], -1)[None]).all(-1).any(-1)
    return ds.images[~inside][-count:]


def seconds(fn, *, repeat: int = 1) -> float:
    """Best wall time of ``repeat`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean PSNR of reconstructions ``a`` against originals ``b`` after the best one-to-one matching (a batch
    gradient carries its samples as a set: same-label samples come back in any order)."""
    a = a.detach().cpu().clamp(0, 1)
    if len(a) > 1:
        a = a[lb.metrics.match(a, b)]
    return float(lb.metrics.psnr(a, b).mean())


def grey_psnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """PSNR (``lb.compare``) of the grey image at the batch's mean against the batch: the chance row."""
    return lb.compare(torch.full_like(x, float(x.mean())), x, y)["psnr"]


def pattern_batches(pools: dict, pattern: list, count: int) -> list[list[int]]:
    """``count`` disjoint index lists: each entry ``c`` of ``pattern`` takes the next unused index of ``pools[c]``
    (so batch b holds the b-th run of each entry's pool)."""
    taken = dict.fromkeys(pools, 0)
    out = []
    for _ in range(count):
        idx = []
        for c in pattern:
            idx.append(pools[c][taken[c]])
            taken[c] += 1
        out.append(idx)
    return out


def env_names(name: str) -> list[str]:
    """The comma-separated entries of environment variable ``name`` (stripped, empty ones dropped)."""
    return [v.strip() for v in os.environ.get(name, "").split(",") if v.strip()]


def env_ints(name: str, default: str) -> list[int]:
    """``$name`` as comma-separated integers (``default`` when unset); a bad value exits naming the variable."""
    try:
        return [int(v) for v in (env_names(name) or default.split(","))]
    except ValueError:
        raise SystemExit(f"{name}: expected comma-separated integers, e.g. {name}={default}") from None


def env_pick(name: str, known: dict) -> dict:
    """The entries of ``known`` that environment variable ``name`` lists (all of them when unset), in ``known``'s
    order; an unknown name is a clear exit naming the known ones."""
    chosen = env_names(name)
    if unknown := [v for v in chosen if v not in known]:
        raise SystemExit(f"{name}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return {k: v for k, v in known.items() if not chosen or k in chosen}


def tv_variants(name: str, default: str = "") -> list[float]:
    """The TV weights listed in environment variable ``name`` (``default`` when unset); a clear exit otherwise."""
    try:
        return [float(v.strip()) for v in os.environ.get(name, default).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{name}: expected comma-separated TV weights, e.g. {name}=0.03,0.1") from None


def interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % t-interval); half-width inf below two values."""
    from scipy.stats import t

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.inf
    return mean, float(t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n)


def mean_cell(values: Sequence[float]) -> str:
    """``+m [lo, hi]``: the mean and its 95 % t-interval (dB)."""
    mean, half = interval(values)
    return f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}]" if math.isfinite(half) else f"{mean:+.2f}"
