"""Attacks that rebuild training data from a shared gradient or update."""
from . import dlg, inverting  # noqa: F401  (registration)
