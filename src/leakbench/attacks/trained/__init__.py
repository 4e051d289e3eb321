"""Attacks on trained weights: KKT reconstruction (Haim et al.), model inversion, univariate, membership."""
from . import inversion, kkt, membership, univariate  # noqa: F401  (registration)
from .membership import MEMBERSHIP_ATTACKS, MembershipResult, membership_margin

__all__ = ["MEMBERSHIP_ATTACKS", "MembershipResult", "membership_margin"]
