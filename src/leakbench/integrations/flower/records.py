"""Flower records ↔ torch: the one ArrayRecord, MetricRecord and ConfigRecord of a train message.

Flower's built-in strategies send one ``ArrayRecord`` (the global model) and one ``ConfigRecord``
and expect one ``ArrayRecord`` and one ``MetricRecord`` back (``validate_message_reply_consistency``
in ``flwr.serverapp.strategy``); these helpers read them and turn arrays into torch models.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from torch import nn

from ...errors import ConfigError


def state_of(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """The arrays as a torch state dict (copies)."""
    return {k: v.detach().clone() for k, v in arrays.to_torch_state_dict().items()}


def model_from(model_fn: Callable[[], nn.Module], state: dict[str, torch.Tensor]) -> nn.Module:
    """``model_fn()`` with ``state`` loaded; a clear error when the keys or shapes disagree."""
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected model_fn to return a torch.nn.Module, got {type(model).__name__} "
                          "(argument model_fn)")
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise ConfigError(f"the client's arrays do not fit model_fn()'s model ({first}); model_fn must build the "
                          "architecture the ServerApp trains (argument model_fn)") from None
    return model


def one(records: dict, what: str) -> tuple[str, Any]:
    """The (name, record) of the only record of a kind in a message, or a ConfigError."""
    if len(records) != 1:
        raise ConfigError(f"expected exactly one {what} in the message (as Flower's built-in strategies send), "
                          f"got {len(records)}: {sorted(records)}")
    return next(iter(records.items()))


def arrays_of(msg: Message) -> tuple[str, ArrayRecord]:
    return one(msg.content.array_records, "ArrayRecord")


def metrics_of(msg: Message) -> tuple[str, MetricRecord]:
    return one(msg.content.metric_records, "MetricRecord")


def config_of(msg: Message, *, skip: str = "") -> dict[str, Any]:
    """The train config: the message's ConfigRecords merged (except the one named ``skip``)."""
    out: dict[str, Any] = {}
    for name, record in msg.content.config_records.items():
        if name != skip:
            out.update(dict(record))
    return out


def leakbench_record(msg: Message, name: str) -> dict[str, Any]:
    """The reply's leakbench ConfigRecord (the defense a client applied), empty when absent."""
    record = msg.content.config_records.get(name) if name in msg.content.config_records else None
    return dict(record) if record is not None else {}


def set_leakbench_record(msg: Message, name: str, values: dict[str, Any]) -> None:
    current = leakbench_record(msg, name)
    current.update(values)
    msg.content.config_records[name] = ConfigRecord(current)


__all__ = ["state_of", "model_from", "arrays_of", "metrics_of", "config_of", "leakbench_record",
           "set_leakbench_record"]
