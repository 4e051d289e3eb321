"""Audit a Flower federated run for leakage, round by round (``pip install 'leakbench[flower]'``).

Uses Flower's Message API (``flwr.serverapp.strategy.Strategy``, ``ClientApp`` with ``@app.train()``
and client mods), current since Flower 1.21; tested with Flower 1.41 and 1.42.

- :class:`AuditStrategy` (server): wraps any strategy (``FedAvg()``, ...); every k rounds it attacks each
  client's update with the named attacks and stores the results, tagged with run, round and client, in a
  leakbench results store; ``leakbench report`` shows leakage per round and client beside the accuracy.
- :func:`audit_mod` (client): the client attacks its own update before it leaves, adds the best
  RMSE/PSNR to its fit metrics, and with ``max_psnr`` refuses to send a leaking update.  It and
  :func:`defense_mod` also read a legacy ``NumPyClient`` app's ``FitIns``/``FitRes`` records, so they compose
  with Flower's ``fixedclipping_mod``, ``LocalDpMod`` and ``secaggplus_mod``.
- :func:`defense_mod` (client): leakbench defense specs (``prune:0.9``, ``clip:1+noise:0.01``,
  ``dpsgd:1,0.5`` with Opacus accounting) on what the client sends; :func:`local_train` is the local
  SGD loop that runs the in-step ones (DP-SGD, dropout).
- :func:`inspect_mod` (client): before training, checks the received model for the footprints of known
  malicious-server modifications (:func:`leakbench.analysis.inspect`) and refuses a suspicious one with the evidence.
- :class:`Auditor` and :class:`AuditLog`: the audit core and the store writer, usable without Flower's
  runtime (e.g. on updates saved from another framework).

See ``docs/flower.md``.
"""
try:
    import flwr  # noqa: F401
except ImportError as err:  # one clear line instead of a deep traceback
    raise ImportError("leakbench.integrations.flower needs Flower, which is not installed: "
                      "pip install '.[flower]' in a leakbench checkout (or 'leakbench[flower]' from an index that "
                      "has it)") from err

from .audit import AttackChoice, Audited, Auditor, attack_choices, best, chance
from .keys import FitKeys, LocalTraining, local_training
from .mods import AUDIT_KEYS, AUDIT_NOTE_KEY, EPSILON_KEY, UNDECIDED, VERDICT_KEY, audit_mod, defense_mod
from .storage import AuditLog, FederatedSpec, load_update
from .check import inspect_mod
from .strategy import AuditStrategy
from .train import LocalResult, in_step_defense, local_train

__all__ = ["AuditStrategy", "audit_mod", "defense_mod", "inspect_mod", "local_train", "in_step_defense", "LocalResult",
           "Auditor", "Audited", "AttackChoice", "attack_choices", "best", "chance", "AuditLog", "FederatedSpec",
           "load_update", "FitKeys", "LocalTraining", "local_training", "AUDIT_KEYS", "AUDIT_NOTE_KEY", "EPSILON_KEY",
           "VERDICT_KEY", "UNDECIDED"]
