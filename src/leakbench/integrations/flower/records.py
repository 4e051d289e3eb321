"""Flower records ↔ torch: the model, config and metrics of a train message, in either of Flower's layouts.

- **Message API** (``ClientApp`` with ``@app.train()``, ``flwr.serverapp.strategy``): the server sends one
  ``ArrayRecord`` (the global model, a torch state dict by name) and one ``ConfigRecord`` and expects one
  ``ArrayRecord`` and one ``MetricRecord`` back (``validate_message_reply_consistency`` in
  ``flwr.serverapp.strategy``).
- **Legacy** (a ``ClientApp(client_fn=...)`` whose ``NumPyClient``/``Client`` has ``fit``, served by
  ``flwr.server.strategy`` strategies through ``DefaultWorkflow`` or ``SecAggPlusWorkflow``): the message holds
  ``FitIns`` as ``fitins.parameters`` (arrays by position, numpy bytes) and ``fitins.config``, the reply
  ``FitRes`` as ``fitres.parameters``, ``fitres.metrics`` (a ConfigRecord), ``fitres.num_examples`` and
  ``fitres.status``.  Flower's own ``fixedclipping_mod``, ``LocalDpMod`` and ``secaggplus_mod`` read and
  write this layout.  It is read and written here with Flower's converters
  (``flwr.compat.common.recorddict_compat``, ``parameters_to_ndarrays``); position *i* is the *i*-th entry
  of the model's ``state_dict()`` (the NumPyClient convention), or of its ``named_parameters()`` when the
  client sends only those.

:func:`train_inputs` and :func:`train_reply` return a :class:`TrainReply` either way, so the mods read and
write one structure.  A SecAgg+ key-exchange message (``secaggplus_configs`` and no model) has no layout.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key
from flwr.compat.common import recorddict_compat as compat
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


#: record names of the legacy FitIns / FitRes layout (``flwr.compat.common.recorddict_compat``).
FITINS_PARAMETERS, FITINS_CONFIG = "fitins.parameters", "fitins.config"
FITRES_PARAMETERS, FITRES_METRICS, FITRES_EXAMPLES = "fitres.parameters", "fitres.metrics", "fitres.num_examples"
#: the SecAgg+ protocol's record (``flwr.common.secure_aggregation.secaggplus_constants``).
SECAGG_CONFIGS, SECAGG_STATE = RECORD_KEY_CONFIGS, RECORD_KEY_STATE


def layout(msg: Message) -> str | None:
    """``"legacy"`` (FitIns/FitRes records), ``"message"`` (Message API) or None: a SecAgg+ key-exchange
    message (setup, share keys, unmask), which carries no model."""
    arrays = msg.content.array_records
    if FITINS_PARAMETERS in arrays or FITRES_PARAMETERS in arrays:
        return "legacy"
    if SECAGG_CONFIGS in msg.content.config_records:
        return None
    return "message"


def masked(reply: Message) -> bool:
    """Whether the reply carries the update only as SecAgg+ masked vectors (``secaggplus_mod`` ran inside)."""
    record = reply.content.config_records.get(SECAGG_CONFIGS) if SECAGG_CONFIGS in reply.content.config_records \
        else None
    return record is not None and Key.MASKED_PARAMETERS in record


def positional_names(model_fn: Callable[[], nn.Module] | None) -> Callable[[int], list[str]]:
    """Names of a legacy message's arrays by position: ``model_fn()``'s ``state_dict()`` keys, or its
    ``named_parameters()`` when the count fits those, else ``"0", "1", ...`` without a model; a ConfigError
    when the count fits neither."""
    cache: dict[str, list[str]] = {}

    def names(n: int) -> list[str]:
        if model_fn is None:
            return [str(i) for i in range(n)]
        if not cache:
            model = model_fn()
            if not isinstance(model, nn.Module):
                raise ConfigError(f"expected model_fn to return a torch.nn.Module, got {type(model).__name__} "
                                  "(argument model_fn)")
            cache["state"] = list(model.state_dict())
            cache["params"] = [k for k, _ in model.named_parameters()]
        for kind in ("state", "params"):
            if len(cache[kind]) == n:
                return cache[kind]
        raise ConfigError(f"the legacy message holds {n} arrays by position, model_fn()'s model has "
                          f"{len(cache['state'])} state_dict entries and {len(cache['params'])} parameters: send "
                          "[v.cpu().numpy() for v in model.state_dict().values()] from the NumPyClient (Flower's "
                          "convention) and build that model in model_fn (argument model_fn)")

    return names


@dataclass
class TrainReply:
    """The model (a torch state dict by name) and the live metrics record of a train message or reply.

    ``metrics`` is the record itself (the reply's MetricRecord, or the legacy ``fitres.metrics`` ConfigRecord):
    writing to it writes the reply.  ``examples`` is the legacy ``FitRes.num_examples`` (None otherwise).
    """

    layout: str
    state: dict[str, torch.Tensor]
    config: dict[str, Any]
    metrics: Any
    examples: int | None = None
    array_name: str | None = None
    names: Sequence[str] = ()

    def reported(self, key: str) -> dict[str, Any]:
        """The metrics as the client reports them; a legacy ``num_examples`` under ``key`` unless given."""
        out = dict(self.metrics) if self.metrics is not None else {}
        if self.examples is not None and key not in out:
            out[key] = self.examples
        return out


def _named(arrays: list[np.ndarray], names: Callable[[int], list[str]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    keys = names(len(arrays))
    return {k: torch.from_numpy(np.array(a, copy=True)) for k, a in zip(keys, arrays)}, list(keys)


def train_inputs(msg: Message, names: Callable[[int], list[str]]) -> TrainReply:
    """The global model and the train config of a train message (either layout; see the module docstring)."""
    if layout(msg) == "legacy":
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        state, keys = _named(parameters_to_ndarrays(fitins.parameters), names)
        return TrainReply("legacy", state, dict(fitins.config), None, names=keys)
    name, arrays = arrays_of(msg)
    return TrainReply("message", state_of(arrays), config_of(msg), None, array_name=name)


def train_config_record(msg: Message) -> ConfigRecord:
    """The train message's config record itself (to ask the train function for something)."""
    if layout(msg) == "legacy":
        return msg.content.config_records[FITINS_CONFIG]
    return one(msg.content.config_records, "ConfigRecord")[1]


def train_reply(reply: Message, names: Callable[[int], list[str]]) -> TrainReply:
    """The client's model and metrics in a train reply (either layout)."""
    if FITRES_PARAMETERS in reply.content.array_records:
        fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
        state, keys = _named(parameters_to_ndarrays(fitres.parameters), names)
        return TrainReply("legacy", state, {}, reply.content.config_records[FITRES_METRICS],
                          examples=int(fitres.num_examples), names=keys)
    name, arrays = arrays_of(reply)
    _, metrics = metrics_of(reply)
    return TrainReply("message", state_of(arrays), {}, metrics, array_name=name, names=list(arrays.keys()))


def set_reply_state(reply: Message, out: TrainReply, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` as the reply's model, in the reply's layout (legacy: Flower's converters, by position)."""
    if out.layout == "legacy":
        ndarrays = [state[k].detach().cpu().numpy() for k in out.names]
        reply.content.array_records[FITRES_PARAMETERS] = compat.parameters_to_arrayrecord(
            ndarrays_to_parameters(ndarrays), keep_input=True)
    else:
        reply.content.array_records[out.array_name] = ArrayRecord({k: state[k] for k in out.names})


__all__ = ["state_of", "model_from", "arrays_of", "metrics_of", "config_of", "leakbench_record",
           "set_leakbench_record", "layout", "masked", "positional_names", "TrainReply",
           "train_inputs", "train_reply", "train_config_record", "set_reply_state"]
