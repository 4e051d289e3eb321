"""A malicious server meets clients that check what they receive: trap weights are refused, with the reason.

    pip install 'leakbench[flower]'
    python examples/flower/malicious.py            # about a minute: Flower's simulation engine starts Ray

Three clients hold scikit-learn's 8×8 digits (bundled) and train a ReLU MLP (``mlp:64``) by FedAvg.  The server
is honest in round 1; from round 2 (``--attack-round``) it ships the global model with Boenisch et al.'s trap
weights in the first layer (:func:`leakbench.models.active.trap_weights`, calibrated on 256 digits it holds),
so that the gradients would give away most of each client's batch exactly (``trap-weights``).  Every client runs
``inspect_mod`` first in its mods: before training it compares the received model with the one it received the
round before and runs it on its own batch (:func:`leakbench.inspect`).  The honest round trains; the trap rounds
are refused — the train function never runs — and each refusal carries the evidence, printed at the end, e.g.
``model refused before training: weight-change at fc1.weight: cosine 0.004 …; sign-balance at fc1.weight: 64 of 64
rows have exactly 32 of 64 entries negative …``.  ``--no-check`` runs the same clients without the mod: the trap
rounds train, and ``trap-weights`` on the first client's update shows what the server would have read.
"""
from __future__ import annotations

import argparse
import time

import torch

import leakbench as lb

SPEC = "mlp:64"
PUBLIC = 256


def setup(clients: int, batch: int, seed: int = 0):
    data = lb.load("digits")
    order = torch.randperm(len(data.images) - PUBLIC, generator=torch.Generator().manual_seed(seed))
    shards = order.chunk(clients)
    public = data.images[len(data.images) - PUBLIC:]  # the server's own digits: no client holds them

    def model_fn() -> torch.nn.Module:
        return lb.build(SPEC, input_shape=data.shape, classes=data.num_classes, act="relu", seed=seed)

    def client_batch(partition: int, server_round: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = shards[int(partition)]
        pick = torch.randperm(shard.numel(), generator=torch.Generator().manual_seed(
            1000 * int(server_round) + int(partition)))[:batch]
        return data.images[shard[pick]], data.labels[shard[pick]]

    return model_fn, client_batch, public


def apps(*, clients: int, batch: int, rounds: int, attack_round: int, check: bool, refusals: list, updates: dict):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from leakbench.integrations.flower import inspect_mod
    from leakbench.models.active import trap_weights

    model_fn, client_batch, public = setup(clients, batch)

    def data_fn(context: Context, server_round: int):
        return client_batch(int(context.node_config["partition-id"]), server_round)

    client = ClientApp(mods=[inspect_mod(model_fn=model_fn, data_fn=data_fn)] if check else [])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        model = model_fn()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = client_batch(pid, int(msg.content["config"]["server-round"]))
        opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": int(x.shape[0]), "partition-id": pid})}),
                       reply_to=msg)

    class TrapServer(FedAvg):
        """FedAvg that ships trap weights from ``attack_round`` on (and keeps the replies' refusals)."""

        def configure_train(self, server_round, arrays, config, grid):
            if server_round >= attack_round:
                honest = model_fn()
                honest.load_state_dict(arrays.to_torch_state_dict())
                shipped = trap_weights(honest, rate=1 / batch, calibration=public, seed=server_round)
                arrays = ArrayRecord(shipped.state_dict())
                updates.setdefault("shipped", {})[server_round] = shipped
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            for r in replies:
                if r.has_error():
                    refusals.append((server_round, r.error.reason))
                elif server_round >= attack_round and "first" not in updates:
                    updates["first"] = (server_round, r.content["arrays"].to_torch_state_dict(),
                                        int(r.content["metrics"]["partition-id"]))
            return super().aggregate_train(server_round, replies)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = TrapServer(fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model_fn().state_dict()), num_rounds=rounds,
                       train_config=ConfigRecord({"lr": 0.1}))

    return server, client, client_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attack-round", type=int, default=2, help="first round the server ships trap weights")
    parser.add_argument("--batch", type=int, default=32, help="digits per client per round")
    parser.add_argument("--no-check", action="store_true", help="clients without inspect_mod")
    args = parser.parse_args()

    from flwr.simulation import run_simulation

    refusals: list = []
    updates: dict = {}
    start = time.perf_counter()
    server, client, client_batch = apps(clients=args.clients, batch=args.batch, rounds=args.rounds,
                                        attack_round=args.attack_round, check=not args.no_check,
                                        refusals=refusals, updates=updates)
    run_simulation(server_app=server, client_app=client, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1}})
    print(f"\n{len(refusals)} model(s) refused by the clients ({time.perf_counter() - start:.0f} s):")
    for server_round, reason in refusals:
        print(f"  round {server_round}: {reason[:400]}")
    if "first" in updates:  # no check: what the server reads from one client's update in its first trap round
        server_round, after, pid = updates["first"]
        shipped = updates["shipped"][server_round]
        trained = lb.build(SPEC, input_shape=(1, 8, 8), classes=10, act="relu")
        trained.load_state_dict(after)
        obs = lb.Observation.from_update(shipped, trained, batch_size=args.batch, lr=0.1)
        rec = lb.attack("trap-weights", obs)
        x, _ = client_batch(pid, server_round)
        err = (rec.images.reshape(len(rec.images), -1)[None] - x.reshape(len(x), -1)[:, None]).abs().amax(-1)
        exact = int((err.min(1).values < 1e-3).sum())
        print(f"without the check, round {server_round}: trap-weights rebuilds {exact} of client {pid}'s "
              f"{len(x)} digits exactly from its update")


if __name__ == "__main__":
    main()
