"""Training losses a client may use, as pure functions of (logits, target).

``target`` is either class indices (``LongTensor`` of shape (B,)) or soft targets
(float (B, K) probabilities, as DLG optimises them); ``ce`` also takes a text decoder's B × T × V logits
with B × T next-token targets (−100 marks a position without one, as padding).  Binary losses for ±1 labels
(``logistic``, ``exponential``) take a scalar output (B, 1) and class indices 0/1
(mapped to −1/+1) or float ±1 values.  Every loss is the mean over the batch.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .registry import Registry

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LOSSES: Registry[torch.Tensor] = Registry("loss")


def _soft(target: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    if target.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return F.one_hot(target.long(), k).to(dtype)
    return target.to(dtype)


def _signs(target: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if target.dtype.is_floating_point:
        return target.reshape(-1).to(dtype)
    return (2 * target.reshape(-1) - 1).to(dtype)


@LOSSES.register("ce", help="cross-entropy (softmax) on class indices or soft targets")
def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 3:  # next-token prediction: B × T × V logits, B × T targets (−100: no loss), mean over the rest
        logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1, *target.shape[2:])
    if not target.dtype.is_floating_point:
        return F.cross_entropy(logits, target.long())
    return -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()


@LOSSES.register("mse", help="squared error between outputs and one-hot (or soft) targets")
def mse(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((logits - _soft(target, logits.shape[-1], logits.dtype)) ** 2).sum(-1).mean()


@LOSSES.register("logistic", help="log(1 + exp(-y f(x))) for ±1 labels and a scalar output")
def logistic(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.softplus(-_signs(target, logits.dtype) * logits.reshape(-1)).mean()


@LOSSES.register("exponential", help="exp(-y f(x)) for ±1 labels and a scalar output")
def exponential(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.exp(-_signs(target, logits.dtype) * logits.reshape(-1)).mean()


def get_loss(name: str) -> LossFn:
    """The loss function registered as ``name`` (clear error listing known losses)."""
    return LOSSES.get(name)
