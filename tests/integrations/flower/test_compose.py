"""``audit_mod`` composed with Flower's own ``fixedclipping_mod``, ``LocalDpMod`` and ``secaggplus_mod``.

Those mods read and write the legacy ``FitIns``/``FitRes`` records of a ``NumPyClient`` app, so the client
here is one: ``ClientApp(client_fn=..., mods=[...])`` as Flower builds it, called with train messages that
went through Flower's wire format (protobuf) both ways.  SecAgg+ runs its whole protocol (setup, share keys,
collect masked vectors, unmask) under Flower's ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` with
a ``FedAvg`` strategy, through :class:`InProcessGrid`, a ``Grid`` that hands each message to the ClientApp in
this process instead of through a SuperLink (no Ray, well under a second).

Model and data as in ``test_mods.py``: an untrained ReLU MLP, one digit per client, one SGD step at lr 0.1,
so ``fc-inversion`` recovers the digit exactly (RMSE < 1e-5; chance, a flat grey image: RMSE ≈ 0.4).
"""
from __future__ import annotations

import math
from uuid import uuid4

import pytest

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import Context, Message, MessageType, RecordDict  # noqa: E402
from flwr.client import NumPyClient  # noqa: E402
from flwr.client.mod import LocalDpMod, fixedclipping_mod, secaggplus_mod  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.common.serde import message_from_proto, message_to_proto  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.run import Run  # noqa: E402

import leakbench as lb  # noqa: E402
from leakbench.integrations.flower import AUDIT_NOTE_KEY, VERDICT_KEY, audit_mod, defense_mod  # noqa: E402

LR = 0.1
CLIP = 0.05  # the raw one-step update's norm is ≈ 0.4 (asserted below)


pytestmark = pytest.mark.usefixtures("task_identity")  # conftest.py


def model_fn() -> torch.nn.Module:
    return lb.build("mlp:32", input_shape=(1, 8, 8), classes=10, act="relu", seed=0)


DATA = lb.load("digits")


def batch_of(partition: int):
    return DATA.images[partition:partition + 1].clone(), DATA.labels[partition:partition + 1].clone()


def ndarrays(model: torch.nn.Module) -> list[np.ndarray]:
    return [v.detach().cpu().numpy() for v in model.state_dict().values()]


class DigitClient(NumPyClient):
    """Flower's PyTorch quickstart client: arrays by position in ``state_dict()`` order, one SGD step."""

    def __init__(self, partition: int):
        self.partition = partition

    def fit(self, parameters, config):
        model = model_fn()
        model.load_state_dict({k: torch.from_numpy(np.array(a)) for k, a in zip(model.state_dict(), parameters)})
        x, y = batch_of(self.partition)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= float(config["lr"]) * p.grad
        return ndarrays(model), len(x), {}


def client_fn(context: Context):
    return DigitClient(int(context.node_config["partition-id"])).to_client()


def audit(**options):
    return audit_mod(model_fn=model_fn, data_fn=lambda ctx, rnd: batch_of(int(ctx.node_config["partition-id"])),
                     attacks=["fc-inversion"], **options)


def wire(msg: Message) -> Message:
    """The message as the other side receives it: through Flower's protobuf serialisation."""
    return message_from_proto(message_to_proto(msg))


def context(partition: int = 0, node: int = 7) -> Context:
    return Context(run_id=1, node_id=node, node_config={"partition-id": partition}, state=RecordDict(), run_config={})


def fit_message(config: dict, server_round: int = 1) -> Message:
    """A legacy train message as ``DefaultWorkflow`` sends it (FitIns records, the round as group id)."""
    fitins = FitIns(ndarrays_to_parameters(ndarrays(model_fn())), config)
    msg = Message(compat.fitins_to_recorddict(fitins, keep_input=True), dst_node_id=7,
                  message_type=MessageType.TRAIN, group_id=str(server_round))
    msg.metadata.__dict__["_message_id"] = str(uuid4())
    return wire(msg)


def run_client(mods, config: dict, partition: int = 0) -> Message:
    reply = ClientApp(client_fn=client_fn, mods=mods)(fit_message(config), context(partition))
    return wire(reply)


def update_of(reply: Message) -> list[np.ndarray]:
    """θ_after − θ_before the reply carries (the FitRes it sends, as the server reads it)."""
    after = parameters_to_ndarrays(compat.recorddict_to_fitres(reply.content, keep_input=True).parameters)
    return [a - b for a, b in zip(after, ndarrays(model_fn()))]


def norm(update: list[np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(u.astype(np.float64) ** 2)) for u in update))


def metrics_of(reply: Message) -> dict:
    return dict(compat.recorddict_to_fitres(reply.content, keep_input=True).metrics)


def direct_rmse(update: list[np.ndarray], partition: int = 0) -> float:
    """fc-inversion on ``update`` by hand (lb.attack), scored against the client's digit."""
    before, after = model_fn(), model_fn()
    with torch.no_grad():
        for p, d in zip(after.parameters(), update):
            p += torch.from_numpy(d)
    rec = lb.attack("fc-inversion", lb.Observation.from_update(before, after, batch_size=1, lr=LR))
    return lb.compare(rec, *batch_of(partition))["rmse"]


def raw_update() -> list[np.ndarray]:
    return update_of(run_client([], {"lr": LR}))


def test_audit_reads_and_writes_the_legacy_layout():
    reply = run_client([audit()], {"lr": LR})
    assert not reply.has_error()
    raw = raw_update()
    assert all(np.array_equal(a, b) for a, b in zip(update_of(reply), raw))  # the audit changed nothing
    metrics = metrics_of(reply)  # a valid FitRes: DefaultWorkflow's recorddict_to_fitres reads it
    assert metrics["leakbench-rmse"] == pytest.approx(direct_rmse(raw), rel=1e-9, abs=1e-12)
    assert metrics["leakbench-rmse"] < 1e-5  # exact; chance (grey) ≈ 0.4
    assert metrics["leakbench-norm"] == pytest.approx(norm(raw), rel=1e-6)


def test_fixedclipping_inside_the_audit_audits_the_clipped_update_and_outside_the_raw_one():
    config = {"lr": LR, "clipping_norm": CLIP}  # what DifferentialPrivacyClientSideFixedClipping sends
    raw_norm = norm(raw_update())
    assert raw_norm > 4 * CLIP
    for mods, audited in (([audit(), fixedclipping_mod], CLIP), ([fixedclipping_mod, audit()], raw_norm)):
        reply = run_client(mods, config)
        assert not reply.has_error()
        sent = update_of(reply)
        assert norm(sent) == pytest.approx(CLIP, rel=1e-5)  # what leaves the client is clipped either way
        metrics = metrics_of(reply)
        assert metrics["leakbench-norm"] == pytest.approx(audited, rel=1e-5)  # the order decides what is audited
        # a one-step update clipped is the same update rescaled; fc-inversion (x = ∂L/∂W_i / ∂L/∂b_i) is blind to
        # the scale, so clipping alone leaves the digit exactly recoverable: it bounds sensitivity, it hides nothing
        assert metrics["leakbench-rmse"] < 1e-5
    # the outer audit scored exactly the sent (clipped) update
    assert metrics_of(run_client([audit(), fixedclipping_mod], config))["leakbench-rmse"] == pytest.approx(
        direct_rmse(update_of(run_client([fixedclipping_mod], config))), rel=1e-6, abs=1e-12)


def localdp():
    # σ = sensitivity · √(2 ln(1.25/δ)) / ε ≈ 0.01 on every parameter
    return LocalDpMod(clipping_norm=1.0, sensitivity=0.01 * 2.0 / math.sqrt(2 * math.log(1.25 / 1e-5)),
                      epsilon=2.0, delta=1e-5)


def test_localdp_inside_the_audit_audits_the_noised_update():
    np.random.seed(0)  # LocalDpMod draws its noise from numpy's global generator
    outer = run_client([audit(), localdp()], {"lr": LR})
    np.random.seed(0)
    inner = run_client([localdp(), audit()], {"lr": LR})
    assert not outer.has_error() and not inner.has_error()
    sent = update_of(outer)
    assert all(np.array_equal(a, b) for a, b in zip(sent, update_of(inner)))  # same seed, same noised update
    raw = raw_update()
    size = sum(r.size for r in raw)  # 2 410 parameters: noise of σ ≈ 0.01 on each has norm ≈ 0.01 · √2410 ≈ 0.49
    assert norm([s - r for s, r in zip(sent, raw)]) == pytest.approx(0.01 * math.sqrt(size), rel=0.1)
    outer_m, inner_m = metrics_of(outer), metrics_of(inner)
    # audit outside LocalDpMod: the noised update that is sent, scored as a direct attack on it scores
    assert outer_m["leakbench-norm"] == pytest.approx(norm(sent), rel=1e-5)
    assert outer_m["leakbench-rmse"] == pytest.approx(direct_rmse(sent), rel=1e-6)
    assert outer_m["leakbench-psnr"] < 20.0 and outer_m["leakbench-rmse"] > 0.1
    # audit inside: the update before the noise, exactly recoverable (what leaks without LocalDpMod)
    assert inner_m["leakbench-norm"] == pytest.approx(norm(raw), rel=1e-5)
    assert inner_m["leakbench-rmse"] < 1e-5 and inner_m["leakbench-psnr"] > 100


def test_max_psnr_lets_the_local_dp_update_through_only_when_the_audit_sees_it():
    np.random.seed(0)
    assert not run_client([audit(max_psnr=30.0), localdp()], {"lr": LR}).has_error()
    np.random.seed(0)
    refused = run_client([localdp(), audit(max_psnr=30.0)], {"lr": LR})
    assert refused.has_error() and "not sent" in refused.error.reason


def test_defense_mod_acts_on_the_legacy_layout_and_the_audit_records_it():
    reply = run_client([audit(), defense_mod("clip:0.01", model_fn=model_fn)], {"lr": LR})
    assert not reply.has_error()
    metrics = metrics_of(reply)
    assert norm(update_of(reply)) == pytest.approx(0.01, rel=1e-4)
    assert metrics["leakbench-defense"] == "clip:0.01" and metrics["leakbench-norm"] == pytest.approx(0.01, rel=1e-4)
    # a Flower mod between them rebuilds the reply from FitRes: the defense record survives in fitres.metrics
    reply = run_client([audit(), fixedclipping_mod, defense_mod("noise:0.01", model_fn=model_fn)],
                       {"lr": LR, "clipping_norm": 1.0})
    assert metrics_of(reply)["leakbench-defense"] == "noise:0.01" and metrics_of(reply)["leakbench-psnr"] < 30


class InProcessGrid(Grid):
    """A Grid that delivers each message to ``client_app`` in this process, through Flower's wire format.

    One node per entry of ``partitions`` (node ids 101, 102, ...); each keeps its Context (the SecAgg+
    state lives there) across messages.  ``sent`` keeps every reply as the server received it.
    """

    def __init__(self, client_app: ClientApp, partitions: list[int]):
        self.app = client_app
        self.contexts = {101 + i: context(p, node=101 + i) for i, p in enumerate(partitions)}
        self._run = Run.create_empty(1)
        self.replies: dict[str, Message] = {}
        self.sent: list[Message] = []

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            reply = wire(self.app(wire(msg), self.contexts[msg.metadata.dst_node_id]))
            self.replies[msg.metadata.message_id] = reply
            self.sent.append(reply)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


def legacy_round(mods, *, dp_clip: float | None = None, secagg: bool = False, partitions=(0, 1, 2),
                 client_app: ClientApp | None = None):
    """One FedAvg round of a legacy ServerApp as Flower runs it (``DefaultWorkflow``) through :class:`InProcessGrid`:
    the server's aggregate, the fit metrics each client sent in the clear, and the grid (every reply as the server
    received it).

    ``dp_clip``: FedAvg wrapped in ``DifferentialPrivacyClientSideFixedClipping`` (noise multiplier 0), which sends
    the clipping norm that ``fixedclipping_mod`` reads.  ``secagg``: the fit rounds run SecAgg+ (3 shares, threshold
    2, ``max_weight=1``: each client weighs its one example by 1, so the aggregate is quantised in steps of
    2 · 8 / 2^22 ≈ 3.8e-6; the default 1 000 would scale each model by 1/1000 before quantising: 3.8e-3).
    """
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    reported: list[dict] = []

    def collect(results):
        reported.extend(dict(m) for _, m in results)
        return {}

    strategy = FedAvg(fraction_evaluate=0.0, initial_parameters=ndarrays_to_parameters(ndarrays(model_fn())),
                      on_fit_config_fn=lambda rnd: {"lr": LR}, fit_metrics_aggregation_fn=collect)
    if dp_clip is not None:
        strategy = DifferentialPrivacyClientSideFixedClipping(strategy, noise_multiplier=0.0, clipping_norm=dp_clip,
                                                              num_sampled_clients=len(partitions))
    grid = InProcessGrid(client_app or ClientApp(client_fn=client_fn, mods=mods), list(partitions))
    server = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                           config=ServerConfig(num_rounds=1), strategy=strategy)
    fit = SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2, max_weight=1.0) if secagg else None
    DefaultWorkflow(fit_workflow=fit)(grid, server)
    aggregate = parameters_to_ndarrays(compat.arrayrecord_to_parameters(server.state.array_records["parameters"],
                                                                        keep_input=True))
    return aggregate, reported, grid


def test_fixedclipping_under_flowers_dp_wrapper_reports_the_clipped_update():
    aggregate, reported, _ = legacy_round([audit(), fixedclipping_mod], dp_clip=CLIP)
    assert len(reported) == 3
    for metrics in reported:  # the clipping norm came from the server's wrapper; each audit saw a clipped update
        assert metrics["leakbench-norm"] == pytest.approx(CLIP, rel=1e-5) and metrics["leakbench-rmse"] < 1e-5
    step = [a - b for a, b in zip(aggregate, ndarrays(model_fn()))]
    assert norm(step) <= CLIP * (1 + 1e-5)  # the mean of three clipped updates (noise multiplier 0)


def plain_fedavg(partitions=(0, 1, 2)) -> list[np.ndarray]:
    """The FedAvg of the clients' plaintext models (equal weights: one example each)."""
    models = [update_of(run_client([], {"lr": LR}, p)) for p in partitions]
    return [b + sum(m[i] for m in models) / len(models) for i, b in enumerate(ndarrays(model_fn()))]


def test_secaggplus_outside_the_audit_leaves_it_nothing_to_attack():
    aggregate, reported, grid = legacy_round([audit(max_psnr=30.0), secaggplus_mod], secagg=True)
    # the protocol ran: the server unmasked the sum, FedAvg of the plaintext models up to quantisation (steps of
    # 3.8e-6), although each client's update leaks its digit exactly (fc-inversion at batch 1) and max_psnr is 30
    for got, want in zip(aggregate, plain_fedavg()):
        assert np.abs(got - want).max() < 1e-5
    assert len(reported) == 3
    for metrics in reported:  # every client's fit metrics say why there was no attack; none was refused
        assert metrics[VERDICT_KEY].startswith("secure aggregation: the server sees only")
        assert "3 clients" in metrics[VERDICT_KEY] and "leakbench-rmse" not in metrics
    # what the server received from each client: an empty FitRes and a masked vector uncorrelated with the model
    from flwr.common import bytes_to_ndarray

    masked = [r for r in grid.sent if not r.has_error()
              and "masked_params" in r.content.config_records.get("secaggplus_configs", {})]
    assert len(masked) == 3
    start = ndarrays(model_fn())
    for reply in masked:
        assert compat.recorddict_to_fitres(reply.content, keep_input=True).parameters.tensors == []
        partition = int(grid.contexts[reply.metadata.src_node_id].node_config["partition-id"])
        model = [b + d for b, d in zip(start, update_of(run_client([], {"lr": LR}, partition)))]
        plain = np.concatenate([a.ravel() for a in model])
        arrays = [bytes_to_ndarray(b) for b in reply.content.config_records["secaggplus_configs"]["masked_params"]]
        vector = np.concatenate([a.ravel().astype(np.float64) for a in arrays[1:]])  # [0] is the weight factor
        assert vector.size == plain.size
        # uniform mod 2^32 whatever the model (the masks come from os.urandom, unseedable): over 2 410 values the
        # correlation with the plaintext model has standard deviation 1/√2410 ≈ 0.02; 0.1 is 4.9 of them (p ≈ 1e-6)
        assert abs(np.corrcoef(vector, plain)[0, 1]) < 0.1
        assert vector.min() >= 0 and vector.max() < 2 ** 32 and vector.std() > 2 ** 32 / 4


def test_secaggplus_around_the_audit_audits_the_plaintext_update():
    aggregate, reported, _ = legacy_round([secaggplus_mod, audit()], secagg=True)
    for got, want in zip(aggregate, plain_fedavg()):
        assert np.abs(got - want).max() < 1e-5
    assert len(reported) == 3
    for metrics in reported:  # each client's own digit, exactly: what leaks if the aggregation is circumvented
        assert metrics["leakbench-rmse"] < 1e-5 and VERDICT_KEY not in metrics


def test_defense_mod_outside_secaggplus_refuses():
    # a defense cannot act on masked vectors: every client refuses, and the round aggregates nothing
    _, reported, grid = legacy_round([defense_mod("clip:1"), secaggplus_mod], secagg=True)
    refused = [r for r in grid.sent if r.has_error()]
    assert len(refused) == 3 and all("inside secaggplus_mod" in r.error.reason for r in refused)
    assert reported == []


def test_a_client_sending_arrays_that_do_not_fit_model_fn_gets_one_line():
    class Partial(DigitClient):
        def fit(self, parameters, config):
            arrays, n, metrics = super().fit(parameters, config)
            return arrays[:2], n, metrics

    # the audit cannot run: the update goes out (an audit never drops it by itself), the reason in one line
    app = ClientApp(client_fn=lambda ctx: Partial(0).to_client(), mods=[audit()])
    reply = wire(app(fit_message({"lr": LR}), context()))
    assert not reply.has_error()
    note = metrics_of(reply)[AUDIT_NOTE_KEY]
    assert "audit skipped" in note and "holds 2 arrays by position" in note and "\n" not in note
    # with the max_psnr gate it cannot decide: blocked by default, with the reason
    app = ClientApp(client_fn=lambda ctx: Partial(0).to_client(), mods=[audit(max_psnr=30.0)])
    reply = app(fit_message({"lr": LR}), context())
    assert reply.has_error() and "cannot decide" in reply.error.reason and "holds 2 arrays" in reply.error.reason


def test_the_legacy_secagg_app_of_the_docs_runs(capsys):
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[3] / "docs" / "flower.md"
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S) if "SecAggPlusWorkflow(" in b]
    assert len(blocks) == 1, "docs/flower.md has no legacy SecAgg+ app"
    app: dict = {"__name__": "docs_flower_secagg"}  # not __main__: the apps, without Flower's Ray simulation
    exec(compile(blocks[0], str(doc), "exec"), app)
    grid = InProcessGrid(app["client_app"], [0, 1, 2])
    app["server_app"](grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("client update:")]
    assert len(lines) == 3
    for line in lines:  # each client's digit rebuilt exactly from its plaintext update
        rmse = float(re.search(r"RMSE (\S+),", line).group(1))
        assert rmse < 1e-5, line
    masked = [r for r in grid.sent if not r.has_error()
              and "masked_params" in r.content.config_records.get("secaggplus_configs", {})]
    assert len(masked) == 3  # and the server received only masked vectors


class DPSGDClient(DigitClient):
    """A legacy client that trains with leakbench's local_train and the in-step defense the config asks for."""

    def fit(self, parameters, config):
        from leakbench.integrations.flower import in_step_defense, local_train

        model = model_fn()
        model.load_state_dict({k: torch.from_numpy(np.array(a)) for k, a in zip(model.state_dict(), parameters)})
        x, y = batch_of(self.partition)
        result = local_train(model, x, y, lr=float(config["lr"]), steps=1, defense=in_step_defense(config))
        return ndarrays(model), len(x), result.metrics()


def test_dpsgd_through_defense_mod_on_a_legacy_client():
    from leakbench.defenses import epsilon
    from leakbench.integrations.flower import EPSILON_KEY

    app = ClientApp(client_fn=lambda ctx: DPSGDClient(0).to_client(), mods=[audit(), defense_mod("dpsgd:1,0.8")])
    ctx = context()
    eps = []
    for rnd in (1, 2):
        reply = wire(app(fit_message({"lr": LR}, server_round=rnd), ctx))
        assert not reply.has_error()
        metrics = metrics_of(reply)
        assert metrics["leakbench-defense"] == "dpsgd:1,0.8"
        eps.append(metrics[EPSILON_KEY])
    # the defense reached the legacy client through fitins.config; ε of 1 then 2 full-batch steps (Opacus's RDP)
    assert eps == [pytest.approx(epsilon(0.8, 1.0, 1)), pytest.approx(epsilon(0.8, 1.0, 2))]
    # the DP-SGD update (clipped to 1, noise σ = 0.8) no longer gives the digit away (grey: RMSE ≈ 0.4)
    assert metrics["leakbench-rmse"] > 0.1
