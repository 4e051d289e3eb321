"""Least squares that give the same bits in every process: :func:`lstsq`.

``torch.linalg.lstsq`` picks LAPACK's ``gelsy`` (QR with column pivoting) on the CPU by default.  With
torch 2.13's MKL 2024.2, ``gelsy`` returned different solutions for the same input in different processes
(a few ulps for a well-posed system, a different basic solution when the matrix is rank-deficient), so the
tensor method's Jennrich candidates (:mod:`.tensor_moments`), ranked by their least-squares fit, changed
from run to run and ``tensor-features`` / ``liu2024`` trials on the random head gave different scores for
one spec.  ``gelsd`` (SVD, the minimum-norm solution, also for a rank-deficient matrix) gave the same bits
in every process (``tests/evaluation/running/test_reruns.py``).  On CUDA torch offers ``gels`` only.
"""
from __future__ import annotations

import torch

__all__ = ["lstsq"]


def lstsq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The least-squares solution x of a x ≈ b (``gelsd`` on the CPU: minimum norm, reproducible)."""
    if a.device.type == "cpu":
        return torch.linalg.lstsq(a, b, driver="gelsd").solution
    return torch.linalg.lstsq(a, b).solution
