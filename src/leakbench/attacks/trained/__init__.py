"""Attacks on trained weights: KKT reconstruction (Haim et al.), model inversion, univariate, membership
(the margin attack, and LiRA, RMIA and the loss threshold with reference models)."""
from . import inversion, kkt, membership, reference, univariate  # noqa: F401  (registration)
from ..membership_base import MEMBERSHIP_ATTACKS, MembershipResult
from .membership import membership_margin
from .reference import ReferenceOutputs, lira_scores, logit_confidence, loss_scores, rmia_scores

__all__ = ["MEMBERSHIP_ATTACKS", "MembershipResult", "membership_margin", "ReferenceOutputs", "lira_scores",
           "logit_confidence", "loss_scores", "rmia_scores"]
