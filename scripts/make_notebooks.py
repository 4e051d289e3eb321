#!/usr/bin/env python3
"""Write the notebooks under ``notebooks/`` (outputs stripped) from the cells below.

    python scripts/make_notebooks.py          # rewrites notebooks/*.ipynb

Edit the cells here, not the .ipynb files, so the notebooks stay small in git and in step with each other;
``tests/test_notebooks.py`` executes them (the quick start in ``make test``, all of them in ``make test-slow``)
and checks that the committed files match this script.  Every notebook runs in seconds on a CPU: the bundled
digits, tiny models, a few iterations.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1] / "notebooks"

QUICK_START = [
    ("md", """# leakbench quick start

Load data, build a model, observe the gradient one client would share, attack it, and compare the
reconstruction with the chance level: a flat image at the data mean, which any attacker can output without
looking at the gradient. A score at or below chance is no evidence of leakage. Runs in seconds on a CPU."""),
    ("code", """import torch

import leakbench as lb

torch.manual_seed(0)
data = lb.load("digits")                      # bundled scikit-learn digits: 8×8 grey images in [0, 1]
model = lb.build("cnn:3-4-2-1", input_shape=data.shape, classes=10, act="tanh", seed=0)
data"""),
    ("md", """## What the attacker sees

`lb.observe` runs one training step of a client on a private batch and returns the `Observation` an
eavesdropper sees: the gradient of the mean loss, and the model the server sent."""),
    ("code", """x, y = data.batch(size=2, seed=0)             # the client's private batch
obs = lb.observe(model, x, y)
print(obs.kind, "of", obs.batch_size, "images;", sum(g.numel() for g in obs.gradients), "numbers shared")"""),
    ("md", """## Attack it and compare with chance

Inverting Gradients (Geiping et al. 2020) matches the observed gradient; 100 iterations are enough to see it
work here (the `quick` preset and the paper's budget run longer)."""),
    ("code", """rec = lb.attack("inverting-gradients", obs, iterations=100)
scores = lb.compare(rec, x, y)

flat = data.images.mean(dim=0, keepdim=True).expand_as(x)   # chance: a flat image at the data mean
chance = lb.compare(flat, x, y)
for key in ("rmse", "psnr", "ssim"):
    print(f"{key:>5}: attack {scores[key]:7.3f}   chance {chance[key]:7.3f}")
print("labels recovered:", scores["label_acc"])
print("better than chance:", scores["rmse"] < chance["rmse"])"""),
    ("code", """from IPython.display import Image

from leakbench.report import save_grid

Image(filename=str(save_grid("quick-start.png", x, rec.images, scores=scores)))   # originals on top"""),
]

OWN_ROUND = [
    ("md", """# Audit your own federated round

You have a model and what one client sent in a round: the gradient (FedSGD) or the model after local
training (FedAvg). `Observation.from_gradients` / `Observation.from_update` turn them into the observation
every leakbench attack takes (see `docs/own-round.md`). Here the "client" is simulated in a few lines; in
your set-up the captured tensors come from your server."""),
    ("code", """import copy

import torch
import torch.nn.functional as F

import leakbench as lb
from leakbench.threat import Observation

data = lb.load("digits")
model = lb.build("mlp:16", input_shape=data.shape, classes=10, act="relu", seed=0)   # or your own nn.Module
x, y = data.batch(1, seed=0)                     # the client's private sample (the server never sees it)"""),
    ("md", """## A captured gradient (FedSGD)

An ordinary training step on the client; `captured` is what left it. Pass `train=True` to `from_gradients`
when your client computes the gradient in train mode (batch norm, dropout)."""),
    ("code", """client = copy.deepcopy(model)
F.cross_entropy(client(x), y).backward()
captured = {n: p.grad for n, p in client.named_parameters()}

obs = Observation.from_gradients(model, captured, batch_size=1)
rec = lb.attack("fc-inversion", obs)             # closed form on a fully connected first layer
flat = data.images.mean(dim=0, keepdim=True).expand_as(x)
print(f"PSNR {lb.compare(rec, x, y)['psnr']:.1f} dB (chance {lb.compare(flat, x, y)['psnr']:.1f} dB)")"""),
    ("md", """## A captured update (FedAvg)

The client takes three local SGD steps on a batch of 4; the server sees the model before and after."""),
    ("code", """xb, yb = data.batch(4, seed=1)
after = copy.deepcopy(model)
opt = torch.optim.SGD(after.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    F.cross_entropy(after(xb), yb).backward()
    opt.step()

update = Observation.from_update(model, after, batch_size=4, lr=0.1, steps=3)
print(update.kind, update.local_steps)
rec = lb.attack("inverting-gradients", update, iterations=60)
scores = lb.compare(rec, xb, yb)
chance = lb.compare(data.images.mean(dim=0, keepdim=True).expand_as(xb), xb, yb)
print(f"RMSE {scores['rmse']:.3f} (chance {chance['rmse']:.3f}); below chance: {scores['rmse'] < chance['rmse']}")"""),
    ("md", """A result at or above chance does not mean the round is safe: give the attack more iterations, grant it
the labels (`labels=`) or batch-norm statistics, or audit with a stronger threat model (a malicious server) —
`leakbench list attacks` names them all."""),
]

DEFENSES = [
    ("md", """# Compare defenses to a verdict

A tiny sweep run in this process: two attacks against no defense, gradient noise and pruning, at batch
size 1, with each defense's utility cost measured over three training seeds. leakbench judges a defense by
the strongest attack against it (S_D, Liu et al. 2024) at the utility it costs, and states the verdict with
its margin and the n it rests on. About half a minute on a CPU."""),
    ("code", """import leakbench as lb
from leakbench.cli.evaluate import verdict_texts
from leakbench.evaluation import Store
from leakbench.evaluation.verdicts.strongest import strongest

spec = {
    "name": "defenses-notebook",
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "mlp:16", "act": "relu"}],
    "batch_sizes": [1],
    "images": 4,                                  # 4 batches of one image per setting
    "seeds": [0],
    "attacks": [{"name": "fc-inversion", "preset": "quick"},
                {"name": "inverting-gradients", "options": {"iterations": 30}, "label": "ig"}],
    "defenses": ["none", {"noise": [0.1]}, {"prune": [0.9]}],
    "utility": {"epochs": 1, "batch_size": 64, "lr": 0.1, "seeds": [0, 1, 2]},
}
summary = lb.evaluate(spec, "defenses.db", workers=1)   # in-process; a script with workers > 1 needs the
summary                                                 # `if __name__ == "__main__":` guard"""),
    ("md", "## The strongest attack per defense (Table 4's highlight)"),
    ("code", """with Store("defenses.db") as store:
    rows = store.rows()
for s in strongest(rows):
    print(f"{s.defense:>10}  B = {s.batch_size}  strongest: {s.attack:<13} RMSE {s.rmse:.3f} "
          f"(chance {s.chance_rmse:.3f}){'  stops every attack' if s.stops else ''}")"""),
    ("md", "## The verdict"),
    ("code", """for line in verdict_texts(rows):
    print(line)"""),
    ("md", """The same sweep from the command line: `leakbench evaluate spec.yaml --db defenses.db --report report/`;
`leakbench report defenses.db --out report --pdf` also prints the report to `report/report.pdf`."""),
    ("code", """from leakbench.report import write_report

files = write_report("defenses.db", "defenses-report")
print(files.index)"""),
]

FLOWER = [
    ("md", """# Audit a Flower federation

`leakbench.integrations.flower` audits a live Flower run (Message API): `AuditStrategy` wraps any server
strategy and attacks every client's update before aggregation; `audit_mod` measures on the client what its
own update leaks. This notebook runs a two-client, two-round simulation on Flower's Ray backend (needs
`pip install 'leakbench[flower]'`; see `docs/flower.md`). It takes about a minute, most of it starting Ray."""),
    ("code", """import torch

import leakbench as lb
from leakbench.integrations.flower import AuditStrategy

CLIENTS, ROUNDS, LR = 2, 2, 0.1


def model_fn():
    return lb.build("mlp:32", input_shape=(1, 8, 8), classes=10, act="relu", seed=0)


data = lb.load("digits")
parts = [(data.images[i:i + 1].clone(), data.labels[i:i + 1].clone()) for i in range(CLIENTS)]  # one digit each"""),
    ("code", """from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    model = model_fn()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = parts[pid]
    opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    metrics = MetricRecord({"num-examples": int(x.shape[0]), "partition-id": pid})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    strategy = AuditStrategy(FedAvg(fraction_evaluate=0.0, min_train_nodes=CLIENTS, min_available_nodes=CLIENTS),
                             model_fn=model_fn, attacks=["fc-inversion"], db="flower-audit.db", run="notebook",
                             partitions=parts)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model_fn().state_dict()), num_rounds=ROUNDS,
                   train_config=ConfigRecord({"lr": LR}))
    strategy.log.close()"""),
    ("code", """from flwr.simulation import run_simulation

run_simulation(server_app=server, client_app=client, num_supernodes=CLIENTS,
               backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}})"""),
    ("md", "## What each client's update leaked, round by round"),
    ("code", """from leakbench.evaluation import Store

with Store("flower-audit.db", readonly=True) as store:
    audited = [r for r in store.rows(kind="federated") if r["status"] == "done"]
for r in audited:
    print(f"round {r['spec']['round']} client {r['spec']['client']} {r['attack']}: PSNR {r['psnr']:.1f} dB")
print(len(audited), "updates audited")"""),
    ("md", "`leakbench report flower-audit.db --out flower-report` shows leakage per round and client beside accuracy."),
]

NOTEBOOKS = {"quick-start": QUICK_START, "own-round": OWN_ROUND, "compare-defenses": DEFENSES, "flower": FLOWER}


def notebook(cells) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells])
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"  # stable ids: regenerating changes nothing
    return nb


def text(name: str) -> str:
    return nbformat.writes(notebook(NOTEBOOKS[name])) + "\n"


def main() -> int:
    ROOT.mkdir(exist_ok=True)
    for name in NOTEBOOKS:
        (ROOT / f"{name}.ipynb").write_text(text(name), encoding="utf-8")
        print(f"wrote notebooks/{name}.ipynb", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
