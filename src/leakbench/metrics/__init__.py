"""Reconstruction quality: per-sample scores, batch matching and ``compare``.

- :mod:`.image` — pure per-sample scores on tensors (mse, rmse, psnr, ssim,
  cosine, ncc), each returning shape (B,).
- :mod:`.matching` — the best one-to-one matching of reconstructions to
  originals (Hungarian method, Liu et al. 2024 eq. (1)).
- :mod:`.compare` — :func:`compare`, the entry point used by the API, the
  sweeps and the report.
- :mod:`.perceptual` — optional LPIPS, only when its weights are on disk.
- :mod:`.text_metrics` — text: token accuracy after matching, ROUGE-1/2/L, exact-sequence rate, and
  their unigram chance level.

``METRICS`` maps metric names to the per-sample functions (:mod:`.registered`; a plug-in adds its own with
:func:`register`, and ``compare`` computes every one), so sweep specs and the CLI name metrics the same way; each entry carries its :class:`MetricInfo`
(``METRICS.info(name)``: label, higher-is-better, format), and :data:`SCORES`
lists the batch scores of ``compare`` from which every table's columns are generated.  This package imports nothing from
attacks, evaluation or report.
"""
from __future__ import annotations

from .compare import compare
from .features import feature_error, span_basis
from .image import cosine, mse, ncc, psnr, rmse, ssim
from .matching import match, pairwise_mse
from .membership import MembershipScores, accuracy_at, membership_scores, roc_auc, tpr_at_fpr
from .perceptual import lpips_available, lpips_distance
from .registered import METRICS, register
from .scores import SCORES, MetricInfo, score_columns
from .text_metrics import TEXT_SCORES, text_scores, unigram_chance
from .voting import VotingResult, ncc_matrix, scale_unit, vote

__all__ = [
    "METRICS",
    "register",
    "SCORES",
    "MetricInfo",
    "score_columns",
    "compare",
    "match",
    "pairwise_mse",
    "mse",
    "rmse",
    "psnr",
    "ssim",
    "cosine",
    "ncc",
    "lpips_available",
    "lpips_distance",
    "feature_error",
    "span_basis",
    "MembershipScores", "accuracy_at", "membership_scores", "roc_auc", "tpr_at_fpr",
    "VotingResult", "ncc_matrix", "scale_unit", "vote",
    "TEXT_SCORES", "text_scores", "unigram_chance",
]
