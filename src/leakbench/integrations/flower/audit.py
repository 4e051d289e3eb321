"""The audit core (flwr-free): a client's update → a leakbench observation → the named attacks → scores.

One update θ_after − θ_before of a client that ran local SGD (:class:`~.keys.LocalTraining`) becomes
an ``update`` observation through :meth:`leakbench.threat.Observation.from_update`; each attack named as in the
CLI and sweep specs (registry name, ``preset``, ``options``, ``threat: {labels_known: true}``, ``label``)
runs on it as :func:`leakbench.evaluation.trials.attack.run_attack` runs it in a sweep trial.  With the client's
real batch (simulation, or the client auditing itself) the reconstruction is scored after Hungarian
matching (:func:`leakbench.compare`, Liu et al. 2024 eq. (1)) beside the chance control of a trial: a
flat image at the population's mean pixel.  Without it (deployment) it is kept unscored with the attack's
own confidence and final matching loss.
"""
from __future__ import annotations

import dataclasses
import math
import time
import traceback as tb
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ...budget import check_time, seconds_left, time_limit
from ...errors import BudgetExceeded, ConfigError, UnsupportedThreatModel
from .keys import LocalTraining

#: the fields of a sweep spec's per-attack ``threat`` a captured update can grant.
THREAT_FIELDS = ("labels_known",)


@dataclass(frozen=True)
class AttackChoice:
    """One attack as the CLI and sweep specs name it."""

    name: str
    preset: str | None = None
    options: dict = field(default_factory=dict)
    labels_known: bool = False
    label: str | None = None

    @property
    def key(self) -> str:
        return self.label or self.name


def attack_choices(attacks: str | Mapping | Iterable[str | Mapping]) -> list[AttackChoice]:
    """Attacks from names or sweep-spec entries (``{name, preset, options, threat, label}``), checked now.

    An unknown name, preset or option raises the registry's :class:`ConfigError` listing the known ones.
    """
    from pydantic import ValidationError

    from ...attacks import create
    from ...evaluation.sweep_spec.entries import AttackEntry

    items = [attacks] if isinstance(attacks, (str, Mapping)) else list(attacks or [])
    if not items:
        raise ConfigError("expected at least one attack, e.g. attacks=['inverting-gradients'] (argument attacks)")
    out: list[AttackChoice] = []
    for i, item in enumerate(items):
        try:
            entry = AttackEntry.model_validate(item)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ConfigError(f"attacks[{i}]{'.' + where if where else ''}: {first.get('msg')}; expected a name or "
                              "{name, preset, options, threat, label}") from None
        unknown = sorted(set(entry.threat) - set(THREAT_FIELDS))
        if unknown:
            raise ConfigError(f"attacks[{i}].threat: a captured update can grant {list(THREAT_FIELDS)}, got "
                              f"{unknown} (BN statistics and server moves are not part of a client's update)")
        create(entry.name, preset=entry.preset, **entry.options)
        out.append(AttackChoice(entry.name, entry.preset, dict(entry.options),
                                bool(entry.threat.get("labels_known", False)), entry.label))
    keys = [c.key for c in out]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"expected distinct attacks, got {keys}; give repeated names a label (field label)")
    return out


@dataclass
class Audited:
    """One attack on one update: ``status`` done / n/a / failed; ``scored`` when the real batch was known."""

    attack: str
    name: str
    status: str
    scored: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    per_sample: dict[str, list] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    traceback: str | None = None
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def chance(x: torch.Tensor, mean: float | None = None) -> dict[str, float]:
    """The chance control of a trial: a flat image at ``mean`` (default: ``x``'s mean pixel) scored against ``x``."""
    grey = float(x.double().mean()) if mean is None else float(mean)
    mse = float((x.double() - grey).pow(2).mean())
    return {"chance_rmse": math.sqrt(mse), "chance_psnr": 10 * math.log10(1.0 / mse) if mse > 0 else math.inf}


def best(outcomes: Sequence[Audited]) -> dict[str, float]:
    """The best scores over the done, scored attacks: lowest RMSE, highest PSNR (NaN when none scored)."""
    done = [o for o in outcomes if o.status == "done" and o.scored]
    rmse = [o.metrics["rmse"] for o in done if isinstance(o.metrics.get("rmse"), (int, float))]
    psnr = [o.metrics["psnr"] for o in done if isinstance(o.metrics.get("psnr"), (int, float))]
    return {"rmse": min(rmse) if rmse else math.nan, "psnr": max(psnr) if psnr else math.nan}


#: seconds one audit of one update (the check replay and every attack) may run; past it the rows say so.
AUDIT_SECONDS = 120.0
#: bytes one audit may be estimated to hold (:meth:`Auditor.cost`); above it the audit is not started.
AUDIT_MEMORY = 2 * 1024**3
#: sample-steps (local steps × examples) one audit may replay; above it the audit is not started.
MAX_WORK = 2**20


#: relative error within which an undefended update fits the replay of the reported training (float32 rounding).
VERIFY_RTOL = 1e-3
#: cosine a defended update must reach with the replay of the reported training on its batch.
VERIFY_COSINE = 0.9


def _deadline(done: int, total: int, loss: float) -> None:
    """An attack's progress callback: stops it at the audit's deadline."""
    check_time(f"the attack ran {done:,} of {total:,} steps")


def _trainable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def replay_update(model_before: nn.Module, x: torch.Tensor, y: torch.Tensor, training: LocalTraining, *,
                  loss: str = "ce", normalize: tuple | None = None, train: bool = False,
                  device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """θ_after − θ_before of the reported local SGD on ``(x, y)`` (full-batch steps, or unshuffled minibatch
    epochs), per trainable parameter: what an honest client with that batch would have sent."""
    from ...captured import with_normalization
    from ...losses import get_loss

    model = with_normalization(model_before, normalize).to(device).train(train)
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    loss_fn = get_loss(loss)
    x, y = x.to(device), y.to(device)
    dtype = params[0].dtype if params else torch.float32
    x = x.to(dtype) if x.is_floating_point() else x
    if training.epochs is not None:
        mb = training.minibatch or x.shape[0]
        batches = [slice(i, i + mb) for _ in range(training.epochs) for i in range(0, x.shape[0], mb)]
    else:
        batches = [slice(None)] * training.steps
    for i, part in enumerate(batches):
        check_time(f"replaying the client's training ({i:,} of {len(batches):,} steps)")
        value = loss_fn(model(x[part]), y[part])
        grads = torch.autograd.grad(value, params, allow_unused=True)
        with torch.no_grad():
            for p, g in zip(params, grads):
                if g is not None:
                    p -= training.lr * g
    return [(p.detach() - s).double() for p, s in zip(params, start)]


class Auditor:
    """Runs the named attacks on captured updates: ``Auditor(["fc-inversion"]).audit(obs, x, y)``.

    ``loss``, ``normalize``, ``input_shape`` and ``train`` are the threat-model arguments of
    :meth:`leakbench.threat.Observation.from_update`; ``seed`` seeds every attack.

    Each audit of one update has a budget: ``seconds`` of wall-clock time for the check replay and every attack
    (each attack's steps check it; an attack still running at the deadline, and those after it, are
    ``timed out``), and before any work an estimate (:meth:`cost`) of the sample-steps it replays (at most
    ``max_work``) and of the bytes it holds (at most ``max_bytes``); an audit over either is not started and
    its rows say why.  The counts come from the client's own report, so the budget bounds what a client can
    make the auditor do.
    """

    def __init__(self, attacks: str | Mapping | Iterable[str | Mapping], *, seed: int = 0, device: str = "cpu",
                 loss: str = "ce", normalize: tuple | None = None, input_shape: Sequence[int] | None = None,
                 train: bool = False, save_images: bool = True, seconds: float | None = AUDIT_SECONDS,
                 max_bytes: int = AUDIT_MEMORY, max_work: int = MAX_WORK) -> None:
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not seconds > 0 or math.isnan(seconds)):
            raise ConfigError(f"expected the audit's time budget in seconds > 0 or None, got {seconds!r} "
                              "(argument audit_seconds)")
        for value, name in ((max_bytes, "audit_memory"), (max_work, "max_work")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"expected a positive integer, got {value!r} (argument {name})")
        self.seconds = None if seconds is None or math.isinf(seconds) else float(seconds)
        self.max_bytes, self.max_work = int(max_bytes), int(max_work)
        self.choices = attack_choices(attacks)
        self.seed, self.device, self.loss = int(seed), torch.device(device), loss
        self.normalize, self.train, self.save_images = normalize, bool(train), bool(save_images)
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)

    def cost(self, model_before: nn.Module, training: LocalTraining, x: torch.Tensor | None = None) -> str | None:
        """Why the audit of this update would exceed its budget (None when it fits), before any work.

        Work: the reported local steps × examples (the sample-steps the check replay and the update-matching
        attacks run), at most ``max_work``.  Memory (a rough upper estimate, 4 bytes a number): the models and
        their update (4 × the parameters), the reconstructions and their optimiser state (4 × examples × input
        size), and the graph of the unrolled local steps an update-matching attack differentiates through
        (steps × (parameters + examples × input size)), at most ``max_bytes``.
        """
        params = sum(p.numel() for p in model_before.parameters())
        steps, examples = int(training.steps), int(training.batch_size)
        work = steps * examples
        if work > self.max_work:
            return (f"expected at most {self.max_work:,} sample-steps (local steps × examples) for one audit, got "
                    f"{steps:,} × {examples:,} = {work:,} from the client's report (argument max_work)")
        shape = tuple(x.shape[1:]) if x is not None else self.input_shape or getattr(model_before, "input_shape", None)
        size = math.prod(int(s) for s in shape) if shape else 0
        need = 4 * (4 * params + 4 * examples * size + steps * (params + examples * size))
        if need > self.max_bytes:
            return (f"expected the audit to need at most {self.max_bytes / 2**30:.3g} GiB, got an estimate of "
                    f"{need / 2**30:.3g} GiB ({params:,} parameters, {examples:,} examples of {size:,} values, "
                    f"{steps:,} local steps) (argument audit_memory)")
        return None

    def _budget_rows(self, why: str, status: str = "timed out", scored: bool = False) -> list[Audited]:
        return [Audited(c.key, c.name, status, scored, error=f"audit budget: {why}") for c in self.choices]

    def observe(self, model_before: nn.Module, model_after: nn.Module, training: LocalTraining, *,
                labels: torch.Tensor | None = None, defense: str = "none"):
        """The ``update`` observation of ``model_after − model_before``
        (:meth:`leakbench.threat.Observation.from_update`)."""
        from ...threat import Observation

        return Observation.from_update(model_before.to(self.device), model_after.to(self.device),
                                       **training.options(), labels=labels, loss=self.loss,
                                       input_shape=self.input_shape, normalize=self.normalize, train=self.train,
                                       defense=defense)

    def verify(self, model_before: nn.Module, model_after: nn.Module, training: LocalTraining, x: torch.Tensor,
               y: torch.Tensor, *, defense: str = "none") -> str | None:
        """Why the update does not fit the batch ``(x, y)`` it would be scored against (None when it fits).

        The client's partition id, example count and local steps are its own word.  The server replays the
        reported local SGD from ``model_before`` on ``(x, y)`` and compares it with the update: with no
        defense they must agree to :data:`VERIFY_RTOL` (relative error), with a defense (noise, clipping,
        DP-SGD change the update) their cosine must reach :data:`VERIFY_COSINE`.
        """
        if y is None or x.shape[0] != training.batch_size or y.shape[0] != x.shape[0]:
            return (f"the client reported {training.batch_size} example(s), its partition holds "
                    f"{x.shape[0]} (x {tuple(x.shape)}, y {None if y is None else tuple(y.shape)}): the update "
                    "cannot come from that batch")
        delta = [a.detach().double() - b.detach().double() for (_, b), (_, a) in
                 zip(_trainable(model_before), _trainable(model_after))]
        replay = replay_update(model_before, x, y, training, loss=self.loss, normalize=self.normalize,
                               train=self.train, device=self.device)
        if [tuple(d.shape) for d in delta] != [tuple(r.shape) for r in replay]:
            return "the update's parameter shapes do not fit the model"
        d = torch.cat([t.reshape(-1) for t in delta]).cpu()
        r = torch.cat([t.reshape(-1) for t in replay]).cpu()
        norm = float(d.norm())
        if not math.isfinite(norm) or norm == 0.0:
            return f"the update is {'zero' if norm == 0.0 else 'not finite'}: nothing to check it against"
        if (defense or "none") == "none":
            error = float((d - r).norm()) / norm
            if error <= VERIFY_RTOL:
                return None
            return (f"the update does not fit the batch it would be scored against (relative error {error:.3g} > "
                    f"{VERIFY_RTOL:g} for the reported lr {training.lr:g}, {training.steps} step(s), "
                    f"{training.batch_size} example(s)): the client's partition id or training report is wrong")
        cosine = float(torch.dot(d, r) / (norm * float(r.norm()) + 1e-300))
        if cosine >= VERIFY_COSINE:
            return None
        return (f"the defended update ({defense}) does not fit the batch it would be scored against (cosine "
                f"{cosine:.3f} < {VERIFY_COSINE:g}): the client's partition id or training report is wrong")

    def audit(self, model_before: nn.Module, model_after: nn.Module, training: LocalTraining, *,
              x: torch.Tensor | None = None, y: torch.Tensor | None = None, defense: str = "none",
              chance_mean: float | None = None, verify: bool = True) -> list[Audited]:
        """Every attack on the update; scored against ``(x, y)`` when given (the batch behind the update) and
        the update fits it (:meth:`verify`); otherwise every attack runs unscored and is ``unverified``
        with the reason.  ``verify=False`` trusts ``(x, y)``: a client auditing its own update (``audit_mod``)."""
        if x is not None and not verify:
            if y is None or x.shape[0] != training.batch_size or y.shape[0] != x.shape[0]:
                raise ConfigError(f"expected the client's batch of {training.batch_size} samples (x, y) behind the "
                                  f"update, got x of {tuple(x.shape)} and y of {None if y is None else tuple(y.shape)}"
                                  " (check data_fn and the num-examples the client reports)")
        over = self.cost(model_before, training, x)
        if over is not None:
            return self._budget_rows(over, "failed")
        what = f"the audit's time budget of {self.seconds:g} s (argument audit_seconds)" if self.seconds else ""
        with time_limit(self.seconds, what):
            try:
                unverified = None if x is None or not verify else self.verify(model_before, model_after, training,
                                                                              x, y, defense=defense)
            except BudgetExceeded as err:
                return self._budget_rows(str(err))
            if unverified is not None:
                x = y = None
            out = self._audit(model_before, model_after, training, x=x, y=y, defense=defense,
                              chance_mean=chance_mean)
        if unverified is not None:
            for o in out:
                if o.status == "done":
                    o.status, o.error = "unverified", unverified
                else:
                    o.error = f"{o.error}; {unverified}" if o.error else unverified
        return out

    def _audit(self, model_before: nn.Module, model_after: nn.Module, training: LocalTraining, *,
               x: torch.Tensor | None, y: torch.Tensor | None, defense: str,
               chance_mean: float | None) -> list[Audited]:
        plain = self.observe(model_before, model_after, training, defense=defense)
        labelled = None
        out = []
        for choice in self.choices:
            obs = plain
            if choice.labels_known:
                if y is None:
                    out.append(Audited(choice.key, choice.name, "n/a", False,
                                       error="labels_known needs the client's labels: give the auditor the partitions"))
                    continue
                if labelled is None:
                    labelled = self.observe(model_before, model_after, training, labels=y, defense=defense)
                obs = labelled
            if seconds_left() <= 0:
                out.append(Audited(choice.key, choice.name, "timed out", x is not None,
                                   error="audit budget: not started, the audit's time ran out before it "
                                         "(argument audit_seconds)"))
                continue
            out.append(self._run(choice, obs, x, y, chance_mean))
        return out

    def _run(self, choice: AttackChoice, obs, x, y, chance_mean) -> Audited:
        from ...attacks import create
        from ...evaluation.trials.trial import non_finite

        start = time.perf_counter()
        attack = create(choice.name, preset=choice.preset, **choice.options)
        reasons = attack.requirements(obs)
        if reasons:
            return Audited(choice.key, choice.name, "n/a", x is not None, error="; ".join(reasons))
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                rec = attack(obs, seed=self.seed, progress=_deadline)
            result = self._score(choice, rec, x, y, chance_mean)
        except UnsupportedThreatModel as err:
            return Audited(choice.key, choice.name, "n/a", x is not None, error=str(err))
        except BudgetExceeded as err:
            return Audited(choice.key, choice.name, "timed out", x is not None, error=f"audit budget: {err}",
                           seconds=time.perf_counter() - start)
        except Exception as err:  # recorded beside the round, the federated run goes on
            return Audited(choice.key, choice.name, "failed", x is not None, error=f"{type(err).__name__}: {err}",
                           traceback=tb.format_exc(), seconds=time.perf_counter() - start)
        result.seconds = time.perf_counter() - start
        bad = non_finite(result.metrics)
        if bad:
            result.status, result.error = "failed", f"non-finite result: {', '.join(bad)}"
        return result

    def _score(self, choice: AttackChoice, rec, x, y, chance_mean) -> Audited:
        from ...metrics import compare

        images = rec.images.detach().to("cpu", torch.float32)
        labels = None if rec.labels is None else rec.labels.detach().cpu()
        if labels is not None and labels.ndim == 2:
            labels = labels.argmax(dim=1)
        confidence = None if rec.confidence is None else rec.confidence.detach().cpu()
        loss = rec.trace.get("loss")
        final_loss = float(loss[-1]) if isinstance(loss, (list, tuple)) and loss else None
        if x is None:  # deployment: the attack's own word only
            metrics: dict[str, Any] = {"images": int(images.shape[0]), "final_loss": final_loss}
            if confidence is not None and confidence.numel():
                metrics.update(confidence_mean=float(confidence.double().mean()),
                               confidence_max=float(confidence.double().max()))
            arrays = {"reconstruction": images.numpy()} if self.save_images else {}
            return Audited(choice.key, choice.name, "done", False, metrics=metrics, arrays=arrays)
        x, y = x.detach().cpu(), y.detach().cpu()
        scores = compare(dataclasses.replace(rec, images=images, labels=labels, confidence=confidence), x, y)
        per_sample = scores.pop("per_sample")
        order = scores.pop("order")
        metrics = {k: v for k, v in scores.items() if v is None or isinstance(v, (int, float))}
        metrics["matching"] = str(scores.get("matching", "total-mse"))
        metrics["final_loss"] = final_loss
        metrics.update(chance(x, chance_mean))
        arrays = {}
        if self.save_images:
            arrays = {"x": x.float().numpy(), "y": y.numpy(), "reconstruction": images.numpy(),
                      "order": np.asarray(order, dtype=np.int64)}
        return Audited(choice.key, choice.name, "done", True, metrics=metrics, per_sample=per_sample, arrays=arrays)


__all__ = ["AUDIT_SECONDS", "AUDIT_MEMORY", "MAX_WORK", "AttackChoice", "Audited", "Auditor", "attack_choices", "best", "chance", "replay_update", "THREAT_FIELDS",
           "VERIFY_RTOL", "VERIFY_COSINE"]
