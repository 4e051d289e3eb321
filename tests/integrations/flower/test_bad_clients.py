"""A Flower simulation with three bad clients among two honest ones (issue 29): the audit survives them.

Clients 0 and 1 are honest (one digit each, one SGD step).  Client 2 sends NaN weights in the last round,
client 3 reports partition id 0 (another client's), client 4 reports 10⁹ examples.  Training finishes
every round (FedAvg aggregates what it is sent), the honest clients are scored as in
``test_simulation.py`` (exact recovery), and the bad ones get ``failed`` or ``unverified`` rows with the
reason — none of them aborts the run or is scored against a batch its update does not fit.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")
pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install 'leakbench[flower]'")

import torch  # noqa: E402

import leakbench as lb  # noqa: E402
from leakbench.evaluation.store import Store  # noqa: E402
from leakbench.integrations.flower import AuditStrategy  # noqa: E402

#: a second Flower simulation (~25 s): `make test-slow`.  The default suite keeps test_simulation.py (a simulation
#: audited round by round) and test_untrusted.py (the audit's budgets and undecidable gates, in-process)
pytestmark = pytest.mark.slow

CLIENTS, ROUNDS, LR = 5, 2, 0.1
NAN, LIAR, BLOWN = 2, 3, 4


def model_fn() -> torch.nn.Module:
    return lb.build("mlp:32", input_shape=(1, 8, 8), classes=10, act="relu", seed=0)


def partitions() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = lb.load("digits")
    return [(data.images[i:i + 1].clone(), data.labels[i:i + 1].clone()) for i in range(CLIENTS)]


def apps(out: str):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    parts = partitions()
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        model = model_fn()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = parts[pid]
        opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state = model.state_dict()
        if pid == NAN and rnd == ROUNDS:  # NaN in the last round (FedAvg would carry NaN into later rounds)
            state = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
        reported = {"num-examples": 10**9 if pid == BLOWN else int(x.shape[0]),
                    "partition-id": 0 if pid == LIAR else pid}
        return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(reported)}), reply_to=msg)

    server = ServerApp()
    result: dict = {"evaluated": []}

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = AuditStrategy(FedAvg(fraction_evaluate=0.0, min_train_nodes=CLIENTS, min_available_nodes=CLIENTS),
                                 model_fn=model_fn, attacks=["fc-inversion"], db=f"{out}/audit.db", run="bad",
                                 partitions=parts)

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            result["evaluated"].append(server_round)
            return MetricRecord({"rounds": float(server_round)})

        strategy.start(grid=grid, initial_arrays=ArrayRecord(model_fn().state_dict()), num_rounds=ROUNDS,
                       train_config=ConfigRecord({"lr": LR}), evaluate_fn=evaluate)
        strategy.log.close()

    return server, client, result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from flwr.simulation import run_simulation

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this module is not importable in Ray workers
    out = tmp_path_factory.mktemp("flower-bad")
    server, client, result = apps(str(out))
    run_simulation(server_app=server, client_app=client, num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    store = Store(out / "audit.db", readonly=True)
    yield store, result
    store.close()


def _rows(store: Store) -> dict[tuple[int, int], dict]:
    """(round, node) → the row: the node, not the client's word, identifies a reply."""
    return {(r["spec"]["round"], r["metrics"]["node"]): r for r in store.rows(kind="federated")}


def test_training_finishes_every_round(run):
    _, result = run
    assert result["evaluated"] == list(range(ROUNDS + 1))  # the initial model, then every round


def test_every_reply_of_every_round_has_one_row(run):
    store, _ = run
    rows = _rows(store)
    assert len(rows) == CLIENTS * ROUNDS
    assert {r["spec"]["round"] for r in rows.values()} == set(range(1, ROUNDS + 1))


def test_honest_clients_are_scored_as_before(run):
    store, _ = run
    honest = [r for r in store.rows(kind="federated") if r["spec"]["client"] in ("0", "1")]
    assert len(honest) == 2 * ROUNDS
    for r in honest:
        m = r["metrics"]
        assert r["status"] == "done" and m["scored"], r["error"]
        assert m["rmse"] < 1e-5 and m["psnr"] > 100 and m["label_acc"] == 1.0, m


def test_bad_clients_are_failed_or_unverified_with_the_reason(run):
    store, _ = run
    rows = [r for r in store.rows(kind="federated") if r["spec"]["client"] not in ("0", "1")
            and (r["spec"]["client"], r["spec"]["round"]) != (str(NAN), 1)]  # client 2 is honest in round 1
    by_kind: dict[str, list[dict]] = {"nan": [], "liar": [], "blown": [], "other": []}
    for r in rows:
        error = r["error"] or ""
        kind = ("nan" if "NaN/inf" in error else "liar" if "does not fit" in error
                else "blown" if "num-examples" in error else "other")
        by_kind[kind].append(r)
    assert not by_kind["other"], [(r["spec"]["client"], r["status"], r["error"]) for r in by_kind["other"]]
    assert len(by_kind["nan"]) == 1 and by_kind["nan"][0]["status"] == "failed"  # the last round only
    assert by_kind["nan"][0]["spec"]["round"] == ROUNDS
    assert len(by_kind["liar"]) == ROUNDS and all(r["status"] == "unverified" for r in by_kind["liar"])
    assert all(not r["metrics"]["scored"] and r["metrics"].get("psnr") is None for r in by_kind["liar"])
    assert len(by_kind["blown"]) == ROUNDS and all(r["status"] == "failed" for r in by_kind["blown"])
    assert all("at most" in r["error"] for r in by_kind["blown"])
    # client 2's honest first round: verified and scored like the others
    first = [r for r in store.rows(kind="federated") if r["spec"]["round"] == 1 and r["spec"]["client"] == str(NAN)]
    assert len(first) == 1 and first[0]["status"] == "done" and np.isfinite(first[0]["metrics"]["psnr"])
