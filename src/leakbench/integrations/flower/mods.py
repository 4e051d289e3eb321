"""Client mods: a self-audit of each update before it leaves the client, and leakbench defenses.

A Flower mod wraps the ClientApp's train function: ``mod(msg, context, call_next) -> reply``
(``flwr.clientapp.typing.Mod``).  Flower nests ``ClientApp(mods=[m1, m2])`` as ``m1(m2(app))``
(``flwr.client.mod.utils.make_ffn``): the first mod is the outermost, it sees the reply last, after every
mod after it in the list has changed it.  So **a mod placed before the audit changes the update after the
audit saw it; a mod placed after it, before**:

- ``[audit_mod(...), defense_mod(...) | fixedclipping_mod | LocalDpMod(...)]``: the audit sees the defended
  update, exactly what leaves the client (what the server receives);
- ``[fixedclipping_mod | LocalDpMod(...), audit_mod(...)]``: the audit sees the update before that defense
  (what would leak without it), and what leaves the client differs;
- ``[audit_mod(...), secaggplus_mod]``: the update leaves as a SecAgg+ masked vector; the audit attacks
  nothing and writes its verdict (``leakbench-verdict``: the server sees only the sum over the round's
  clients);
- ``[secaggplus_mod, audit_mod(...)]``: the audit sees the plaintext update the train function produced,
  what leaks if the secure aggregation is circumvented (a server that isolates one client's update).

Both mods read and write the Message API's records and the legacy ``FitIns``/``FitRes`` records of a
``NumPyClient``/``Client`` app (:mod:`.records`), the layout Flower's ``fixedclipping_mod``, ``LocalDpMod``
and ``secaggplus_mod`` use, so they compose with those on a legacy client.

- :func:`audit_mod`: attacks the outgoing update with the client's own batch as ground truth and adds
  the best RMSE/PSNR over the named attacks, the seconds spent and the norm of the audited update to the
  reply metrics (``leakbench-rmse``, ``leakbench-psnr``, ``leakbench-seconds``, ``leakbench-norm``); with
  ``max_psnr`` an update whose best PSNR exceeds it is not sent (an error reply instead, with one log line
  saying why).  A self-audit that needs no trust in the server.
- :func:`defense_mod`: a leakbench defense spec.  Defenses of the update (``prune``, ``clip``,
  ``noise``, ``graddrop``, ``quantize``; Liu et al. 2024 Sec. 3) are applied to θ_after − θ_before by the
  mod; in-step defenses (``dpsgd``, ``dropout``) are asked of the train function through the train
  config (it runs :func:`~.train.local_train`), and the mod refuses to send an update whose metrics do
  not say they ran.  DP-SGD's ε over all the client's steps so far comes from Opacus's accountant
  (``leakbench-epsilon``).  The spec is written into the reply's ``leakbench`` ConfigRecord (legacy
  layout: the fit metric ``leakbench-defense``, the one record Flower's legacy mods keep) so the audit
  records it.  Outside ``secaggplus_mod`` it refuses: a defense cannot act on masked vectors.
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Error, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from torch import nn

from ...errors import ConfigError
from .audit import AUDIT_MEMORY, AUDIT_SECONDS, MAX_WORK, Auditor, best
from .keys import FitKeys, local_training
from .records import (FITRES_METRICS, FITRES_PARAMETERS, SECAGG_STATE, TrainReply, layout, leakbench_record, masked, model_from,
                      positional_names, set_leakbench_record, set_reply_state, train_config_record, train_inputs,
                      train_reply)
from .train import RATE_KEY, STEPS_KEY

log = logging.getLogger("flwr.leakbench")

#: reply-metric keys of :func:`audit_mod`: best RMSE and PSNR, seconds, and the L2 norm of the audited update
#: (θ_after − θ_before over the trainable parameters), which says which update the audit saw.
AUDIT_KEYS = ("leakbench-rmse", "leakbench-psnr", "leakbench-seconds", "leakbench-norm")
EPSILON_KEY = "leakbench-epsilon"
#: legacy fit-metric key of :func:`audit_mod`'s verdict on an update sent as SecAgg+ masked vectors.
VERDICT_KEY = "leakbench-verdict"

DataFn = Callable[[Context, int], tuple[torch.Tensor, torch.Tensor]]


def _is_train(msg: Message) -> bool:
    return msg.metadata.message_type.split(".")[0] == MessageType.TRAIN


def _refuse(msg: Message, reason: str) -> Message:
    log.error(reason)
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def _server_round(config: dict[str, Any], msg: Message | None = None) -> int:
    """The round: the train config's ``server-round`` (Message API), else the message's group id, which
    Flower's workflows set to the round (``DefaultWorkflow``, ``SecAggPlusWorkflow``), else 0."""
    value = config.get("server-round")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return int(value)
    group = msg.metadata.group_id if msg is not None else ""
    return int(group) if group.isdigit() else 0


def _update_norm(before: nn.Module, after: nn.Module) -> float:
    """‖θ_after − θ_before‖₂ over the trainable parameters."""
    pairs = zip(before.named_parameters(), after.named_parameters())
    return math.sqrt(sum(float((a.detach().double() - b.detach().double()).pow(2).sum())
                         for (_, b), (_, a) in pairs if b.requires_grad))


def _defense_of(reply: Message, out: TrainReply, keys: FitKeys) -> str:
    """The leakbench defense a ``defense_mod`` inside reported (its record, or the legacy fit metric)."""
    if out.layout == "legacy":
        return str(out.metrics.get(keys.defense, "none"))
    return str(leakbench_record(reply, keys.record).get("defense", "none"))


def _secagg_verdict(reply: Message, context: Context, server_round: int) -> Message:
    """The audit of an update that leaves as SecAgg+ masked vectors: no attack, the verdict in the fit metrics."""
    state = dict(context.state.config_records[SECAGG_STATE]) if SECAGG_STATE in context.state.config_records else {}
    clients, threshold = state.get("sample_num"), state.get("threshold")
    verdict = (f"secure aggregation: the server sees only this update's SecAgg+ masked vector (uniform mod "
               f"{state.get('mod_range', '2^32')}); only the sum over the round's {clients} clients (threshold "
               f"{threshold}) can be unmasked, so no single update is attacked — place audit_mod inside "
               "secaggplus_mod to audit the plaintext update")
    if FITRES_METRICS not in reply.content.config_records:
        reply.content.config_records[FITRES_METRICS] = ConfigRecord({})
    reply.content.config_records[FITRES_METRICS][VERDICT_KEY] = verdict
    log.info("leakbench audit_mod: round %d node %d: %s", server_round, context.node_id, verdict)
    return reply


#: what :func:`audit_mod` does with an update its ``max_psnr`` gate cannot decide on (argument ``on_undecided``).
UNDECIDED = ("block", "send")
#: key of :func:`audit_mod`'s one-line account of an audit that could not run or a gate that could not decide:
#: in the reply's ``leakbench`` ConfigRecord (legacy layout: the fit metric of that name).
AUDIT_NOTE_KEY = "leakbench-audit"


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())[:400] or type(err).__name__
    return text if isinstance(err, ConfigError) else f"{type(err).__name__}: {text}"


def _note(reply: Message, out: TrainReply | None, keys: FitKeys, note: str) -> None:
    """Write ``note`` into the reply (its leakbench ConfigRecord; legacy: the ``fitres.metrics`` ConfigRecord)."""
    try:
        if out is not None and out.layout == "legacy":
            out.metrics[AUDIT_NOTE_KEY] = note
        elif FITRES_PARAMETERS in reply.content.array_records:
            reply.content.config_records[FITRES_METRICS][AUDIT_NOTE_KEY] = note
        else:
            set_leakbench_record(reply, keys.record, {"audit": note})
    except Exception as err:  # noqa: BLE001 - the note is a courtesy; the update's fate does not depend on it
        log.warning("leakbench audit_mod: could not write the audit note into the reply: %s", _one_line(err))


def _undecided(outcomes, max_psnr: float) -> str | None:
    """Why the ``max_psnr`` gate cannot decide on these outcomes (None when it can).

    It decides when every attack either ran and gave a PSNR that is a number (+inf: an exact
    reconstruction, which it blocks) or does not apply to the update (``n/a``), and at least one gave one.
    An attack that failed, timed out or scored NaN might have rebuilt the batch: the gate cannot say it did not.
    """
    unsure = []
    scored = 0
    for o in outcomes:
        psnr = o.metrics.get("psnr") if o.status == "done" else None
        if o.status == "done" and isinstance(psnr, (int, float)) and not math.isnan(psnr):
            scored += 1
        elif o.status != "n/a":
            why = o.error or (f"PSNR {psnr!r}" if o.status == "done" else o.status)
            unsure.append(f"{o.attack} {o.status}: {' '.join(str(why).split())[:200]}")
    if unsure:
        return "; ".join(unsure)
    if not scored:
        reasons = "; ".join(f"{o.attack}: {' '.join(str(o.error).split())[:200]}" for o in outcomes if o.error)
        return f"no attack scored the update against max_psnr {max_psnr:g} dB" + (f" ({reasons})" if reasons else "")
    return None


def audit_mod(*, model_fn: Callable[[], nn.Module], data_fn: DataFn, attacks: Any, keys: FitKeys = FitKeys(),
              max_psnr: float | None = None, on_undecided: str = "block", seed: int = 0, device: str = "cpu",
              loss: str = "ce", normalize: tuple | None = None, input_shape: Any = None,
              audit_seconds: float | None = AUDIT_SECONDS, audit_memory: int = AUDIT_MEMORY,
              max_work: int = MAX_WORK) -> Mod:
    """A mod that attacks each outgoing update with the client's own batch ``data_fn(context, round)``.

    ``model_fn`` builds the model the ServerApp trains (in a legacy app its ``state_dict()`` order names the
    arrays); ``attacks`` as in the CLI and sweep specs.  ``max_psnr`` (dB): an update whose best
    reconstruction PSNR exceeds it is refused.  Where it sits among the mods decides which update it attacks
    (module docstring); an update that leaves as SecAgg+ masked vectors is not attacked, its fit metrics get
    the verdict under :data:`VERDICT_KEY`.

    An audit that cannot run (no learning rate in the config, ``data_fn`` raising, arrays that do not fit the
    model, counts over the caps, past its budget ``audit_seconds`` / ``audit_memory`` / ``max_work``) never
    drops the update by itself: without ``max_psnr`` the update is sent, with the reason logged and written
    under :data:`AUDIT_NOTE_KEY`.  With ``max_psnr`` such an audit, or one where an attack failed, timed out or
    scored NaN, leaves the gate undecided; ``on_undecided="block"`` (default) refuses the update with the reason,
    ``"send"`` sends it with the reason noted.
    """
    if max_psnr is not None and (isinstance(max_psnr, bool) or not isinstance(max_psnr, (int, float))
                                 or not math.isfinite(max_psnr)):
        raise ConfigError(f"expected max_psnr as a finite number of dB or None, got {max_psnr!r} (argument max_psnr)")
    if on_undecided not in UNDECIDED:
        raise ConfigError(f"expected on_undecided in {list(UNDECIDED)}, got {on_undecided!r} (argument on_undecided)")
    auditor = Auditor(attacks, seed=seed, device=device, loss=loss, normalize=normalize, input_shape=input_shape,
                      save_images=False, seconds=audit_seconds, max_bytes=audit_memory, max_work=max_work)
    names = positional_names(model_fn)

    def undecided(msg: Message, reply: Message, out: TrainReply | None, context: Context, server_round: int,
                  why: str) -> Message:
        if max_psnr is None:
            note = f"audit skipped: {why}; the update was sent unaudited"
            log.warning("leakbench audit_mod: round %d node %d: %s", server_round, context.node_id, note)
            _note(reply, out, keys, note)
            return reply
        if on_undecided == "block":
            return _refuse(msg, f"leakbench audit_mod: update of node {context.node_id} in round {server_round} not "
                                f"sent: the max_psnr gate ({max_psnr:g} dB) cannot decide: {why} (on_undecided="
                                "'block'; fix the audit, or pass on_undecided='send' to send undecided updates)")
        note = (f"max_psnr gate ({max_psnr:g} dB) undecided: {why}; sent (on_undecided='send')")
        log.warning("leakbench audit_mod: round %d node %d: %s", server_round, context.node_id, note)
        _note(reply, out, keys, note)
        return reply

    def leakbench_audit_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg) or layout(msg) is None:  # a SecAgg+ key exchange carries no model
            return call_next(msg, context)
        try:
            sent, problem = train_inputs(msg, names), None
        except Exception as err:  # noqa: BLE001 - the train function decides what to make of its message
            sent, problem = None, f"the train message cannot be read: {_one_line(err)}"
        config = sent.config if sent is not None else {}
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        server_round = _server_round(config, msg)
        if masked(reply):
            return _secagg_verdict(reply, context, server_round)
        start = time.perf_counter()
        out = None
        try:
            out = train_reply(reply, names)
            if problem is not None:
                raise ConfigError(problem)
            metrics = out.metrics
            training = local_training(config, out.reported(keys.examples), keys)
            batch = data_fn(context, server_round)
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise ConfigError(f"expected data_fn(context, round) to return (x, y), got {type(batch).__name__} "
                                  "(argument data_fn)")
            x, y = torch.as_tensor(batch[0]), torch.as_tensor(batch[1])
            defense = _defense_of(reply, out, keys)
            before, after = model_from(model_fn, sent.state), model_from(model_fn, out.state)
            norm = _update_norm(before, after)
            outcomes = auditor.audit(before, after, training, x=x, y=y, defense=defense,
                                     verify=False)  # its own batch: nothing to verify
        except Exception as err:  # noqa: BLE001 - an audit that cannot run never drops the update by itself
            return undecided(msg, reply, out, context, server_round, _one_line(err))
        scores = best(outcomes)
        seconds = time.perf_counter() - start
        for key, value in zip(AUDIT_KEYS, (scores["rmse"], scores["psnr"], seconds, norm)):
            metrics[key] = float(value)
        if max_psnr is not None:
            leaking = [o for o in outcomes if o.status == "done" and isinstance(o.metrics.get("psnr"), (int, float))
                       and o.metrics["psnr"] > max_psnr]
            if leaking:
                worst = max(leaking, key=lambda o: o.metrics["psnr"])
                return _refuse(msg, f"leakbench audit_mod: update of node {context.node_id} in round {server_round} "
                                    f"not sent: {worst.attack} rebuilds its batch at PSNR {worst.metrics['psnr']:.1f} "
                                    f"dB > max_psnr {max_psnr:g} dB (RMSE {worst.metrics.get('rmse', math.nan):.2g}, "
                                    f"chance {worst.metrics.get('chance_rmse', math.nan):.2g}); add a defense "
                                    "(defense_mod) or raise max_psnr")
            why = _undecided(outcomes, max_psnr)
            if why is not None:
                return undecided(msg, reply, out, context, server_round, why)
        else:
            failed = [f"{o.attack} {o.status}: {' '.join(str(o.error).split())[:200]}" for o in outcomes
                      if o.status not in ("done", "n/a")]
            if failed:
                done = any(o.status == "done" for o in outcomes)
                _note(reply, out, keys, f"audit {'incomplete' if done else 'skipped'}: {'; '.join(failed)}")
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
    trainable = None if model_fn is None else [n for n, p in model_fn().named_parameters() if p.requires_grad]
    names = positional_names(model_fn)

    def leakbench_defense_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg) or layout(msg) is None:  # a SecAgg+ key exchange carries no model
            return call_next(msg, context)
        try:
            sent = train_inputs(msg, names)
        except Exception as err:  # noqa: BLE001 - one line, and nothing leaves undefended
            return _refuse(msg, f"leakbench defense_mod: the train message cannot be read: {_one_line(err)}; the "
                                "update was not sent")
        config = sent.config
        if in_step:
            train_config_record(msg)[keys.defense] = in_step
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        if masked(reply):
            return _refuse(msg, f"leakbench defense_mod: the update left as SecAgg+ masked vectors, on which {full!r} "
                                "cannot act: place defense_mod inside secaggplus_mod (after it in mods); the update "
                                "was not sent")
        try:
            return _defend(msg, context, reply, sent.state, config)
        except Exception as err:  # noqa: BLE001 - a defense that cannot act sends nothing undefended; one line
            return _refuse(msg, f"leakbench defense_mod: {full!r} cannot act on the reply of node {context.node_id}: "
                                f"{_one_line(err)}; the update was not sent")

    def _defend(msg: Message, context: Context, reply: Message, before: dict, config: dict) -> Message:
        out = train_reply(reply, names)
        metrics = out.metrics
        if in_step and STEPS_KEY not in metrics:
            return _refuse(msg, f"leakbench defense_mod: {in_step!r} acts inside each training step, but the train "
                                "function did not report running it: train with leakbench.integrations.flower."
                                "local_train(..., defense=in_step_defense(config)) and add its .metrics() to the "
                                "reply's MetricRecord; the update was not sent")
        after = out.state
        if update_defense is not None:
            defended = [k for k in trainable if k in after] if trainable else \
                [k for k, t in after.items() if t.is_floating_point()]
            missing = [k for k in (trainable or defended) if k not in before or k not in after]
            if missing:
                return _refuse(msg, f"leakbench defense_mod: the reply's arrays lack {missing[:3]} of the global "
                                    "model; the update was not sent")
            shared = [k for k in after if k in before]
            misfit = [f"{k} {tuple(after[k].shape)} (global {tuple(before[k].shape)})" for k in shared
                      if tuple(after[k].shape) != tuple(before[k].shape)]
            if misfit:
                return _refuse(msg, f"leakbench defense_mod: expected the reply's arrays in the global model's "
                                    f"shapes, got {', '.join(misfit[:3])}; the update was not sent")
            odd = [f"{k} ({after[k].dtype}, global {before[k].dtype})" for k in shared
                   if after[k].dtype != before[k].dtype or (k in defended and not after[k].is_floating_point())]
            if odd:
                return _refuse(msg, f"leakbench defense_mod: expected float arrays in the global model's dtypes to "
                                    f"defend, got {', '.join(odd[:3])}; the update was not sent")
            gen = torch.Generator().manual_seed(_seed(seed, _server_round(config, msg), context.node_id))
            delta = update_defense.apply_gradients([after[k] - before[k] for k in defended], generator=gen)
            for k, d in zip(defended, delta):
                after[k] = (before[k] + d).to(after[k].dtype)
            set_reply_state(reply, out, after)
        if dp is not None:
            state = context.state.metric_records.get("leakbench-dp") if "leakbench-dp" in \
                context.state.metric_records else MetricRecord({"rates": [], "steps": []})
            rates = list(state.get("rates", [])) + [float(metrics[RATE_KEY])]
            steps = list(state.get("steps", [])) + [int(metrics[STEPS_KEY])]
            context.state.metric_records["leakbench-dp"] = MetricRecord({"rates": rates, "steps": steps})
            metrics[EPSILON_KEY] = _epsilon(list(zip(rates, steps)), dp.sigma, dp.delta, dp.accountant)
        if out.layout == "legacy":  # Flower's legacy mods rebuild the reply from FitRes: only fitres.metrics survives
            metrics[keys.defense] = full
        else:
            set_leakbench_record(reply, keys.record, {"defense": full})
        return reply

    return leakbench_defense_mod


__all__ = ["audit_mod", "defense_mod", "AUDIT_KEYS", "AUDIT_NOTE_KEY", "EPSILON_KEY", "VERDICT_KEY", "UNDECIDED"]
