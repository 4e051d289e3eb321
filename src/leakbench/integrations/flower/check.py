"""The client's check of the model it receives, before it trains on it: :func:`inspect_mod`.

``audit_mod`` asks what the client's update gives away; this mod asks the earlier question, **is the model I was
sent malicious?**  It reads the global model of each train message into ``model_fn()``'s architecture and runs
:func:`leakbench.analysis.inspect` on it against the model this client received the round before (kept in the
client's ``context.state``) and, with ``data_fn``, on the batch the client is about to train on.  When a check
fires the model is refused: the train function never runs, and the reply is an error whose reason carries the
evidence (and one log line says it).  Arrays that do not fit ``model_fn()``'s architecture — a server that added
a block — are refused as well: the client trains the architecture it agreed to, or nothing.

Place it first in ``ClientApp(mods=[inspect_mod(...), ...])`` so that no other mod (nor the audit) runs on a
refused model.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable, Mod
from torch import nn

from ...analysis.inspection import inspect
from ...errors import ConfigError
from .keys import FitKeys
from .mods import _is_train, _one_line, _refuse, _server_round
from .records import (FITRES_METRICS, FITRES_PARAMETERS, layout, model_from, positional_names, set_leakbench_record,
                      train_inputs)

log = logging.getLogger("flwr.leakbench")

#: the client's ``context.state`` ArrayRecord holding the model it received last round
BEFORE_KEY = "leakbench-inspect-before"
#: key of the inspection's one-line result in the reply's ``leakbench`` ConfigRecord
INSPECT_KEY = "inspect"

DataFn = Callable[[Context, int], tuple[torch.Tensor, torch.Tensor]]


def inspect_mod(*, model_fn: Callable[[], nn.Module], data_fn: DataFn | None = None, keys: FitKeys = FitKeys(),
                refuse: bool = True, loss: str = "ce") -> Mod:
    """A mod that inspects every received model (see the module docstring) and refuses a suspicious one.

    ``model_fn`` builds the architecture the ServerApp trains; ``data_fn(context, round)`` → ``(x, y)``, the
    client's batch (optional: without it the data checks are skipped).  ``refuse=False`` trains on a suspicious
    model anyway and only writes the finding into the reply and the log: a measurement mode.  Either way the
    reply of a model trained on carries the inspection's line (``leakbench`` ConfigRecord, key ``inspect``; legacy
    layout: the fit metric ``leakbench-inspect``).
    """
    if not callable(model_fn):
        raise ConfigError(f"expected model_fn, a callable building the model, got {type(model_fn).__name__} "
                          "(argument model_fn)")
    names = positional_names(model_fn)

    def leakbench_inspect_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg) or layout(msg) is None:  # a SecAgg+ key exchange carries no model
            return call_next(msg, context)
        node = context.node_id
        try:
            sent = train_inputs(msg, names)
        except Exception as err:  # noqa: BLE001 - nothing unread is trained on
            return _refuse(msg, f"leakbench inspect_mod: node {node}: the train message cannot be read: "
                                f"{_one_line(err)}; the model was not trained on")
        server_round = _server_round(sent.config, msg)
        try:
            received = model_from(model_fn, sent.state)
        except ConfigError as err:
            return _refuse(msg, f"leakbench inspect_mod: round {server_round} node {node}: model refused before "
                                f"training: architecture: the received arrays do not fit the agreed model "
                                f"({_one_line(err)})")
        before = None
        if BEFORE_KEY in context.state.array_records:
            try:
                before = model_from(model_fn, context.state.array_records[BEFORE_KEY].to_torch_state_dict())
            except ConfigError:
                before = None
        batch = None
        if data_fn is not None:
            try:
                batch = data_fn(context, server_round)
                x, y = torch.as_tensor(batch[0]), torch.as_tensor(batch[1])
            except Exception as err:  # noqa: BLE001 - the data checks are skipped, with the reason
                log.warning("leakbench inspect_mod: round %d node %d: data_fn failed (%s); data checks skipped",
                            server_round, node, _one_line(err))
                batch = None
        report = inspect(before, received, **({"x": x, "y": y} if batch is not None else {}), loss=loss)
        context.state.array_records[BEFORE_KEY] = ArrayRecord(received.state_dict())
        if report.suspicious:
            text = f"leakbench inspect_mod: round {server_round} node {node}: model refused before training: " \
                   f"{report.reason}"
            if refuse:
                return _refuse(msg, text)
            log.warning("%s (refuse=False: trained on it anyway)", text)
        else:
            log.info("leakbench inspect_mod: round %d node %d: %s", server_round, node, report.reason)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        try:
            if FITRES_PARAMETERS in reply.content.array_records:  # legacy: only fitres.metrics survives Flower's mods
                reply.content.config_records[FITRES_METRICS][f"leakbench-{INSPECT_KEY}"] = str(report)
            else:
                set_leakbench_record(reply, keys.record, {INSPECT_KEY: str(report)})
        except Exception as err:  # noqa: BLE001 - the note is a courtesy
            log.warning("leakbench inspect_mod: could not write the inspection into the reply: %s", _one_line(err))
        return reply

    return leakbench_inspect_mod


__all__ = ["inspect_mod", "BEFORE_KEY", "INSPECT_KEY"]
