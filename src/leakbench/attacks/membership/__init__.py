"""Membership attacks on trained weights: the registry and result (base), the margin attack, and LiRA, RMIA and
the loss threshold with reference models."""
from . import margin, reference  # noqa: F401  (registration)
from .base import MEMBERSHIP_ATTACKS, MembershipResult
from .margin import membership_margin
from .reference import ReferenceOutputs, lira_scores, logit_confidence, loss_scores, rmia_scores

__all__ = ["MEMBERSHIP_ATTACKS", "MembershipResult", "membership_margin", "ReferenceOutputs", "lira_scores",
           "logit_confidence", "loss_scores", "rmia_scores"]
