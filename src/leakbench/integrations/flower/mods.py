"""Client mods: a self-audit of each update before it leaves the client, and leakbench defenses.

A Flower mod wraps the ClientApp's train function: ``mod(msg, context, call_next) -> reply``
(``flwr.clientapp.typing.Mod``).  ``ClientApp(mods=[audit_mod(...), defense_mod(...)])`` runs them
outermost first, so the audit sees the defended update, as the server would.

- :func:`audit_mod`: attacks the outgoing update with the client's own batch as ground truth and adds
  the best RMSE/PSNR over the named attacks and the seconds spent to the reply metrics
  (``leakbench-rmse``, ``leakbench-psnr``, ``leakbench-seconds``); with ``max_psnr`` an update whose best
  PSNR exceeds it is not sent (an error reply instead, with one log line saying why).  A self-audit that
  needs no trust in the server.
- :func:`defense_mod`: a leakbench defense spec.  Defenses of the update (``prune``, ``clip``,
  ``noise``, ``graddrop``, ``quantize``; Liu et al. 2024 Sec. 3) are applied to θ_after − θ_before by the
  mod; in-step defenses (``dpsgd``, ``dropout``) are asked of the train function through the train
  config (it runs :func:`~.train.local_train`), and the mod refuses to send an update whose metrics do
  not say they ran.  DP-SGD's ε over all the client's steps so far comes from Opacus's accountant
  (``leakbench-epsilon``).  The spec is written into the reply's ``leakbench`` ConfigRecord so the
  server's audit records it.
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Error, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from torch import nn

from ...errors import ConfigError
from .audit import Auditor, best
from .keys import FitKeys, local_training
from .records import arrays_of, config_of, leakbench_record, metrics_of, model_from, one, set_leakbench_record, state_of
from .train import RATE_KEY, STEPS_KEY

log = logging.getLogger("flwr.leakbench")

#: reply-metric keys of :func:`audit_mod`.
AUDIT_KEYS = ("leakbench-rmse", "leakbench-psnr", "leakbench-seconds")
EPSILON_KEY = "leakbench-epsilon"

DataFn = Callable[[Context, int], tuple[torch.Tensor, torch.Tensor]]


def _is_train(msg: Message) -> bool:
    return msg.metadata.message_type.split(".")[0] == MessageType.TRAIN


def _refuse(msg: Message, reason: str) -> Message:
    log.error(reason)
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def _server_round(config: dict[str, Any]) -> int:
    value = config.get("server-round", 0)
    return int(value) if isinstance(value, (int, float)) else 0


def audit_mod(*, model_fn: Callable[[], nn.Module], data_fn: DataFn, attacks: Any, keys: FitKeys = FitKeys(),
              max_psnr: float | None = None, seed: int = 0, device: str = "cpu", loss: str = "ce",
              normalize: tuple | None = None, input_shape: Any = None) -> Mod:
    """A mod that attacks each outgoing update with the client's own batch ``data_fn(context, round)``.

    ``model_fn`` builds the model the ServerApp trains; ``attacks`` as in the CLI and sweep specs.
    ``max_psnr`` (dB): an update whose best reconstruction PSNR exceeds it is refused.
    """
    if max_psnr is not None and not (isinstance(max_psnr, (int, float)) and math.isfinite(max_psnr)):
        raise ConfigError(f"expected max_psnr as a finite number of dB or None, got {max_psnr!r} (argument max_psnr)")
    auditor = Auditor(attacks, seed=seed, device=device, loss=loss, normalize=normalize, input_shape=input_shape,
                      save_images=False)

    def leakbench_audit_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg):
            return call_next(msg, context)
        _, arrays = arrays_of(msg)
        before_state = state_of(arrays)
        config = config_of(msg)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        start = time.perf_counter()
        _, out = arrays_of(reply)
        _, metrics = metrics_of(reply)
        training = local_training(config, dict(metrics), keys)
        server_round = _server_round(config)
        x, y = data_fn(context, server_round)
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        defense = str(leakbench_record(reply, keys.record).get("defense", "none"))
        outcomes = auditor.audit(model_from(model_fn, before_state), model_from(model_fn, state_of(out)), training,
                                 x=x, y=y, defense=defense, verify=False)  # its own batch: nothing to verify
        scores = best(outcomes)
        seconds = time.perf_counter() - start
        metrics[AUDIT_KEYS[0]], metrics[AUDIT_KEYS[1]], metrics[AUDIT_KEYS[2]] = \
            float(scores["rmse"]), float(scores["psnr"]), float(seconds)
        leaking = [o for o in outcomes if o.status == "done" and o.metrics.get("psnr", -math.inf) > (
            max_psnr if max_psnr is not None else math.inf)]
        if leaking:
            worst = max(leaking, key=lambda o: o.metrics["psnr"])
            return _refuse(msg, f"leakbench audit_mod: update of node {context.node_id} in round {server_round} "
                                f"not sent: {worst.attack} rebuilds its batch at PSNR {worst.metrics['psnr']:.1f} dB "
                                f"> max_psnr {max_psnr:g} dB (RMSE {worst.metrics['rmse']:.2g}, chance "
                                f"{worst.metrics['chance_rmse']:.2g}); add a defense (defense_mod) or raise max_psnr")
        log.info("leakbench audit_mod: round %d node %d: best PSNR %.1f dB, RMSE %.2g (%.1fs)", server_round,
                 context.node_id, scores["psnr"], scores["rmse"], seconds)
        return reply

    return leakbench_audit_mod


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:6], "big")


def _epsilon(history: list[tuple[float, int]], sigma: float, delta: float, accountant: str) -> float:
    """ε(δ) of DP-SGD steps run at the sample rates of ``history`` [(q, steps), ...] (Opacus's accountant)."""
    from ...defenses.accounting import epsilon

    rates = {q for q, _ in history}
    total = sum(s for _, s in history)
    if len(rates) == 1:
        return epsilon(sigma, rates.pop(), total, delta=delta, accountant=accountant)
    if sigma == 0:
        return math.inf
    from opacus.accountants import create_accountant

    acc = create_accountant(accountant)
    acc.history = [(float(sigma), float(q), int(s)) for q, s in history]
    return float(acc.get_epsilon(delta=float(delta)))


def defense_mod(spec: str, *, keys: FitKeys = FitKeys(), seed: int = 0,
                model_fn: Callable[[], nn.Module] | None = None) -> Mod:
    """A mod applying the leakbench defense ``spec`` to every outgoing update (see the module docstring).

    Update defenses act on the trainable parameters of ``model_fn()`` when given, otherwise on every
    floating-point array; their random draws are seeded by (``seed``, round, node).
    """
    from ...defenses import DPSGD, Composition, parse, parts_of

    parts = parts_of(parse(spec))
    elsewhere = [p.spec for p in parts if p.stage in ("round", "aggregate")]
    if elsewhere:
        raise ConfigError(f"defense_mod takes defenses of the update and in-step defenses; {elsewhere} are not: "
                          "local steps are the client's own training (local-steps/lr in the train config) and "
                          "secure aggregation is a protocol between server and clients (argument spec)")
    shared = [p for p in parts if p.stage == "shared" and p.spec != "none"]
    in_step = "+".join(p.spec for p in parts if p.stage in ("step", "model"))
    dp = next((p for p in parts if isinstance(p, DPSGD)), None)
    full = parse(spec).spec
    update_defense = shared[0] if len(shared) == 1 else Composition(tuple(shared)) if shared else None
    names = None if model_fn is None else [n for n, p in model_fn().named_parameters() if p.requires_grad]

    def leakbench_defense_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg):
            return call_next(msg, context)
        _, arrays = arrays_of(msg)
        before = state_of(arrays)
        config = config_of(msg)
        if in_step:
            _, record = one(msg.content.config_records, "ConfigRecord")
            record[keys.defense] = in_step
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        array_name, out = arrays_of(reply)
        _, metrics = metrics_of(reply)
        if in_step and STEPS_KEY not in metrics:
            return _refuse(msg, f"leakbench defense_mod: {in_step!r} acts inside each training step, but the train "
                                "function did not report running it: train with leakbench.integrations.flower."
                                "local_train(..., defense=in_step_defense(config)) and add its .metrics() to the "
                                "reply's MetricRecord; the update was not sent")
        after = state_of(out)
        if update_defense is not None:
            defended = names or [k for k, t in after.items() if t.is_floating_point()]
            missing = [k for k in defended if k not in before or k not in after]
            if missing:
                return _refuse(msg, f"leakbench defense_mod: the reply's arrays lack {missing[:3]} of the global "
                                    "model; the update was not sent")
            gen = torch.Generator().manual_seed(_seed(seed, _server_round(config), context.node_id))
            delta = update_defense.apply_gradients([after[k] - before[k] for k in defended], generator=gen)
            for k, d in zip(defended, delta):
                after[k] = (before[k] + d).to(after[k].dtype)
            reply.content.array_records[array_name] = ArrayRecord({k: after[k] for k in out.keys()})
        if dp is not None:
            state = context.state.metric_records.get("leakbench-dp") if "leakbench-dp" in \
                context.state.metric_records else MetricRecord({"rates": [], "steps": []})
            rates = list(state.get("rates", [])) + [float(metrics[RATE_KEY])]
            steps = list(state.get("steps", [])) + [int(metrics[STEPS_KEY])]
            context.state.metric_records["leakbench-dp"] = MetricRecord({"rates": rates, "steps": steps})
            metrics[EPSILON_KEY] = _epsilon(list(zip(rates, steps)), dp.sigma, dp.delta, dp.accountant)
        set_leakbench_record(reply, keys.record, {"defense": full})
        return reply

    return leakbench_defense_mod


__all__ = ["audit_mod", "defense_mod", "AUDIT_KEYS", "EPSILON_KEY"]
