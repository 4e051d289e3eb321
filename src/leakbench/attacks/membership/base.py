"""What every membership attack shares: the registry :data:`MEMBERSHIP_ATTACKS` (the names the API, the CLI and
sweep specs use) and the result, :class:`MembershipResult`.  The attacks themselves live in
:mod:`leakbench.attacks.trained` (the margin attack, the loss baseline, LiRA and RMIA), which fill the registry."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...registry import Registry

__all__ = ["MEMBERSHIP_ATTACKS", "MembershipResult"]

MEMBERSHIP_ATTACKS: Registry = Registry("membership attack")


@dataclass
class MembershipResult:
    """Per-point scores (|f(x)| or y·f(x) for the margin; a likelihood ratio for LiRA/RMIA), the threshold used,
    decisions, and the margin estimate (None where the attack has none)."""

    scores: torch.Tensor
    threshold: float
    members: torch.Tensor
    margin: float | None
    mode: str
    signed: bool
    info: dict = field(default_factory=dict)
