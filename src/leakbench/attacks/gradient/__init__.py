"""Attacks that rebuild training data from a shared gradient or update."""
from . import dlg, inverting  # noqa: F401  (registration)
from . import cocktail_party, ggl, gias, gifd, liu2024, tensor_features  # noqa: F401,E402  (registration: feature-level, generative)
from . import fishing, fishing_rounds, loki, robbing_the_fed, trap_weights  # noqa: F401,E402  (registration: malicious server)
from . import exan_inversion, fc_inversion, hybrid, rgap, spear, spear_features  # noqa: F401,E402  (registration: analytic attacks)
from . import adaptive, adaptive_ats, adaptive_precode  # noqa: F401,E402  (registration: the attacks that know a defense)
