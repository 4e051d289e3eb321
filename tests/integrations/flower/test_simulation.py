"""A real Flower simulation (Ray backend, 2 clients, 2 rounds) audited by AuditStrategy and audit_mod.

One module-scoped run serves every test here: an untrained ReLU MLP, each client holding one digit
(batch 1) and taking one SGD step per round, ``fc-inversion`` on the server and in the client mod.  The
client also saves the update it sends, so the store can be checked against it.
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")
pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install 'leakbench[flower]'")

import torch  # noqa: E402

import leakbench as lb  # noqa: E402
from leakbench.evaluation.store import Store  # noqa: E402
from leakbench.integrations.flower import AuditStrategy, audit_mod, load_update  # noqa: E402

CLIENTS, ROUNDS, LR = 2, 2, 0.1
ATTACKS = ["fc-inversion"]


def model_fn() -> torch.nn.Module:
    return lb.build("mlp:32", input_shape=(1, 8, 8), classes=10, act="relu", seed=0)


def partitions() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = lb.load("digits")
    return [(data.images[i:i + 1].clone(), data.labels[i:i + 1].clone()) for i in range(CLIENTS)]


def apps(saved_dir: str):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    parts = partitions()

    def data_fn(context: Context, server_round: int):
        return parts[int(context.node_config["partition-id"])]

    client = ClientApp(mods=[audit_mod(model_fn=model_fn, data_fn=data_fn, attacks=ATTACKS)])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        model = model_fn()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        x, y = parts[pid]
        opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        rnd = int(msg.content["config"]["server-round"])
        np.savez(f"{saved_dir}/r{rnd}-c{pid}.npz", **{n: (p.detach() - before[n]).numpy()
                                                       for n, p in model.named_parameters()})
        metrics = MetricRecord({"num-examples": int(x.shape[0]), "partition-id": pid})
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)

    server = ServerApp()
    result: dict = {}

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = AuditStrategy(FedAvg(fraction_evaluate=0.0, min_train_nodes=CLIENTS, min_available_nodes=CLIENTS),
                                 model_fn=model_fn, attacks=ATTACKS, db=f"{saved_dir}/audit.db", run="test",
                                 partitions=parts)

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model = model_fn()
            model.load_state_dict(arrays.to_torch_state_dict())
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            return MetricRecord({"accuracy": float((model(x).argmax(1) == y).float().mean())})

        strategy.start(grid=grid, initial_arrays=ArrayRecord(model_fn().state_dict()), num_rounds=ROUNDS,
                       train_config=ConfigRecord({"lr": LR}), evaluate_fn=evaluate)
        result["audited"] = list(strategy.audited)
        strategy.log.close()

    return server, client, result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from flwr.simulation import run_simulation

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this module is not importable in Ray workers
    out = tmp_path_factory.mktemp("flower")
    server, client, result = apps(str(out))
    start = time.perf_counter()
    run_simulation(server_app=server, client_app=client, num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 2}, "init_args": {"num_cpus": 2}})
    result["seconds"] = time.perf_counter() - start
    store = Store(out / "audit.db", readonly=True)
    yield out, store, result
    store.close()


def _update_path(store: Store, key: str):
    """The update file of a row: stored relative to the store's folder, resolved by the store."""
    stored = store._conn.execute("SELECT path FROM images WHERE key = ? AND kind = 'update'", (key,)).fetchone()[0]
    path, refused = store.resolve_file(stored, key, "update")
    assert refused is None and path is not None
    return path


def test_one_audited_update_per_client_per_round(run):
    _, store, result = run
    rows = store.rows(kind="federated")
    tags = sorted((r["spec"]["run"], r["spec"]["round"], r["spec"]["client"], r["attack"]) for r in rows)
    assert tags == [("test", rnd, str(c), "fc-inversion") for rnd in (1, 2) for c in range(CLIENTS)]
    assert sorted(result["audited"]) == sorted(r["key"] for r in rows)
    assert all(r["status"] == "done" and r["spec"]["mode"] == "simulation" for r in rows)
    accuracy = {r["spec"]["round"]: r["metrics"]["accuracy"] for r in store.rows(kind="federated-round")}
    assert sorted(accuracy) == [0, 1, 2]  # the initial model and each round


def test_stored_update_equals_the_clients_update(run):
    out, store, _ = run
    for r in store.rows(kind="federated"):
        path = _update_path(store, r["key"])
        stored = load_update(path)
        with np.load(out / f"r{r['spec']['round']}-c{r['spec']['client']}.npz") as sent:
            assert sorted(stored) == sorted(sent.files)
            for name in sent.files:
                assert torch.equal(stored[name], torch.from_numpy(sent[name])), name


def test_audit_recovers_each_clients_sample_exactly(run):
    _, store, _ = run
    for r in store.rows(kind="federated"):
        m = r["metrics"]
        # exact recovery of the batch-1 input (Lemma 3.1) vs. the chance control: the partitions' mean grey
        assert m["rmse"] < 1e-5 and m["psnr"] > 100, m
        assert m["chance_rmse"] > 0.2 and m["chance_psnr"] < 15, m
        assert m["label_acc"] == 1.0


def test_client_mod_metric_equals_a_direct_attack(run):
    out, store, _ = run
    parts = partitions()
    for r in store.rows(kind="federated"):
        reported = r["metrics"]["reported"]
        assert set(reported) >= {"leakbench-rmse", "leakbench-psnr", "leakbench-seconds"}
        rnd, client = r["spec"]["round"], int(r["spec"]["client"])
        path = _update_path(store, r["key"])
        # the direct attack: the global model of that round rebuilt from the stored updates
        before = model_fn()
        state = dict(before.state_dict())
        for earlier in range(1, rnd):
            ups = [np.load(out / f"r{earlier}-c{c}.npz") for c in range(CLIENTS)]
            for name in state:
                state[name] = state[name] + sum(torch.from_numpy(u[name]) for u in ups) / CLIENTS
        before.load_state_dict(state)
        after = model_fn()
        delta = load_update(path)
        after.load_state_dict({n: state[n] + delta[n] for n in state})
        obs = lb.Observation.from_update(before, after, batch_size=1, lr=LR, steps=1)
        x, y = parts[client]
        score = lb.compare(lb.attack("fc-inversion", obs), x, y)
        assert reported["leakbench-rmse"] == pytest.approx(score["rmse"], rel=1e-6, abs=1e-9)
        assert r["metrics"]["rmse"] == pytest.approx(score["rmse"], rel=1e-6, abs=1e-9)


def test_simulation_wall_time_is_reported(run):
    _, _, result = run
    assert math.isfinite(result["seconds"]) and result["seconds"] > 0
    print(f"\nFlower simulation (2 clients, 2 rounds, audited): {result['seconds']:.1f} s")


def test_report_shows_leakage_per_round_and_client_beside_accuracy(run, tmp_path):
    from leakbench.report import write_report

    _, store, _ = run
    files = write_report(store, tmp_path / "report")
    page = files.index.read_text()
    assert "Federated runs (Flower audit)" in page and "Run test" in page
    assert "scored against the client&#x27;s real batch" in page
    section = page[page.index('id="federated"'):]
    per_round = section[section.index("<h4>Per round</h4>"):section.index("<h4>Per round and client</h4>")]
    for rnd in (0, 1, 2):
        assert f"<td class=\"l\">{rnd}</td>" in per_round
    assert per_round.count("<tr>") == 1 + 3  # header + rounds 0, 1, 2
    per_client = section[section.index("<h4>Per round and client</h4>"):]
    assert per_client.count("<td class=\"l\">fc-inversion</td>") == 2 * CLIENTS
    assert any(p.name.startswith("federated-") for p in files.plots)
    assert any(p.name.startswith("federated-grid-") for p in files.grids)
