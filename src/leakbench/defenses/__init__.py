"""Defenses applied where they belong in the client's pipeline (Liu et al. 2024, Sec. 3 and 5).

A defense is named by a short spec (``"prune:0.9"``, ``"clip:4+noise:0.01"``) that the API,
the CLI and sweep specs share; :func:`parse` turns it into a :class:`Defense`.

- on the shared gradient (:mod:`.gradient`): ``prune:p[,global|layer]``, ``clip:C[,global|layer]``,
  ``noise:σ``, ``graddrop:p``, ``quantize:bits[,stochastic]``;
- in the client's computation (:mod:`.client`): ``dpsgd:C,σ[,q,steps,δ,accountant]``,
  ``local:k,lr``, ``secagg:L[,mean|sum]`` (needs ``population=``), ``dropout:p``;
- from the literature (:mod:`.literature`): ``soteria:p``, ``topk:k[,ef]``, ``mixup:α``,
  ``instahide:k[,c]`` — each with its adaptive attack in :mod:`leakbench.attacks.gradient.adaptive`;
- PRECODE (:mod:`.precode`): ``precode[:k[,beta]]``, a variational bottleneck the round inserts before the
  output layer (:func:`extend_model`), attacked by ``precode-adaptive``; ATS (:mod:`.ats`): ``ats[:policy[,seed]]``,
  training on images transformed by an augmentation policy, attacked by ``ats-adaptive``;
- :func:`share` (:mod:`.pipeline`) runs a client round with a defense — what
  :func:`leakbench.observe` and the utility training both call;
- :func:`epsilon` (:mod:`.accounting`): DP-SGD's ε from Opacus's accountant.
"""
from .accounting import ACCOUNTANTS, epsilon
from .base import DEFENSES, STAGES, ClientPlan, Composition, Defense, Identity, family_of, parse, parts_of, register
from .client import DPSGD, Dropout, LocalSteps, SecureAggregation
from .gradient import Clip, GradDrop, Noise, Prune, Quantize
from .literature import InstaHide, MixUp, Soteria, TopK
from .ats import ATS
from .precode import Precode
from .pipeline import Shared, extend_model, share

__all__ = [
    "family_of",
    "DEFENSES", "STAGES", "ACCOUNTANTS", "ClientPlan", "Composition", "Defense", "Identity", "Shared",
    "parse", "parts_of", "register", "share", "extend_model", "epsilon",
    "Prune", "Clip", "Noise", "GradDrop", "Quantize", "DPSGD", "LocalSteps", "SecureAggregation", "Dropout",
    "Soteria", "TopK", "MixUp", "InstaHide", "Precode", "ATS",
]
