"""Membership inference along a federated run: the loss attack on each round's global model (``membership:
[{run: ...}]``), per defense, beside the run's own chance control (round 0, the untrained model) and its accuracy.

1. digits, the demo's small CNN (``cnn:3-8-2-1,3-16-2-1``, ReLU) trained by FedAvg as in
   ``examples/sweep-rounds.yaml`` (4 iid clients, 1 local epoch of batch 16 at lr 0.1), rounds 0, 1, 5, 20, 50;
   members: 359 of the clients' samples per seed, non-members: the 359 of the test split; 2 seeds (n = 1 436).
2. The control: a run that memorises — the 1 000 CIFAR-10 test images of ``../shared/data/cifar10-test-1000.npz``
   as the dataset, ``mlp:256``, 4 clients of ~200 images, 5 local epochs a round (batch 16, lr 0.05), rounds 0, 1,
   5, 20; 200 members and 200 non-members per seed, 2 seeds (n = 800).  Skipped without the file.

Defenses: none, ``noise:0.1`` and ``dpsgd:1,1`` (and ``noise:0.01`` on digits).  Each cell: the loss attack's AUC
(mean of the seeds) with its 95 % stratified bootstrap interval, whether it lies above 0.5, and the run's test
accuracy.  Runs through ``lb.evaluate`` (one worker), so what is measured is exactly what a sweep computes.

``--quick``: digits only, rounds 0, 1 and 5, 1 seed, none and ``dpsgd:1,1``.

Measured (2026-11, one worker on the shared 2-core CPU, three other jobs beside it): docs/membership.md
("Along training"): digits every interval holds 0.5 (undefended round 50: 0.474 [0.445, 0.504], accuracy 0.965;
training 0.976); CIFAR-10 undefended round 20 0.697 [0.660, 0.730] (training accuracy 0.658, test 0.325),
``noise:0.1`` 0.711, ``dpsgd:1,1`` 0.540 [0.498, 0.579] at accuracy 0.292; round 0 0.483 [0.441, 0.526].
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import leakbench as lb
from leakbench.evaluation import Store
from leakbench.evaluation.membership.verdict import membership_defenses
from leakbench.evaluation.trials.plan import split_round

from .common import CIFAR_NPZ, table


def _spec(dataset: dict, model: dict, rounds: list[int], seeds: list[int], defenses: list, pool: int) -> dict:
    return {"name": "membership-rounds", "datasets": [dataset],
            "models": [{**model, "label": "run", "federated": {**model.pop("federated"), "rounds": rounds}}],
            "batch_sizes": [4], "images": 8, "seeds": seeds, "defenses": defenses,
            "membership": [{"run": "run", "pool": pool}]}


def _rows(spec: dict) -> list[tuple]:
    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "r.db"
        summary = lb.evaluate(spec, db)
        if not summary.complete:
            raise RuntimeError(f"the sweep did not complete: {summary}")
        with Store(db) as store:
            found = membership_defenses(store.rows(kind="membership"))
    rows = []
    for d in sorted(found, key=lambda d: (d.defense != "none", d.defense, split_round(d.model)[1])):
        auc = d.strongest.auc
        rows.append((split_round(d.model)[1], d.defense, f"{auc.mean:.3f} [{auc.low:.3f}, {auc.high:.3f}]", auc.n,
                     "yes" if d.strongest.beats_chance else "no", d.test_accuracy))
    return rows


COLUMNS = ["round", "defense", "loss-attack AUC [95 %]", "n points", "above 0.5", "test accuracy"]
NOTE = ("chance: AUC 0.5, and round 0 (the untrained model, which no sample has touched) is each run's own control; "
        "members: the clients' samples, non-members: the run's test split")


def run(quick: bool = False) -> None:
    cnn = {"spec": "cnn:3-8-2-1,3-16-2-1", "act": "relu",
           "federated": {"clients": 4, "local_epochs": 1, "batch_size": 16, "lr": 0.1, "public": 32}}
    rounds, seeds = ([0, 1, 5], [0]) if quick else ([0, 1, 5, 20, 50], [0, 1])
    defenses = ["none", "dpsgd:1,1"] if quick else ["none", "noise:0.01", "noise:0.1", "dpsgd:1,1"]
    table("membership along FedAvg rounds: digits, demo CNN", COLUMNS,
          _rows(_spec({"name": "digits"}, cnn, rounds, seeds, defenses, 720)), note=NOTE)
    if quick:
        return
    if not CIFAR_NPZ.exists():
        table("the control on CIFAR-10", ["skipped"], [(f"{CIFAR_NPZ} absent",)])
        return
    mlp = {"spec": "mlp:256", "act": "relu",
           "federated": {"clients": 4, "local_epochs": 5, "batch_size": 16, "lr": 0.05, "public": 8}}
    table("the control, a run that memorises: CIFAR-10 (1 000 images), mlp:256, 5 local epochs", COLUMNS,
          _rows(_spec({"name": "npz", "options": {"path": str(CIFAR_NPZ)}}, mlp, [0, 1, 5, 20], [0, 1],
                      ["none", "noise:0.1", "dpsgd:1,1"], 400)), note=NOTE)
