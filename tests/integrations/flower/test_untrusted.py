"""Issue 48: an audit never harms the training it watches.

- ``AuditStrategy``: each client's audit has a time budget and, checked from the client's own report before
  any work, a work and memory budget; past it the row says so and the round is aggregated.
- ``audit_mod``: an audit that cannot run never drops the update by itself; the ``max_psnr`` gate that cannot
  decide (the audit did not run, an attack failed or scored NaN, none scored) follows ``on_undecided``
  (default: block, with the reason).
"""
from __future__ import annotations

import math
import time

import pytest

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

import leakbench as lb  # noqa: E402
from leakbench.errors import ConfigError  # noqa: E402
from leakbench.evaluation.store import Store  # noqa: E402
from leakbench.integrations.flower import AuditStrategy, Audited, Auditor, LocalTraining, audit_mod  # noqa: E402

LR = 0.1
SLOW_ATTACK = {"name": "inverting-gradients", "options": {"iterations": 1_000_000}}


pytestmark = pytest.mark.usefixtures("task_identity")  # conftest.py


def model_fn() -> torch.nn.Module:
    return lb.build("mlp:32", input_shape=(1, 8, 8), classes=10, act="relu", seed=0)



def train_message(config: dict | None = None) -> Message:
    config = {"lr": LR, "server-round": 1} if config is None else config
    content = RecordDict({"arrays": ArrayRecord(model_fn().state_dict()), "config": ConfigRecord(config)})
    return Message(content, dst_node_id=7, message_type=MessageType.TRAIN)


def context() -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})


def client(batch, *, metrics: dict | None = None, state_fn=None):
    """One SGD step on the batch; ``metrics`` replaces the reported ones, ``state_fn`` changes the arrays sent."""
    x, y = batch

    def train(msg: Message, ctx: Context) -> Message:
        model = model_fn()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state = model.state_dict() if state_fn is None else state_fn(model.state_dict())
        return Message(RecordDict({"arrays": ArrayRecord(state),
                                   "metrics": MetricRecord(metrics or {"num-examples": 1})}), reply_to=msg)

    return train


def raising(ctx, rnd):
    raise OSError("the partition file is gone")


NAN = {"state_fn": lambda s: {k: torch.full_like(v, math.nan) for k, v in s.items()}}
WRONG_SHAPE = {"state_fn": lambda s: {k: v[..., :1].clone() for k, v in s.items()}}
# each: (config sent, data_fn, client options, words the reason contains)
CANNOT_RUN = {
    "no lr": ({"server-round": 1}, None, {}, "learning rate"),
    "data_fn raises": (None, raising, {}, "OSError: the partition file is gone"),
    "data_fn returns None": (None, lambda ctx, rnd: None, {}, "expected data_fn"),
    "NaN arrays": (None, None, NAN, "NaN"),
    "wrong-shaped arrays": (None, None, WRONG_SHAPE, "do not fit"),
    "over the caps": (None, None, {"metrics": {"num-examples": 10**9}}, "at most"),
    "over the work budget": (None, None, {"metrics": {"num-examples": 1, "local-steps": 10_000}}, "max_work"),
}


def _mod(batch, data_fn, **options):
    return audit_mod(model_fn=model_fn, data_fn=data_fn or (lambda ctx, rnd: batch), attacks=["fc-inversion"],
                     max_work=5_000, **options)


@pytest.mark.parametrize("case", list(CANNOT_RUN))
def test_an_audit_that_cannot_run_never_drops_the_update(batch, case):
    config, data_fn, options, words = CANNOT_RUN[case]
    reply = _mod(batch, data_fn)(train_message(config), context(), client(batch, **options))
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    note = reply.content["leakbench"]["audit"]
    assert note.startswith("audit skipped") and words in note and "\n" not in note


@pytest.mark.parametrize("case", list(CANNOT_RUN))
def test_the_gate_that_cannot_decide_blocks_with_the_reason_or_sends_as_asked(batch, case):
    config, data_fn, options, words = CANNOT_RUN[case]
    reply = _mod(batch, data_fn, max_psnr=30.0)(train_message(config), context(), client(batch, **options))
    assert reply.has_error() and "cannot decide" in reply.error.reason and words in reply.error.reason
    assert "on_undecided" in reply.error.reason
    sent = _mod(batch, data_fn, max_psnr=30.0, on_undecided="send")(train_message(config), context(),
                                                                   client(batch, **options))
    assert not sent.has_error() and "undecided" in sent.content["leakbench"]["audit"]


def _outcomes(*rows):
    return lambda self, *a, **k: [Audited(name, name, status, True, metrics=metrics, error=error)
                                  for name, status, metrics, error in rows]


@pytest.mark.parametrize("rows, decided", [
    ([("a", "done", {"psnr": math.nan, "rmse": math.nan}, None)], False),                 # a NaN score
    ([("a", "failed", {}, "RuntimeError: x"), ("b", "failed", {}, "ValueError: y")], False),  # every attack failed
    ([("a", "n/a", {}, "needs a ReLU MLP")], False),                                     # none applies: no score
    ([("a", "done", {"psnr": 12.0, "rmse": 0.2}, None), ("b", "failed", {}, "OverflowError: z")], False),
    ([("a", "done", {"psnr": 12.0, "rmse": 0.2}, None), ("b", "timed out", {}, "audit budget: ran past")], False),
    ([("a", "done", {"psnr": 12.0, "rmse": 0.2}, None), ("b", "n/a", {}, "needs labels")], True),
])
def test_the_gate_decides_only_on_scores(batch, monkeypatch, rows, decided):
    monkeypatch.setattr(Auditor, "audit", _outcomes(*rows))
    reply = _mod(batch, None, max_psnr=30.0)(train_message(), context(), client(batch))
    if decided:
        assert not reply.has_error()
    else:
        assert reply.has_error() and "cannot decide" in reply.error.reason


def test_an_exact_reconstruction_is_blocked_not_failed(batch, monkeypatch):
    monkeypatch.setattr(Auditor, "audit", _outcomes(("a", "done", {"psnr": math.inf, "rmse": 0.0}, None)))
    reply = _mod(batch, None, max_psnr=30.0)(train_message(), context(), client(batch))
    assert reply.has_error() and "rebuilds its batch at PSNR inf" in reply.error.reason


def test_on_undecided_is_checked():
    with pytest.raises(ConfigError, match="on_undecided"):
        audit_mod(model_fn=model_fn, data_fn=lambda c, r: None, attacks=["fc-inversion"], on_undecided="maybe")


# ---------------------------------------------------------------------------------------------- the budget


def test_the_audit_stops_at_its_deadline(batch):
    auditor = Auditor([SLOW_ATTACK, "fc-inversion"], seconds=0.3)
    before, after = model_fn(), model_fn()
    with torch.no_grad():
        after[-1].bias += 0.01
    start = time.perf_counter()
    out = auditor.audit(before, after, LocalTraining(batch_size=1, lr=LR), x=batch[0], y=batch[1], verify=False)
    assert time.perf_counter() - start < 1.5
    assert out[0].status == "timed out" and "audit_seconds" in out[0].error
    assert out[1].status == "timed out" and "not started" in out[1].error


@pytest.mark.parametrize("training, shape, words", [
    (LocalTraining(batch_size=4096, lr=LR, steps=10_000), (1, 8, 8), "10,000 × 4,096"),    # the report
    (LocalTraining(batch_size=256, lr=LR, steps=4000), (3, 224, 224), "GiB"),               # fits max_work, not memory
])
def test_the_declared_work_and_memory_are_checked_before_any_work(training, shape, words):
    auditor = Auditor(["fc-inversion"], input_shape=shape)
    model = lb.build("mlp:4", input_shape=shape, classes=10, seed=0)
    start = time.perf_counter()
    out = auditor.audit(model, model, training)
    assert time.perf_counter() - start < 0.5
    assert out[0].status == "failed" and out[0].error.startswith("audit budget: expected") \
        and words in out[0].error


def _strategy(tmp_path, **options):
    return AuditStrategy(FedAvg(), model_fn=model_fn, attacks=["fc-inversion"], db=str(tmp_path / "a.db"),
                         save_updates=False, **options)


def _round(strategy, batch, metrics: dict):
    """One audited round of one reply, as Flower calls the strategy: (aggregated arrays, seconds)."""
    msg = train_message()
    strategy._global[1] = msg.content["arrays"].to_torch_state_dict()
    strategy._config[1] = {7: {"lr": LR}}
    reply = client(batch, metrics=metrics)(msg, context())
    start = time.perf_counter()
    arrays, _ = strategy.aggregate_train(1, [reply])
    return arrays, time.perf_counter() - start


def test_a_report_within_the_caps_does_not_stall_the_round(tmp_path, batch):
    strategy = _strategy(tmp_path)
    arrays, seconds = _round(strategy, batch, {"num-examples": 4096, "local-steps": 10_000})
    strategy.log.close()
    assert arrays is not None and seconds < 1.5
    rows = Store(tmp_path / "a.db", readonly=True).rows(kind="federated")
    assert len(rows) == 1 and rows[0]["status"] == "failed" and "audit budget" in rows[0]["error"]


def test_a_slow_attack_times_out_and_the_round_is_aggregated(tmp_path, batch):
    strategy = AuditStrategy(FedAvg(), model_fn=model_fn, attacks=[SLOW_ATTACK], db=str(tmp_path / "a.db"),
                             save_updates=False, audit_seconds=0.3)
    arrays, seconds = _round(strategy, batch, {"num-examples": 1})
    strategy.log.close()
    assert arrays is not None and seconds < 1.5
    rows = Store(tmp_path / "a.db", readonly=True).rows(kind="federated")
    assert len(rows) == 1 and rows[0]["status"] == "timed out" and "0.3 s" in rows[0]["error"]


def test_the_budget_is_checked():
    for options in ({"audit_seconds": 0}, {"audit_seconds": math.nan}, {"audit_memory": 0}, {"max_work": 1.5}):
        with pytest.raises(ConfigError, match="expected"):
            audit_mod(model_fn=model_fn, data_fn=lambda c, r: None, attacks=["fc-inversion"], **options)


# ---------------------------------------------------------------------------------------------- defense_mod


@pytest.mark.parametrize("options, words", [
    (WRONG_SHAPE, "global model's shapes"),
    ({"state_fn": lambda s: {k: v.to(torch.int64) for k, v in s.items()}}, "float arrays"),
    ({"metrics": {"num-examples": 1, "leakbench-steps": 1}}, "cannot act"),  # no sample rate reported
])
def test_defense_mod_on_a_reply_it_cannot_defend_is_one_line_and_sends_nothing(batch, options, words):
    from leakbench.integrations.flower import defense_mod

    spec = "dpsgd:1,0.5" if "metrics" in options else "prune:0.9"
    reply = defense_mod(spec)(train_message(), context(), client(batch, **options))
    assert reply.has_error() and words in reply.error.reason and "not sent" in reply.error.reason
    assert "\n" not in reply.error.reason and "Traceback" not in reply.error.reason
