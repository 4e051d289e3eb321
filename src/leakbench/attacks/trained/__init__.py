"""Attacks on trained weights: KKT reconstruction (Haim et al.), model inversion and the univariate attack.
The membership attacks on trained weights live in :mod:`leakbench.attacks.membership`."""
from . import inversion, kkt, univariate  # noqa: F401  (registration)
