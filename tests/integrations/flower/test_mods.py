"""The client mods called as Flower calls them (``mod(msg, context, call_next)``), in this process.

Messages are built as a ServerApp builds them; outside a Flower runtime that needs the process's task
identity, which the fixture sets (a Flower internal, used by these tests only).
"""
from __future__ import annotations

import math

import pytest

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402

import leakbench as lb  # noqa: E402
from leakbench.defenses import epsilon, parse  # noqa: E402
from leakbench.errors import ConfigError  # noqa: E402
from leakbench.integrations.flower import (AUDIT_KEYS, EPSILON_KEY, audit_mod, defense_mod, in_step_defense,  # noqa: E402
                                           local_train)

LR = 0.1


pytestmark = pytest.mark.usefixtures("task_identity")  # conftest.py


def model_fn() -> torch.nn.Module:
    return lb.build("mlp:32", input_shape=(1, 8, 8), classes=10, act="relu", seed=0)



def train_message(server_round: int = 1) -> Message:
    content = RecordDict({"arrays": ArrayRecord(model_fn().state_dict()),
                          "config": ConfigRecord({"lr": LR, "server-round": server_round})})
    return Message(content, dst_node_id=7, message_type=MessageType.TRAIN)


def context() -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})


def sgd_client(batch, *, use_local_train: bool = False):
    """A train function: one SGD step on the batch (or leakbench's local_train with the asked defense)."""
    x, y = batch

    def train(msg: Message, ctx: Context) -> Message:
        model = model_fn()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        metrics = {"num-examples": 1}
        if use_local_train:
            result = local_train(model, x, y, lr=LR, steps=1, defense=in_step_defense(msg.content["config"]))
            metrics.update(result.metrics())
        else:
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)}),
                       reply_to=msg)

    return train


def delta_of(msg: Message, reply: Message) -> dict[str, torch.Tensor]:
    before = msg.content["arrays"].to_torch_state_dict()
    after = reply.content["arrays"].to_torch_state_dict()
    return {k: after[k] - before[k] for k in before}


def test_audit_mod_adds_the_direct_attacks_score(batch):
    mod = audit_mod(model_fn=model_fn, data_fn=lambda ctx, rnd: batch, attacks=["fc-inversion"])
    msg = train_message()
    reply = mod(msg, context(), sgd_client(batch))
    assert not reply.has_error()
    metrics = reply.content["metrics"]
    assert set(AUDIT_KEYS) <= set(metrics)
    before, after = model_fn(), model_fn()
    before.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    after.load_state_dict(reply.content["arrays"].to_torch_state_dict())
    direct = lb.compare(lb.attack("fc-inversion", lb.Observation.from_update(before, after, batch_size=1, lr=LR)),
                        *batch)
    assert metrics["leakbench-rmse"] == pytest.approx(direct["rmse"], rel=1e-9, abs=1e-12)
    assert metrics["leakbench-psnr"] == pytest.approx(direct["psnr"], rel=1e-9)
    assert metrics["leakbench-rmse"] < 1e-5  # batch 1, one step: exact (the grey control's RMSE is ≈ 0.4)


def test_max_psnr_blocks_a_leaking_update_and_lets_a_defended_one_through(batch, caplog):
    audit = audit_mod(model_fn=model_fn, data_fn=lambda ctx, rnd: batch, attacks=["fc-inversion"], max_psnr=30.0)
    reply = audit(train_message(), context(), sgd_client(batch))
    assert reply.has_error()
    assert "not sent" in reply.error.reason and "max_psnr 30" in reply.error.reason
    assert any("not sent" in r.getMessage() for r in caplog.records)
    # the same update with noise σ = 0.01 on it (defense_mod inside the audit): fc-inversion's PSNR drops under 30 dB
    noise = defense_mod("noise:0.01")

    def defended(msg, ctx):
        return noise(msg, ctx, sgd_client(batch))

    reply = audit(train_message(), context(), defended)
    assert not reply.has_error()
    assert reply.content["metrics"]["leakbench-psnr"] < 30.0
    assert reply.content["leakbench"]["defense"] == "noise:0.01"


@pytest.mark.parametrize("spec", ["prune:0.9", "clip:0.01"])
def test_defense_mod_defends_the_update_as_leakbench_does(batch, spec):
    msg = train_message()
    raw = sgd_client(batch)(msg, context())
    reply = defense_mod(spec)(train_message(), context(), sgd_client(batch))
    sent, plain = delta_of(msg, reply), delta_of(msg, raw)
    names = list(plain)
    expected = parse(spec)([plain[n] for n in names])
    for name, want in zip(names, expected):
        assert torch.allclose(sent[name], want, atol=1e-7), name
    if spec.startswith("prune"):
        kept = sum(int((sent[n] != 0).sum()) for n in names)
        assert kept <= math.ceil(0.1 * sum(sent[n].numel() for n in names)) + 1
    else:
        norm = torch.sqrt(sum(sent[n].pow(2).sum() for n in names))
        assert float(norm) == pytest.approx(0.01, rel=1e-4)  # the raw update's norm is far above 0.01
    assert reply.content["leakbench"]["defense"] == spec


def test_dpsgd_needs_local_train_and_accounts_epsilon_over_rounds(batch):
    mod = defense_mod("dpsgd:1,0.8")
    refused = mod(train_message(), context(), sgd_client(batch))
    assert refused.has_error() and "local_train" in refused.error.reason
    ctx = context()
    eps = []
    for rnd in (1, 2):
        reply = mod(train_message(rnd), ctx, sgd_client(batch, use_local_train=True))
        assert not reply.has_error()
        eps.append(reply.content["metrics"][EPSILON_KEY])
    # one full-batch step per round (q = 1): ε of 1 then 2 steps from Opacus's RDP accountant
    assert eps == [pytest.approx(epsilon(0.8, 1.0, 1)), pytest.approx(epsilon(0.8, 1.0, 2))]
    assert eps[1] > eps[0]


def test_defense_mod_refuses_round_and_protocol_defenses():
    for spec in ("local:2,0.1", "secagg:4"):
        with pytest.raises(ConfigError, match="defense_mod"):
            defense_mod(spec)
    with pytest.raises(ConfigError, match="unknown defense|known"):
        defense_mod("prnue:0.9")


def test_unknown_attack_names_the_known_ones():
    with pytest.raises(ConfigError, match="fc-inversion"):
        audit_mod(model_fn=model_fn, data_fn=lambda ctx, rnd: None, attacks=["fc-inverse"])


def test_evaluate_messages_pass_through(batch):
    mod = audit_mod(model_fn=model_fn, data_fn=lambda ctx, rnd: batch, attacks=["fc-inversion"], max_psnr=1.0)
    msg = Message(RecordDict({"arrays": ArrayRecord(model_fn().state_dict()), "config": ConfigRecord({})}),
                  dst_node_id=7, message_type=MessageType.EVALUATE)

    def evaluate(m, ctx):
        return Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.5, "num-examples": 1})}), reply_to=m)

    reply = mod(msg, context(), evaluate)
    assert not reply.has_error() and dict(reply.content["metrics"]) == {"accuracy": 0.5, "num-examples": 1}
