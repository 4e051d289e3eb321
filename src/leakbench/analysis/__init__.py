"""Analyses from theory that predict leakage before (or instead of) an attack.

They read models and observations and never import attacks, evaluation or report:
rank deficiency and the security metric (Chen & Campbell 2022), neuron
exclusivity and the non-uniqueness dimension (Pan et al. 2022), lower bounds on
reconstruction error (Liu et al. 2024), the imprint module's expected recovery
(Fowl et al. 2021), the distance of trained weights to a KKT point (Haim et al. 2022); and the client's
check of a received model for the footprints of a malicious server (:func:`inspect`).
"""
from .imprint import imprint_bins_for, imprint_expected  # noqa: E402  (Fowl et al.)
from .exclusivity import ExclusivityReport, exclusivity  # noqa: E402  (Pan et al.)
from .security import SecurityReport, security_metric  # noqa: E402  (Chen & Campbell)
from .stationarity import KKTResidual, kkt_residual  # noqa: E402  (Haim et al.)
from .bounds import BoundResult, Scaling, cramer_rao, two_layer_scaling  # noqa: E402  (Liu et al.)
from .inspection import Finding, Inspection, inspect  # noqa: E402  (the client's check of a received model)
