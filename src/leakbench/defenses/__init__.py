"""Defenses applied where they belong in the client's pipeline.

A defense is named by a short spec (``"prune:0.9"``, ``"clip:4+noise:0.01"``) that
the API, the CLI and sweep specs share; :func:`parse` turns it into a
:class:`Defense`.  The foundation ships the contract and the identity defense
``none``; the gradient- and client-side defenses register here as they land.
"""
from .base import DEFENSES, Composition, Defense, Identity, parse

__all__ = ["DEFENSES", "Composition", "Defense", "Identity", "parse"]
