"""Attacks: the contract, the registry and every registered attack.

``leakbench.attack(name, observation, **options)`` runs one; ``names()`` lists them.
"""
from . import gradient, membership, trained  # noqa: F401  (registration)
from .text import dager, lamp, tag, text_imprint  # noqa: F401  (registration)
from .batch import attack_batch
from .base import THREAT_TAGS, ATTACKS, Attack, Reconstruction, attack, attack_tags, create, preset_revision, register
from .labels import idlg, label_counts, recover_labels
from .solvers.gradient_matching import GradientMatcher
from .solvers.matching_settings import MatchingSettings


def names() -> list[str]:
    """Names of the registered attacks."""
    return ATTACKS.names()


__all__ = ["THREAT_TAGS", "attack_tags", "ATTACKS", "Attack", "Reconstruction", "attack", "attack_batch", "create", "preset_revision", "register", "names",
           "idlg", "label_counts", "recover_labels", "GradientMatcher", "MatchingSettings"]
