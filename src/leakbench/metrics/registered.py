"""``METRICS``: the registry of per-sample scores, and :func:`register` for a plug-in's own.

A metric is a function ``metric(reconstruction, original) -> Tensor`` of shape (B,): one value per matched pair
of images (B×C×H×W, pixels in [0, 1]; the reconstruction already matched one-to-one to the originals).
:func:`leakbench.compare` computes every registered metric, so a sweep stores it with each trial (in the
trial's metrics; the results table's columns are leakbench's own scores), and the report shows it with its label.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..registry import Registry
from .identify import psnr_registered
from .image import cosine, mse, psnr, rmse, ssim
from .scores import SCORES, MetricInfo

__all__ = ["METRICS", "register", "Metric", "plugin_info"]

#: ``metric(reconstruction, original) -> Tensor`` of shape (B,)
Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

METRICS: Registry = Registry("metric")
METRICS.register("mse", mse, info=SCORES["mse"])
METRICS.register("rmse", rmse, info=SCORES["rmse"])
METRICS.register("psnr", psnr, info=SCORES["psnr"])
METRICS.register("ssim", ssim, info=SCORES["ssim"])
METRICS.register("psnr_registered", psnr_registered, info=SCORES["psnr_registered"],
                 help="PSNR after the best circular shift of at most 2 pixels each way")
METRICS.register("cosine", cosine, info=MetricInfo("cosine", higher_is_better=True, column=False))


def register(name: str, *, higher_is_better: bool, label: str | None = None, fmt: str = ".4g",
             help: str | None = None) -> Callable[[Metric], Metric]:
    """Decorator: register a per-sample metric ``fn(reconstruction, original) -> Tensor (B,)`` under ``name``.

    :func:`leakbench.compare` then reports its mean over the batch as ``result[name]`` and the per-sample values
    in ``result["per_sample"][name]``; sweeps store it with each attack trial, and the report shows it as
    ``label`` (``higher_is_better`` says which way is more leakage)."""

    def deco(fn: Metric) -> Metric:
        info = MetricInfo(label or name, higher_is_better=bool(higher_is_better), fmt=fmt, column=False)
        METRICS.register(name, fn, help=help, info=info)
        SCORES.setdefault(name, info)
        return fn

    return deco


def plugin_info() -> dict[str, dict[str, object]]:
    """name → ``{label, higher_is_better, fmt, origin}`` of every registered metric that is not leakbench's own (a
    plug-in's): a sweep stores it with each trial, so the report can show the metric without importing the plug-in."""
    out: dict[str, dict[str, object]] = {}
    for name in METRICS.names():
        origin = METRICS.origin(name)
        if origin == "leakbench" or origin.startswith("leakbench."):
            continue
        info = METRICS.info(name) or MetricInfo(name, higher_is_better=False)
        out[name] = {"label": info.label, "higher_is_better": bool(info.higher_is_better), "fmt": info.fmt,
                     "origin": origin}
    return out
