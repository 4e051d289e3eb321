"""Audit a Flower FedAvg run for leakage, round by round, without and with a client defense.

    pip install 'leakbench[flower]'
    python examples/flower/run.py --out flower-audit      # → flower-audit/results.db, flower-audit/report/index.html

scikit-learn's 8×8 digits (bundled, no download) are split over 4 clients; the server holds out 397
digits to measure the global model's accuracy.  Each round every client draws a batch of 8 digits from
its partition and takes 5 full-batch SGD steps (lr 0.5) on a small ReLU CNN: FedAvg's local steps
(McMahan et al. 2017).  Flower's simulation engine runs 3 rounds twice — with no defense, and with
DP-SGD (``dpsgd:1,0.5``, per-sample clipping to 1 and noise multiplier 0.5, ε from Opacus's accountant)
applied by the clients through leakbench's ``defense_mod`` — and leakbench's ``AuditStrategy`` attacks
every client's update of every round with Inverting Gradients (quick budget, 300 steps), scored against
the client's real batch (the auditor is given the partitions: a simulation).  ``leakbench report``
shows leakage per round and client beside the accuracy per round.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import leakbench as lb

SPEC, ACT = "cnn:3-8-1-1,3-16-2-1", "relu"
TEST = 397  # digits held out by the server


def setup(clients: int, batch: int, seed: int = 0):
    """The model builder, each client's batch per round, and the server's test split."""
    data = lb.load("digits")
    order = torch.randperm(data.images.shape[0], generator=torch.Generator().manual_seed(seed))
    test, train = order[:TEST], order[TEST:]
    shards = train.chunk(clients)

    def model_fn() -> torch.nn.Module:
        return lb.build(SPEC, input_shape=data.shape, classes=data.num_classes, act=ACT, seed=seed)

    def client_batch(partition: int, server_round: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = shards[int(partition)]
        pick = torch.randperm(shard.numel(), generator=torch.Generator().manual_seed(
            1000 * int(server_round) + int(partition)))[:batch]
        idx = shard[pick]
        return data.images[idx], data.labels[idx]

    return model_fn, client_batch, (data.images[test], data.labels[test]), float(data.images[train].mean())


def apps(*, run: str, defense: str, db: Path, clients: int, batch: int, steps: int, lr: float, rounds: int,
         attacks: list):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from leakbench.integrations.flower import AuditStrategy, defense_mod, in_step_defense, local_train

    model_fn, client_batch, (x_test, y_test), mean_pixel = setup(clients, batch)
    client = ClientApp(mods=[defense_mod(defense, model_fn=model_fn)] if defense != "none" else [])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        config = msg.content["config"]
        model = model_fn()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = client_batch(pid, int(config["server-round"]))
        result = local_train(model, x, y, lr=float(config["lr"]), steps=int(config["local-steps"]),
                             defense=in_step_defense(config), seed=pid)
        metrics = MetricRecord({"num-examples": int(x.shape[0]), "partition-id": pid, "train-loss": result.loss,
                                **result.metrics()})
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = AuditStrategy(
            FedAvg(fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients),
            model_fn=model_fn, attacks=attacks, db=db, run=run, partitions=client_batch, chance_mean=mean_pixel,
            description={"defense": defense, "clients": clients, "batch": batch, "local-steps": steps})

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model = model_fn()
            model.load_state_dict(arrays.to_torch_state_dict())
            with torch.no_grad():
                logits = model(x_test)
            return MetricRecord({"accuracy": float((logits.argmax(1) == y_test).float().mean()),
                                 "loss": float(torch.nn.functional.cross_entropy(logits, y_test))})

        strategy.start(grid=grid, initial_arrays=ArrayRecord(model_fn().state_dict()), num_rounds=rounds,
                       train_config=ConfigRecord({"lr": lr, "local-steps": steps}), evaluate_fn=evaluate)
        strategy.log.close()

    return server, client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("flower-audit"), help="directory of results.db and report/")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="digits per client per round")
    parser.add_argument("--steps", type=int, default=5, help="local full-batch SGD steps per round")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--defense", default="dpsgd:1,0.5", help="the defended run's leakbench defense spec")
    parser.add_argument("--iterations", type=int, default=300, help="Inverting Gradients steps per update")
    args = parser.parse_args()

    from flwr.simulation import run_simulation

    from leakbench.report import write_report

    args.out.mkdir(parents=True, exist_ok=True)
    db = args.out / "results.db"
    attacks = [{"name": "inverting-gradients", "preset": "quick", "options": {"iterations": args.iterations}}]
    start = time.perf_counter()
    for run, defense in (("no-defense", "none"), (args.defense, args.defense)):
        server, client = apps(run=run, defense=defense, db=db, clients=args.clients, batch=args.batch,
                              steps=args.steps, lr=args.lr, rounds=args.rounds, attacks=attacks)
        run_simulation(server_app=server, client_app=client, num_supernodes=args.clients,
                       backend_config={"client_resources": {"num_cpus": 1}})
    files = write_report(db, args.out / "report")
    print(f"wrote {files.index} in {time.perf_counter() - start:.0f} s (leakbench report {db} --out DIR rewrites it)")


if __name__ == "__main__":
    main()
