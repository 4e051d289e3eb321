"""``AuditStrategy``: any Flower strategy whose rounds are audited for leakage, every ``every`` rounds.

Flower's Message API (``flwr.serverapp.strategy.Strategy``, current since Flower 1.21): the strategy
configures a round (``configure_train`` gets the global ``ArrayRecord``) and aggregates the clients'
reply messages (``aggregate_train``).  The wrapper keeps the global model of each round, and before the
wrapped strategy aggregates, turns each client's reply into an ``update`` observation (the client's
local steps, learning rate and batch size from the train config and reply metrics, :class:`FitKeys`),
runs the named attacks (:class:`~.audit.Auditor`) and writes one row per client and attack into the
results store (:class:`~.storage.AuditLog`).  The defense a client applied (the reply's ``leakbench``
ConfigRecord, written by :func:`~.mods.defense_mod`) is recorded, never applied again.  Given the
client partitions (simulation) the reconstructions are scored against each client's real batch;
otherwise (deployment) they are stored unscored.  ``start`` also records the global model's
metrics per round (centralised ``evaluate_fn`` and the clients' aggregated evaluation).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import nn

from ...errors import ConfigError
from .audit import AUDIT_MEMORY, AUDIT_SECONDS, MAX_WORK, Audited, Auditor
from .keys import FitKeys, LocalTraining, local_training
from .records import arrays_of, config_of, leakbench_record, metrics_of, model_from, state_of
from .storage import AuditLog

log = logging.getLogger("flwr.leakbench")

#: ground truth in simulation: partitions by partition id, or ``f(partition_id, server_round) -> (x, y)``.
Partitions = "Sequence[tuple[torch.Tensor, torch.Tensor]] | Mapping[int, tuple[torch.Tensor, torch.Tensor]] | Callable"


class AuditStrategy(Strategy):
    """Wrap ``strategy`` so that every ``every`` rounds each client's update is attacked and stored.

    ``model_fn`` builds the architecture the ServerApp trains; ``attacks`` names the attacks as the CLI
    and sweep specs do; ``db`` is the results store (a path or an open :class:`Store`), ``run`` tags this
    run in it.  ``partitions`` (simulation): each client's batch behind its update, by the partition id
    the client reports under ``keys.partition`` (or by its node id), or a function of (partition id,
    round).  ``max_clients`` audits at most that many clients per round (lowest ids first).  The chance
    control is a flat image at ``chance_mean`` (default: the mean pixel of the partitions when they are a
    collection, of each client's batch when they are a function).

    Each client's audit has a budget (:class:`~.audit.Auditor`): ``audit_seconds`` of wall-clock time, and,
    checked before any work from the client's own report, at most ``max_work`` sample-steps (local steps ×
    examples) and an estimated ``audit_memory`` bytes.  Past it the client's rows are ``timed out`` or
    ``failed`` with the reason, and the round is aggregated as without the audit.
    """

    def __init__(self, strategy: Strategy, *, model_fn: Callable[[], nn.Module], attacks: Any,
                 db: Any, run: str = "flower", every: int = 1, partitions: Any = None,
                 keys: FitKeys = FitKeys(), max_clients: int | None = None, seed: int = 0, device: str = "cpu",
                 loss: str = "ce", normalize: tuple | None = None, input_shape: Sequence[int] | None = None,
                 save_images: bool = True, save_updates: bool = True, chance_mean: float | None = None,
                 description: Mapping[str, Any] | None = None, audit_seconds: float | None = AUDIT_SECONDS,
                 audit_memory: int = AUDIT_MEMORY, max_work: int = MAX_WORK) -> None:
        if not isinstance(strategy, Strategy):
            raise ConfigError(f"expected a Flower Message-API strategy (flwr.serverapp.strategy.Strategy, e.g. "
                              f"FedAvg()), got {type(strategy).__name__} (argument strategy)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"expected every ≥ 1 (audit every k-th round), got {every!r} (argument every)")
        if max_clients is not None and (not isinstance(max_clients, int) or max_clients < 1):
            raise ConfigError(f"expected max_clients ≥ 1 or None, got {max_clients!r} (argument max_clients)")
        self.strategy, self.model_fn, self.keys, self.every = strategy, model_fn, keys, every
        self.partitions, self.max_clients, self.seed = partitions, max_clients, int(seed)
        self.save_updates = save_updates
        self.auditor = Auditor(attacks, seed=seed, device=device, loss=loss, normalize=normalize,
                               input_shape=input_shape, save_images=save_images, seconds=audit_seconds,
                               max_bytes=audit_memory, max_work=max_work)
        self.mode = "simulation" if partitions is not None else "deployment"
        probe = model_fn()
        if not isinstance(probe, nn.Module):
            raise ConfigError(f"expected model_fn to return a torch.nn.Module, got {type(probe).__name__} "
                              "(argument model_fn)")
        model_name = getattr(probe, "spec", None) or type(probe).__name__
        self.log = AuditLog(db, run=run, model=str(model_name), description={
            "mode": self.mode, "strategy": type(strategy).__name__, "every": every,
            "attacks": [c.key for c in self.auditor.choices], **dict(description or {})})
        self._global: dict[int, dict[str, torch.Tensor]] = {}
        self._config: dict[int, dict[int, dict[str, Any]]] = {}  # round → node → the train config it was sent
        self.chance_mean = self._population_mean() if chance_mean is None else float(chance_mean)
        self.audited: list[str] = []

    # ------------------------------------------------------------------ delegation
    def __getattr__(self, name: str) -> Any:  # the wrapped strategy's settings (weighted_by_key, ...)
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def summary(self) -> None:
        self.strategy.summary()
        log.info("leakbench audit: %s every %d round(s), %s mode, store %s (run %r)",
                 ", ".join(c.key for c in self.auditor.choices), self.every, self.mode, self.log.store.path,
                 self.log.run)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if self._audited(server_round):
            self._global[server_round] = state_of(arrays)
            self._config[server_round] = {int(m.metadata.dst_node_id): config_of(m) for m in messages}
        return messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if self._audited(server_round) and server_round in self._global:
            try:
                self._audit_round(server_round, replies)
            except Exception as err:  # noqa: BLE001 - the audit never takes down the training it watches
                log.warning("leakbench audit: round %d not audited: %s: %s", server_round, type(err).__name__,
                            " ".join(str(err).split())[:300])
            finally:
                self._global.pop(server_round, None)
                self._config.pop(server_round, None)
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        metrics = self.strategy.aggregate_evaluate(server_round, replies)
        if metrics:
            self.log.record_round(round=server_round, metrics=dict(metrics), source="clients")
        return metrics

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """:meth:`Strategy.start` with the global model's metrics of every round stored beside the audit."""
        def recording(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            res = evaluate_fn(server_round, arrays)
            if res:
                self.log.record_round(round=server_round, metrics=dict(res), source="server")
            return res

        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                             evaluate_config=evaluate_config, evaluate_fn=None if evaluate_fn is None else recording)

    # ------------------------------------------------------------------ the audit
    def _audited(self, server_round: int) -> bool:
        return server_round % self.every == 0

    def _population_mean(self) -> float | None:
        """The mean pixel of every partition given (the chance control's grey), when they are a collection."""
        parts = self.partitions
        if parts is None or callable(parts):
            return None
        values = parts.values() if isinstance(parts, Mapping) else parts
        xs = [torch.as_tensor(x).double() for x, _ in values]
        total = sum(float(x.sum()) for x in xs)
        count = sum(x.numel() for x in xs)
        return total / count if count else None

    def _truth(self, client: int, server_round: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        parts = self.partitions
        if parts is None:
            return None, None
        if callable(parts) and not isinstance(parts, (Mapping, Sequence)):
            x, y = parts(client, server_round)
        else:
            try:
                x, y = parts[client]
            except (KeyError, IndexError):
                raise ConfigError(f"no partition {client} among the {len(parts)} given to the auditor (argument "
                                  f"partitions; clients report their partition id under {self.keys.partition!r})"
                                  ) from None
        return torch.as_tensor(x), torch.as_tensor(y)

    def _audit_round(self, server_round: int, replies: list[Message]) -> None:
        """Audit every client's reply; one bad reply is a ``failed`` row with its reason, the others go on."""
        entries = []
        for msg in replies:
            if msg.has_error():
                continue
            node = int(msg.metadata.src_node_id)
            try:
                _, metrics = metrics_of(msg)
                metrics = dict(metrics)
            except Exception:  # noqa: BLE001 - audited below as failed, with the reason
                metrics = {}
            pid = metrics.get(self.keys.partition)
            claimed = int(pid) if isinstance(pid, (int, float)) and not isinstance(pid, bool) \
                and math.isfinite(pid) and float(pid).is_integer() and abs(pid) < 2**62 else None
            entries.append((node if claimed is None else claimed, node, msg, metrics))
        entries.sort(key=lambda e: (e[0], e[1]))
        if self.max_clients is not None:
            entries = entries[:self.max_clients]
        used: set[str] = set()
        claims = [e[0] for e in entries]
        for client, node, msg, metrics in entries:
            start = time.perf_counter()
            name = str(client) if claims.count(client) == 1 else f"{client}-n{node}"
            try:
                outcomes, training, defense, update_file = self._audit_client(server_round, client, node, msg,
                                                                              metrics, name)
            except Exception as err:  # noqa: BLE001 - one bad reply: a failed audit, and training goes on
                reason = " ".join(str(err).split())[:500] or type(err).__name__
                reason = reason if isinstance(err, ConfigError) else f"{type(err).__name__}: {reason}"
                outcomes = [Audited(c.key, c.name, "failed", False, error=f"bad client reply: {reason}")
                            for c in self.auditor.choices]
                training, defense, update_file = _UNKNOWN_TRAINING, "none", None
            tag = str(client)
            if tag in used or any(o.status in ("failed", "unverified") for o in outcomes):
                tag = f"{client}@node{node}"  # a client's word about its id is not an identity: no row overwritten
            used.add(tag)
            self._record(server_round, tag, node, outcomes, training, defense, metrics, update_file)
            best_psnr = max((o.metrics.get("psnr", -math.inf) for o in outcomes if o.status == "done" and o.scored),
                            default=None)
            log.info("leakbench audit: round %d client %s: %s%s (%.1fs)", server_round, tag,
                     ", ".join(f"{o.attack} {o.status}" for o in outcomes),
                     f", best PSNR {best_psnr:.1f} dB" if best_psnr is not None else "", time.perf_counter() - start)

    def _audit_client(self, server_round: int, client: int, node: int, msg: Message, metrics: dict[str, Any],
                      name: str):
        """(outcomes, training, defense, update file) of one reply; any problem of the reply raises."""
        before_state = self._global[server_round]
        _, arrays = arrays_of(msg)
        after_state = state_of(arrays)
        before, after = model_from(self.model_fn, before_state), model_from(self.model_fn, after_state)
        sent = self._config[server_round].get(node, {})
        training = local_training(sent, metrics, self.keys)
        defense = str(leakbench_record(msg, self.keys.record).get("defense", "none"))
        x, y = self._truth(client, server_round)
        outcomes = self.auditor.audit(before, after, training, x=x, y=y, defense=defense,
                                      chance_mean=self.chance_mean)
        update_file = None
        if self.save_updates:
            names = [n for n, p in before.named_parameters() if p.requires_grad]
            delta = {n: after_state[n] - before_state[n] for n in names}
            update_file = self.log.save_update(round=server_round, client=name, delta=delta)
        return outcomes, training, defense, update_file

    def _record(self, server_round: int, tag: str, node: int, outcomes: list[Audited], training: LocalTraining,
                defense: str, metrics: Mapping[str, Any], update_file) -> None:
        reported = {k: v for k, v in metrics.items() if isinstance(k, str) and k.startswith("leakbench-")}
        for choice, outcome in zip(self.auditor.choices, outcomes):
            key = self.log.record_update(round=server_round, client=tag, mode=self.mode, choice=choice,
                                         outcome=outcome, training=training, defense=defense, seed=self.seed,
                                         reported=reported, node=node, update_file=update_file)
            self.audited.append(key)


#: the training recorded beside a reply too malformed to say how the client trained.
_UNKNOWN_TRAINING = LocalTraining(batch_size=0, lr=0.0, steps=0)


__all__ = ["AuditStrategy"]
