"""inspect_mod: the client refuses a malicious model before training, with the evidence, and trains an honest one."""
from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402

import leakbench as lb  # noqa: E402
from leakbench.integrations.flower import inspect_mod  # noqa: E402
from leakbench.integrations.flower.check import BEFORE_KEY  # noqa: E402
from leakbench.models.active import trap_weights  # noqa: E402
from leakbench.models.malicious import imprint  # noqa: E402

pytestmark = pytest.mark.usefixtures("task_identity")  # conftest.py


def model_fn() -> torch.nn.Module:
    return lb.build("mlp:64", input_shape=(1, 8, 8), classes=10, act="relu", seed=0)


@pytest.fixture(scope="module")
def digits():
    return lb.load("digits")


def message(model: torch.nn.Module, server_round: int = 1) -> Message:
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "config": ConfigRecord({"lr": 0.1, "server-round": server_round})})
    return Message(content, dst_node_id=7, message_type=MessageType.TRAIN)


def context() -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})


def client(calls: list):
    def train(msg: Message, ctx: Context) -> Message:
        calls.append(msg)
        model = model_fn()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
    return train


def test_an_honest_model_is_trained_on_and_the_inspection_noted(digits):
    calls: list = []
    ctx = context()
    mod = inspect_mod(model_fn=model_fn, data_fn=lambda c, r: digits.batch(32, seed=r))
    reply = mod(message(model_fn()), ctx, client(calls))
    assert not reply.has_error() and len(calls) == 1
    assert reply.content["leakbench"]["inspect"].startswith("passed")
    assert BEFORE_KEY in ctx.state.array_records  # kept for next round's weight-change check


def test_trap_weights_are_refused_with_the_reason(digits, caplog):
    calls: list = []
    shipped = trap_weights(model_fn(), rate=1 / 32, calibration=digits.images[-256:], seed=0)
    mod = inspect_mod(model_fn=model_fn, data_fn=lambda c, r: digits.batch(32, seed=r))
    reply = mod(message(shipped), context(), client(calls))
    assert reply.has_error() and not calls  # the train function never ran
    assert "model refused before training" in reply.error.reason and "sign-balance at fc1.weight" in reply.error.reason
    assert any("refused" in r.getMessage() for r in caplog.records)


def test_a_later_round_compares_with_the_model_received_before(digits):
    """Round 1 honest, round 2 the first layer replaced: the weight change is evidence even without the data."""
    calls: list = []
    ctx = context()
    mod = inspect_mod(model_fn=model_fn)
    assert not mod(message(model_fn(), 1), ctx, client(calls)).has_error()
    shipped = trap_weights(model_fn(), rate=1 / 32, calibration=digits.images[-256:], seed=0)
    reply = mod(message(shipped, 2), ctx, client(calls))
    assert reply.has_error() and "weight-change at fc1.weight" in reply.error.reason and len(calls) == 1


def test_a_block_that_changes_the_architecture_is_refused(digits):
    shipped = imprint(model_fn(), bins=16, calibration=digits.images[-256:])
    calls: list = []
    reply = inspect_mod(model_fn=model_fn)(message(shipped), context(), client(calls))
    assert reply.has_error() and "architecture" in reply.error.reason and not calls


def test_refuse_false_trains_and_notes_the_finding(digits):
    shipped = trap_weights(model_fn(), rate=1 / 32, calibration=digits.images[-256:], seed=0)
    calls: list = []
    reply = inspect_mod(model_fn=model_fn, refuse=False)(message(shipped), context(), client(calls))
    assert not reply.has_error() and len(calls) == 1
    assert reply.content["leakbench"]["inspect"].startswith("SUSPICIOUS")
