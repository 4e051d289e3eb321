"""The strongest attack S_D per threat model and defense setting, with its n and interval; utility; the verdict.

Liu et al. (2024), eq. (3): S_D = max over attacks A of the reconstruction quality d(S, A(D(G))).  As in the
paper's Table 4, for each setting — (threat model, dataset, model, defense, batch size) — the strongest attack
is the one with the lowest mean RMSE over its usable trials (ties broken by higher PSNR, then higher SSIM).
Attack rows of different threat models are different settings: an attack that needs a malicious server is
never the strongest attack against an eavesdropper.

**Replication** (:mod:`.stats`).  A setting rests on n batches (trials; one seeded draw of B images each).  Every
mean comes with n and a 95 % bootstrap interval over batches; two defenses are compared batch by batch
(paired: every defense of a setting attacks the same seeded batches).  Beside Liu et al.'s per-setting S_D
sits the *per-image* strongest attack (for each image, the lowest RMSE any attack reached): the bound of an
adversary who picks the best attack per image.

**Chance.**  Beside each score sits its chance level (``chance_rmse``: a flat image at the data mean).  An
attacker can always output that image, so S_D is capped at it (:attr:`Strongest.sd`): every RMSE at or above
chance is one class, "stops the attack".  A setting *stops every attack run here* when no attack's RMSE is
significantly below chance (the interval of chance − RMSE, paired by batch, does not lie above 0) and it rests
on at least :data:`~.stats.MIN_N` batches.

A trial is *usable* when its status is ``done`` and its RMSE is finite.  Trials with any other status
(``failed``, ``n/a``, ``timed out``, ...) or a non-finite value are counted beside the attack's score
(``failed``, with the reasons) and never averaged in; an attack with no usable trial is never selected.

**Utility** (Table 5) is joined to a setting on (dataset, model, defense, batch size), falling back to batch
size 0.  Several training seeds per setting: the utility loss is the increase of the final training loss over
the undefended run *of the same seed* (paired), with a Student-t interval over seeds.  A gain is reported as
measured (an interval that overlaps zero), never clamped.  A run is **diverged** when its training loss is not
finite or ends above the untrained model's: it gets no utility number, never competes within a budget and is
never placed on the utility axis.

:func:`verdicts` answers, per utility budget u in :data:`BUDGETS` (the upper end of the utility-loss interval
≤ u, plus "any cost"), which defense to pick: the cheapest of those that stop every attack (the rest listed as
equivalent), otherwise the one with the highest S_D with every defense not significantly below it listed as
tied.  Everything here is a pure function of rows as returned by :meth:`~.store.Store.rows`; missing keys take
their defaults.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ..trials.plan import defense_family
from ..membership.published import SSIM_THRESHOLDS
from .stats import EMPTY, MIN_N, Interval, bootstrap_mean, paired, paired_bootstrap, paired_t, t_mean
from ..trials.trial import THREAT_MODELS

#: utility budgets of the verdict: final training-loss increase over the undefended run (nats); inf = any cost.
BUDGETS = (0.05, 0.1, 0.25, math.inf)
#: the threat model of a row that names none, per kind.
_DEFAULT_THREAT = {"weights": "published-weights", "membership": "membership"}


def finite(value: Any) -> bool:
    """True for a real, finite number (not None, NaN, inf, a bool or a string)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def threat_model(row: Mapping[str, Any]) -> str:
    """The threat model a row assumes (``eavesdropper`` when it names none)."""
    spec = row.get("spec") or {}
    return (row.get("threat_model") or spec.get("threat_model")
            or _DEFAULT_THREAT.get(row.get("kind") or "attack", "eavesdropper"))


def batch_size(row: Mapping[str, Any]) -> int:
    """The row's batch size; 0 when absent (an old utility row applies to every batch size)."""
    value = row.get("batch_size")
    if value is None:
        value = (row.get("spec") or {}).get("batch_size")
    return int(value) if finite(value) else 0


#: the verdict's metric of a text trial: 1 − token accuracy (lower = more leakage, as RMSE) and its chance level
TEXT_METRIC = "token_error"


def is_text_row(row: Mapping[str, Any]) -> bool:
    """A text trial's row (its metrics say ``modality: text``)."""
    return (row.get("metrics") or {}).get("modality") == "text"


def scored(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """The row as the verdict logic reads it: an image row as it is; a text row with ``rmse`` the token error
    1 − token accuracy, ``chance_rmse`` the unigram draws' token error and per-sequence errors in
    ``per_sample["rmse"]``, so S_D, its intervals, ties, the chance test and the per-sample strongest attack are
    the image side's own, on token accuracy (higher accuracy = lower error = more leakage)."""
    if not is_text_row(row):
        return row
    m = row.get("metrics") or {}
    per = row.get("per_sample") or {}
    error = m.get(TEXT_METRIC)
    return {**row, "rmse": float(error) if finite(error) else None, "psnr": None, "ssim": None,
            "metrics": {**m, "chance_rmse": m.get("chance_token_error")},
            "per_sample": {"rmse": list(per.get(TEXT_METRIC) or []),
                           "chance_rmse": list(per.get("chance_token_error") or [])}}


def invalid_result(row: Mapping[str, Any]) -> str | None:
    """Why a ``done`` attack row's result is no measurement (None when it is one): its RMSE is missing, NaN/inf,
    or negative (RMSE = √MSE is never below 0, so a negative one is a corrupt row, not a perfect attack)."""
    rmse = row.get("rmse")
    if not finite(rmse):
        return "non-finite result (NaN/inf)"
    if rmse < 0:
        return f"invalid result (negative RMSE {rmse:.3g}; an RMSE is never below 0)"
    return None


def usable(row: Mapping[str, Any]) -> bool:
    """A finished attack trial with a valid RMSE (finite and ≥ 0: :func:`invalid_result`)."""
    return row.get("status") == "done" and invalid_result(row) is None


def npz_path(row: Mapping[str, Any]) -> str | None:
    """The row's saved arrays (``npz`` column, or ``images["npz"]``), None when it has none."""
    images = row.get("images")
    path = row.get("npz") or (images.get("npz") if isinstance(images, Mapping) else None)
    return str(path) if path else None


def unit(row: Mapping[str, Any]) -> tuple[int, int]:
    """The replication unit of an attack row: (seed, batch) — the same images for every defense and attack."""
    spec = row.get("spec") or {}
    seed = row.get("seed", spec.get("seed", 0))
    batch = row.get("batch", spec.get("batch", 0))
    return (int(seed) if finite(seed) else 0, int(batch) if finite(batch) else 0)


def _reason(row: Mapping[str, Any]) -> str:
    status = row.get("status") or "unknown"
    if status == "done":
        return invalid_result(row) or "non-finite result (NaN/inf)"
    error = (row.get("error") or "").strip().splitlines()
    return f"{status}: {error[0]}" if error else str(status)


def _mean(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if finite(v)]
    return sum(vals) / len(vals) if vals else None


def _chance(row: Mapping[str, Any]) -> float | None:
    value = (row.get("metrics") or {}).get("chance_rmse")
    return float(value) if finite(value) else None


def _per_image(row: Mapping[str, Any]) -> dict[tuple, tuple[float, float | None]]:
    """(seed, batch, i) → (RMSE of original i, its own chance RMSE) of a usable row (the batch's chance when the
    row predates per-image chance)."""
    per = row.get("per_sample") or {}
    rmse = per.get("rmse") or []
    chance = per.get("chance_rmse") or []
    batch_chance = _chance(row)
    s, b = unit(row)
    out = {}
    for i, v in enumerate(rmse):
        if finite(v):
            c = chance[i] if i < len(chance) and finite(chance[i]) else batch_chance
            out[(s, b, i)] = (float(v), c)
    return out


@dataclass
class AttackScore:
    """One attack on one setting: its mean scores over usable trials, per batch, and their interval."""

    attack: str
    rmse: float
    psnr: float
    ssim: float | None
    trials: int
    failed: int = 0
    not_applicable: str | None = None
    rmse_std: float | None = None
    reasons: list[str] = field(default_factory=list)
    timed_out: int = 0
    chance_rmse: float | None = None
    #: the registry name of the attack (``attack`` is the spec's label)
    name: str = ""
    #: (seed, batch) → RMSE / chance RMSE of that trial
    per_batch: dict[tuple, float] = field(default_factory=dict)
    chance_per_batch: dict[tuple, float] = field(default_factory=dict)
    #: (seed, batch, i) → (RMSE, chance RMSE) of image i
    per_image: dict[tuple, tuple[float, float | None]] = field(default_factory=dict)
    #: what ``rmse`` measures: ``"rmse"``, or ``"token_error"`` (1 − token accuracy) for text
    metric: str = "rmse"
    #: the mean RMSE and its bootstrap interval over batches
    ci: Interval = EMPTY
    #: chance − RMSE, paired by batch: above 0 = significantly better than a flat image
    margin: Interval = EMPTY

    @property
    def below_chance(self) -> bool:
        """The attack is significantly closer than a flat image (paired over batches, n ≥ MIN_N)."""
        return self.margin.above(0.0)


@dataclass
class Strongest:
    """S_D for one setting: the best attack, every attack's scores, intervals and the decision against chance."""

    dataset: str
    model: str
    defense: str
    batch_size: int
    attack: str | None
    rmse: float
    psnr: float
    ssim: float | None
    scores: list[AttackScore] = field(default_factory=list)
    threat_model: str = "eavesdropper"
    chance_rmse: float | None = None
    #: S_D capped at chance per batch ((seed, batch) → min(RMSE, chance)), its mean and interval
    sd_per_batch: dict[tuple, float] = field(default_factory=dict)
    sd: Interval = EMPTY
    #: the per-image strongest attack (lowest RMSE of any attack per image, capped at chance), by batch
    per_image: Interval = EMPTY
    per_image_per_batch: dict[tuple, float] = field(default_factory=dict)
    #: no attack significantly below chance, on at least MIN_N batches
    stops: bool = False
    #: why S_D here is only a lower bound on leakage (no gradient-matching attack ran), else None
    incomplete: str | None = None
    #: what ``rmse`` measures: ``"rmse"``, or ``"token_error"`` (1 − token accuracy) for text
    metric: str = "rmse"
    #: the strongest attack on the public client at the same checkpoint (a federated sweep), else None
    power: Strongest | None = None
    #: why this setting gets no verdict although no attack beat chance (the attack could not see), else None
    undetermined: str | None = None
    #: the median norm of the shared tensors of its attack trials (None: not recorded)
    update_norm: float | None = None

    @property
    def family(self) -> str:
        return defense_family(self.defense)[0]

    @property
    def sees(self) -> bool:
        """Some attack is significantly closer than chance here (paired over batches, n ≥ MIN_N)."""
        return any(a.below_chance for a in self.scores if a.trials)

    @property
    def n(self) -> int:
        """Batches S_D rests on."""
        return self.sd.n

    @property
    def beats_chance(self) -> bool | None:
        """False when the strongest attack is no closer than a flat image at the data mean (None: unknown)."""
        return beats_chance(self.rmse, self.chance_rmse)

    @property
    def parameter(self) -> str:
        return defense_family(self.defense)[1]


def beats_chance(rmse: Any, chance: Any) -> bool | None:
    """Whether a reconstruction's RMSE is below the chance level: a flat image at the data mean.

    ``True`` (it beats chance), ``False`` (RMSE ≥ chance: the attack learnt nothing about the batch that a flat
    image does not show) or ``None`` when either value is missing.
    """
    if not finite(rmse) or not finite(chance):
        return None
    return float(rmse) < float(chance)


def _rank(score: AttackScore) -> tuple:
    """Lower is stronger: RMSE, then −PSNR, then −SSIM; no usable trial sorts last."""
    def val(v, sign):
        return sign * v if finite(v) else math.inf
    return (0 if score.trials else 1, val(score.rmse, 1), val(score.psnr, -1), val(score.ssim, -1), score.attack)


def _score(label: str, trials: Sequence[Mapping[str, Any]]) -> AttackScore:
    good = [t for t in trials if usable(t)]
    na = [t for t in trials if t.get("status") == "n/a"]
    bad = [t for t in trials if not usable(t) and t.get("status") != "n/a"]
    per_batch: dict[tuple, list[float]] = {}
    chance_batch: dict[tuple, list[float]] = {}
    per_image: dict[tuple, tuple[float, float | None]] = {}
    for t in good:
        per_batch.setdefault(unit(t), []).append(float(t["rmse"]))
        if _chance(t) is not None:
            chance_batch.setdefault(unit(t), []).append(_chance(t))
        per_image.update(_per_image(t))
    pb = {k: sum(v) / len(v) for k, v in per_batch.items()}
    cb = {k: sum(v) / len(v) for k, v in chance_batch.items()}
    rmses = [float(t["rmse"]) for t in good]
    ssims = [t.get("ssim") for t in good if finite(t.get("ssim"))]
    names = [(t.get("spec") or {}).get("attack") for t in trials]
    return AttackScore(
        attack=label, rmse=_mean(rmses) if good else math.nan,
        psnr=_mean(t.get("psnr") for t in good) if good else math.nan,
        ssim=_mean(ssims) if ssims else None, trials=len(good), failed=len(bad),
        not_applicable=(na[0].get("error") or "not applicable") if na and not good else None,
        rmse_std=float(np.std(rmses, ddof=1)) if len(rmses) > 1 else None,
        reasons=list(dict.fromkeys(_reason(t) for t in bad)),
        timed_out=sum(t.get("status") == "timed out" for t in trials),
        chance_rmse=_mean(_chance(t) for t in good), name=next((n for n in names if n), label),
        per_batch=pb, chance_per_batch=cb, per_image=per_image,
        metric=TEXT_METRIC if any(is_text_row(t) for t in trials) else "rmse",
        ci=bootstrap_mean(pb[k] for k in sorted(pb)), margin=paired_bootstrap(cb, pb))


def is_public(row: Mapping[str, Any]) -> bool:
    """A federated sweep's public-client row: the attack's power at a checkpoint, never part of S_D."""
    return ((row.get("spec") or {}).get("client") or row.get("client")) == "public"


def attack_scores(rows: Iterable[Mapping[str, Any]], *, public: bool = False) -> dict[tuple, list[AttackScore]]:
    """(threat model, dataset, model, defense, batch size) → the scores of every attack with rows there (with
    ``public``, of the public client's rows only: the attack's power, :func:`strongest`)."""
    groups: dict[tuple, dict[str, list[Mapping]]] = {}
    for r in rows:
        if (r.get("kind") or "attack") != "attack" or is_public(r) != public:
            continue
        r = scored(r)
        setting = (threat_model(r), r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none",
                   batch_size(r))
        groups.setdefault(setting, {}).setdefault(r.get("attack") or "", []).append(r)
    return {setting: sorted((_score(name, trials) for name, trials in by_attack.items()), key=_rank)
            for setting, by_attack in groups.items()}


def _is_matching(name: str) -> bool | None:
    """Whether the registered attack ``name`` is gradient matching (None: not a registered attack)."""
    from ...attacks import ATTACKS

    try:
        return bool(getattr(ATTACKS.get(name), "matching", False))
    except (KeyError, ValueError):
        return None


INCOMPLETE = ("no gradient-matching attack ran on this model (it applies to every differentiable model): S_D "
              "here is a lower bound on leakage from an incomplete attack set")


def _capped(values: Mapping[tuple, float], chance: Mapping[tuple, float]) -> dict[tuple, float]:
    return {k: min(v, chance[k]) if k in chance else v for k, v in values.items()}


#: an observation whose shared tensors have a smaller norm carries nothing an attack could use (float32 noise)
TINY_UPDATE = 1e-6


def strongest(rows: Iterable[Mapping[str, Any]]) -> list[Strongest]:
    """S_D per setting (the paper's Table 4 highlight), settings in first-seen order.

    A setting is credited with stopping every attack only where the attack could have seen something:
    where a federated sweep measured the attack's power on the public client at the same checkpoint
    (:attr:`Strongest.power`), that power must be significantly above chance, and no observation may be too small
    to carry anything (median update norm below :data:`TINY_UPDATE`, a converged model); otherwise
    :attr:`Strongest.undetermined` says why there is no verdict.
    """
    rows = list(rows)
    result = _strongest(rows)
    power = {_setting(p): p for p in _strongest(rows, public=True)}
    norms: dict[tuple, list[float]] = {}
    for r in rows:
        v = (r.get("metrics") or {}).get("update_norm")
        if (r.get("kind") or "attack") == "attack" and not is_public(r) and usable(r) and finite(v):
            r = scored(r)
            norms.setdefault((threat_model(r), r.get("dataset") or "", r.get("model") or "",
                              r.get("defense") or "none", batch_size(r)), []).append(float(v))
    for s in result:
        s.power = power.get(_setting(s))
        norm = float(np.median(norms[_setting(s)])) if norms.get(_setting(s)) else None
        s.update_norm = norm
        if s.stops and norm is not None and norm < TINY_UPDATE:
            s.stops = False
            s.undetermined = (f"the shared update's norm is {norm:.2g}: too small to carry anything (a converged "
                              "model), not evidence that the defense stops the attack")
        elif s.stops and s.power is not None and not s.power.sees:
            p = s.power
            s.stops = False
            s.undetermined = (f"the strongest attack cannot see at this checkpoint: on public images S_D "
                              f"{p.sd.mean if p.sd.n else p.rmse:.3g} against chance {_fmt(p.chance_rmse)} "
                              f"(n = {p.n}) — no verdict")
    return result


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if finite(value) else "?"


def _setting(s: Strongest) -> tuple:
    return (s.threat_model, s.dataset, s.model, s.defense, s.batch_size)


def _strongest(rows: list[Mapping[str, Any]], *, public: bool = False) -> list[Strongest]:
    result = []
    ran: dict[tuple, set[str]] = {}  # (threat, dataset, model) → registry names of attacks with usable trials
    scored = attack_scores(rows, public=public)
    for (threat, dataset, model, _d, _b), scores in scored.items():
        ran.setdefault((threat, dataset, model), set()).update(s.name for s in scores if s.trials)
    for (threat, dataset, model, defense, size), scores in scored.items():
        ok = [s for s in scores if s.trials > 0 and finite(s.rmse)]
        best = min(ok, key=_rank) if ok else None
        s = Strongest(dataset=dataset, model=model, defense=defense, batch_size=size,
                      attack=best.attack if best else None, rmse=best.rmse if best else math.nan,
                      psnr=best.psnr if best else math.nan, ssim=best.ssim if best else None,
                      scores=scores, threat_model=threat, chance_rmse=best.chance_rmse if best else None,
                      metric=best.metric if best else (scores[0].metric if scores else "rmse"))
        if best is not None:
            s.sd_per_batch = _capped(best.per_batch, best.chance_per_batch)
            s.sd = bootstrap_mean(s.sd_per_batch[k] for k in sorted(s.sd_per_batch))
            # per image: the lowest RMSE any attack reached, capped at the image's chance, averaged per batch
            images: dict[tuple, float] = {}
            for a in ok:
                for key, (v, c) in a.per_image.items():
                    v = min(v, c) if finite(c) else v
                    images[key] = min(images.get(key, math.inf), v)
            by_batch: dict[tuple, list[float]] = {}
            for (seed, batch, _i), v in images.items():
                by_batch.setdefault((seed, batch), []).append(v)
            s.per_image_per_batch = {k: sum(v) / len(v) for k, v in by_batch.items()}
            s.per_image = bootstrap_mean(s.per_image_per_batch[k] for k in sorted(s.per_image_per_batch))
            s.stops = s.sd.n >= MIN_N and not any(a.below_chance for a in ok)
        kinds = [_is_matching(n) for n in ran.get((threat, dataset, model), ())]
        if threat in ("eavesdropper", "informed-eavesdropper") and kinds and all(k is False for k in kinds):
            s.incomplete = INCOMPLETE
        result.append(s)
    return result


# ----------------------------------------------------------------------------- utility

UTILITY_METRICS = ("train_loss", "train_accuracy", "test_accuracy", "epsilon", "samples_seen")


def _utility_seed(row: Mapping[str, Any]) -> int:
    spec = row.get("spec") or {}
    seed = (spec.get("utility") or {}).get("seed", row.get("seed", 0))
    return int(seed) if finite(seed) else 0


def diverged(row: Mapping[str, Any]) -> str | None:
    """Why a utility run diverged (a non-finite training loss, or one above the untrained model's), else None."""
    m = row.get("metrics") or {}
    if m.get("diverged"):
        return str(m["diverged"])
    if row.get("status") == "failed" and "non-finite" in (row.get("error") or ""):
        return "non-finite training loss"
    loss, start = m.get("train_loss"), m.get("initial_loss")
    if row.get("status") == "done":
        if not finite(loss):
            return "non-finite training loss"
        if finite(start) and loss > start:
            return f"final training loss {loss:.3g} above the untrained model's {start:.3g}"
    return None


def utility_table(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(dataset, model, defense, batch size) → utility over the training seeds of that setting.

    Each entry: the mean of every :data:`UTILITY_METRICS` over the usable seeds, ``trials`` (seeds averaged),
    ``per_seed`` (seed → metrics), ``train_loss_ci`` / ``test_accuracy_ci`` (Student-t over seeds) and
    ``diverged`` (the reason, for k of n seeds, or None).  A diverged setting has no utility means.
    Batch size 0 = a utility that applies to every batch size.
    """
    groups: dict[tuple, dict[int, Mapping[str, Any]]] = {}
    broken: dict[tuple, list[str]] = {}
    for r in rows:
        if r.get("kind") != "utility":
            continue
        key = (r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none", batch_size(r))
        why = diverged(r)
        if why is not None:
            broken.setdefault(key, []).append(why)
            groups.setdefault(key, {})
            continue
        metrics = r.get("metrics") or {}
        if r.get("status") == "done" and finite(metrics.get("train_loss")):
            groups.setdefault(key, {})[_utility_seed(r)] = metrics
    out: dict[tuple, dict[str, Any]] = {}
    for key in dict.fromkeys([*groups, *broken]):
        seeds = groups.get(key, {})
        why = broken.get(key)
        entry: dict[str, Any] = {"per_seed": dict(seeds), "trials": len(seeds), "diverged": None}
        if why:
            n = len(why) + len(seeds)
            entry["diverged"] = f"{len(why)} of {n} seed(s): {why[0]}"
            entry.update({name: None for name in UTILITY_METRICS})
            entry["epsilon"] = _mean(m.get("epsilon") for m in seeds.values())
            entry["train_loss_ci"] = entry["test_accuracy_ci"] = EMPTY
        else:
            entry.update({name: _mean(m.get(name) for m in seeds.values()) for name in UTILITY_METRICS})
            entry["train_loss_ci"] = t_mean(m.get("train_loss") for m in seeds.values() if finite(m.get("train_loss")))
            entry["test_accuracy_ci"] = t_mean(m.get("test_accuracy") for m in seeds.values()
                                               if finite(m.get("test_accuracy")))
        out[key] = entry
    return out


def utility_for(table: Mapping[tuple, Mapping[str, Any]], dataset: str, model: str, defense: str,
                size: int) -> Mapping[str, Any] | None:
    """The utility of a defense setting at a batch size, else the batch-size-0 one, else None."""
    return table.get((dataset, model, defense, size)) or table.get((dataset, model, defense, 0))


def bounds_table(rows: Iterable[Mapping[str, Any]], *, metric: str = "exact_rmse") -> dict[tuple, float]:
    """(threat model, dataset, model, defense, batch size) → mean Cramér–Rao value of the finished bound trials.

    The Cramér–Rao value bounds the RMSE of *unbiased* estimators only; box-clamped attacks can beat it.
    """
    values: dict[tuple, list[float]] = {}
    for r in rows:
        v = (r.get("metrics") or {}).get(metric)
        if r.get("kind") == "bound" and r.get("status") == "done" and finite(v):
            key = (threat_model(r), r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none",
                   batch_size(r))
            values.setdefault(key, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in values.items()}


@dataclass(frozen=True)
class UtilityLoss:
    """What a defense costs: the training-loss increase over the undefended run of the same seed (paired).

    ``interval`` is the Student-t interval over seeds (``EMPTY`` when unmeasured or diverged); ``diverged`` says
    why the defended (or undefended) training diverged.  ``none`` costs exactly 0.
    """

    interval: Interval = EMPTY
    diverged: str | None = None

    @property
    def mean(self) -> float | None:
        return self.interval.mean if self.interval.n and finite(self.interval.mean) else None

    @property
    def measured(self) -> bool:
        return self.diverged is None and self.mean is not None

    def within(self, budget: float) -> bool:
        """The cost fits ``budget``: any measured, non-diverged cost at u = inf; else the interval's upper end ≤ u."""
        if not self.measured:
            return False
        if math.isinf(budget):
            return True
        return self.interval.known and self.interval.high <= budget

    def at_edge(self, budget: float) -> bool:
        """The cost may or may not fit a finite ``budget`` at this n: not :meth:`within` it, yet its interval's
        lower end (the mean, with one seed) is ≤ u."""
        if not self.measured or math.isinf(budget) or self.within(budget):
            return False
        low = self.interval.low if self.interval.known else self.mean
        return low is not None and low <= budget

    @property
    def gain(self) -> bool:
        """The measured change is negative (a gain); :attr:`interval` says whether it overlaps zero."""
        return self.mean is not None and self.mean < 0


def utility_loss(table: Mapping[tuple, Mapping[str, Any]], dataset: str, model: str, defense: str,
                 size: int) -> UtilityLoss:
    """The defense's :class:`UtilityLoss` at batch size ``size`` (paired by training seed)."""
    u = utility_for(table, dataset, model, defense, size)
    base = utility_for(table, dataset, model, "none", size)
    if u is None:
        return UtilityLoss()
    if u.get("diverged"):
        return UtilityLoss(diverged=u["diverged"])
    if defense == "none":
        n = int(u.get("trials") or 0)
        return UtilityLoss(Interval(0.0, 0.0, 0.0, n, "t"))
    if base is None:
        return UtilityLoss()
    if base.get("diverged"):
        return UtilityLoss(diverged=f"the undefended run diverged ({base['diverged']})")
    loss = {s: m.get("train_loss") for s, m in (u.get("per_seed") or {}).items() if finite(m.get("train_loss"))}
    ref = {s: m.get("train_loss") for s, m in (base.get("per_seed") or {}).items() if finite(m.get("train_loss"))}
    if paired(loss, ref):
        return UtilityLoss(paired_t(loss, ref))
    return UtilityLoss()


@dataclass
class PrivacyUtilityPoint:
    """A dot of Figure 3: a defense setting at one batch size, its S_D and utility loss, each with an interval.

    ``rmse`` is S_D capped at chance (the strongest attack's mean, or chance when the attack does worse);
    ``utility_loss`` the mean paired training-loss increase (None where unmeasured or diverged; ``diverged``
    says why); ``utility`` the whole :class:`UtilityLoss`.
    """

    dataset: str
    model: str
    defense: str
    batch_size: int
    attack: str | None
    rmse: float
    train_loss: float | None
    train_loss_increase: float | None
    test_accuracy: float | None
    accuracy_drop: float | None
    bound: float | None = None
    threat_model: str = "eavesdropper"
    utility_loss: float | None = None
    gain: bool = False
    epsilon: float | None = None
    chance_rmse: float | None = None
    sd: Interval = EMPTY
    utility: UtilityLoss = field(default_factory=UtilityLoss)
    diverged: str | None = None
    stops: bool = False
    sd_per_batch: dict[tuple, float] = field(default_factory=dict)
    per_image: Interval = EMPTY
    incomplete: str | None = None
    test_accuracy_ci: Interval = EMPTY
    #: what ``rmse`` measures (``"rmse"``, or ``"token_error"`` = 1 − token accuracy for text)
    metric: str = "rmse"
    #: why no attack beating chance here is no evidence (:attr:`Strongest.undetermined`), else None
    undetermined: str | None = None

    @property
    def family(self) -> str:
        return defense_family(self.defense)[0]


def privacy_utility(best: Iterable[Strongest], utility: Mapping[tuple, Mapping[str, Any]],
                    bounds: Mapping[tuple, float] | None = None) -> list[PrivacyUtilityPoint]:
    """One point per S_D setting; utility loss against the undefended run of the same dataset, model, B and seed."""
    points = []
    for s in best:
        u = utility_for(utility, s.dataset, s.model, s.defense, s.batch_size) or {}
        base = utility_for(utility, s.dataset, s.model, "none", s.batch_size) or {}

        def diff(key: str, sign: float, u=u, base=base) -> float | None:
            a, b = u.get(key), base.get(key)
            return sign * (a - b) if finite(a) and finite(b) else None

        cost = utility_loss(utility, s.dataset, s.model, s.defense, s.batch_size)
        rmse = s.sd.mean if s.sd.n else s.rmse
        points.append(PrivacyUtilityPoint(
            dataset=s.dataset, model=s.model, defense=s.defense, batch_size=s.batch_size, attack=s.attack,
            rmse=rmse, train_loss=u.get("train_loss"), train_loss_increase=cost.mean,
            test_accuracy=u.get("test_accuracy"), accuracy_drop=diff("test_accuracy", -1.0),
            bound=(bounds or {}).get((s.threat_model, s.dataset, s.model, s.defense, s.batch_size)),
            threat_model=s.threat_model, utility_loss=cost.mean if cost.measured else None, gain=cost.gain,
            epsilon=u.get("epsilon"), chance_rmse=s.chance_rmse, sd=s.sd, utility=cost,
            diverged=cost.diverged, stops=s.stops, sd_per_batch=dict(s.sd_per_batch), per_image=s.per_image,
            incomplete=s.incomplete, test_accuracy_ci=u.get("test_accuracy_ci") or EMPTY, metric=s.metric,
            undetermined=s.undetermined))
    return points


def dominates(a: PrivacyUtilityPoint, b: PrivacyUtilityPoint) -> bool:
    """``a`` leaks no more (RMSE ≥) at no higher utility loss (≤) than ``b``, and strictly better in one."""
    return (a.rmse >= b.rmse and a.utility_loss <= b.utility_loss
            and (a.rmse > b.rmse or a.utility_loss < b.utility_loss))


def pareto_front(points: Iterable[PrivacyUtilityPoint]) -> list[PrivacyUtilityPoint]:
    """The points with finite RMSE and utility loss that no other such point dominates, by utility loss.

    Call it on the points of one (threat model, dataset, model, batch size): the front is a choice among
    defenses for one attacker and one batch size.  Diverged settings have no utility loss and never enter.
    """
    pts = [p for p in points if finite(p.rmse) and finite(p.utility_loss)]
    front = [p for p in pts if not any(dominates(q, p) for q in pts)]
    return sorted(front, key=lambda p: (p.utility_loss, -p.rmse, p.defense))


# ----------------------------------------------------------------------------- the verdict

#: what a verdict found: every candidate stops the attacks / one leaks significantly least / a statistical tie /
#: no candidate within the budget / nothing measured enough to decide (n < MIN_N).
VERDICT_STATUSES = ("stops", "decided", "tied", "none", "undecided", "undetermined")


@dataclass
class Verdict:
    """The answer for one (threat model, dataset, model, batch size) at a utility budget.

    ``status``: ``stops`` (``defense`` is the cheapest setting that stops every attack run here; ``tied`` lists
    the others that do), ``decided`` (``defense`` has the highest S_D, significantly above every other
    candidate), ``tied`` (``defense`` has the highest mean S_D but ``tied`` are not significantly below it),
    ``undecided`` (too few batches), ``undetermined`` (the pick leaks least only because the attack cannot see at
    this checkpoint: ``undetermined`` says why) or ``none`` (no candidate fits the budget).  ``margin``: S_D of the pick
    minus the next candidate's (paired by batch) — or, for ``stops``, the undefended run's distance from
    chance.  ``n``: the batches the pick rests on; ``seeds``: the training seeds of its utility.  ``edge``:
    settings whose cost interval straddles the budget (:meth:`UtilityLoss.at_edge`) and that would be named or
    tied if admitted — a ``decided`` verdict with an edge is reported as ``tied``: more training seeds decide it.
    """

    threat_model: str
    dataset: str
    model: str
    batch_size: int
    budget: float
    defense: str | None
    attack: str | None
    rmse: float | None
    utility_loss: float | None
    baseline_rmse: float | None
    baseline_attack: str | None
    gain: bool = False
    epsilon: float | None = None
    chance_rmse: float | None = None
    baseline_chance: float | None = None
    status: str = "none"
    tied: list[str] = field(default_factory=list)
    margin: Interval = EMPTY
    n: int = 0
    seeds: int = 0
    sd: Interval = EMPTY
    utility: UtilityLoss = field(default_factory=UtilityLoss)
    excluded: dict[str, str] = field(default_factory=dict)
    incomplete: str | None = None
    baseline_sd: Interval = EMPTY
    #: what ``rmse`` and ``sd`` measure (``"rmse"``, or ``"token_error"`` = 1 − token accuracy for text)
    metric: str = "rmse"
    edge: list[str] = field(default_factory=list)
    #: why the pick's result is no evidence (status ``undetermined``), else None
    undetermined: str | None = None


def _cost_key(p: PrivacyUtilityPoint) -> float:
    return p.utility_loss if finite(p.utility_loss) else math.inf


def _decide(pts: Sequence[PrivacyUtilityPoint]) -> tuple[str, PrivacyUtilityPoint, list[str], Interval]:
    """(status, pick, tied/equivalent defenses, margin) among candidates ``pts`` (non-empty)."""
    stopping = [p for p in pts if p.stops]
    if stopping:
        pick = min(stopping, key=lambda p: (_cost_key(p), -p.rmse, p.defense != "none"))
        return "stops", pick, sorted(p.defense for p in stopping if p is not pick), pick.sd
    if max(p.sd.n for p in pts) < MIN_N:
        pick = max(pts, key=lambda p: p.rmse)
        return "undecided", pick, sorted(p.defense for p in pts if p is not pick and p.rmse == pick.rmse), EMPTY
    enough = [p for p in pts if p.sd.n >= MIN_N] or list(pts)
    top = max(p.rmse for p in enough)
    leaders = [p for p in enough if p.rmse == top]
    pick = min(leaders, key=lambda p: (_cost_key(p), p.defense))  # an exact tie: the cheaper one is shown first
    tied, margins = [], []
    for p in pts:
        if p is pick:
            continue
        d = paired_bootstrap(pick.sd_per_batch, p.sd_per_batch)
        if not d.above(0.0):
            tied.append(p.defense)
        else:
            margins.append((d.mean, d))
    margin = min(margins, key=lambda m: m[0])[1] if margins else EMPTY
    if pick.undetermined:  # it leaks least because the attack is blind here: no evidence either way
        return "undetermined", pick, sorted(tied), margin
    return ("tied" if tied else "decided"), pick, sorted(tied), margin


def _edge(ok: Sequence[PrivacyUtilityPoint], edge: Sequence[PrivacyUtilityPoint]) -> list[str]:
    """The settings of ``edge`` (cost undetermined at the budget) that would be named or tied beside ``ok``."""
    if not edge:
        return []
    _, pick, tied, _ = _decide([*ok, *edge])
    names = {p.defense for p in edge}
    return sorted(d for d in {pick.defense, *tied} if d in names)


def verdicts(points: Iterable[PrivacyUtilityPoint], budgets: Sequence[float] = BUDGETS) -> list[Verdict]:
    """Per (threat model, dataset, model, batch size) and budget u: the decision among the defenses within u.

    Candidates are the settings whose utility-loss interval lies at or below u (its upper end; ``none`` costs
    0) — diverged ones never, unmeasured ones only at u = inf.  Then (:data:`VERDICT_STATUSES`): the cheapest
    setting that stops every attack (others that do are listed as equivalent), else the highest S_D with every
    setting not significantly below it (paired bootstrap over batches) listed as tied.  Ties are never broken by
    a name.  Settings whose cost interval straddles u and that would be named or tied if admitted are listed as
    ``edge`` (and turn ``decided`` into ``tied``): the budget does not decide between them at this n.
    """
    groups: dict[tuple, list[PrivacyUtilityPoint]] = {}
    for p in points:
        groups.setdefault((p.threat_model, p.dataset, p.model, p.batch_size), []).append(p)
    out = []
    for (threat, dataset, model, size), pts in groups.items():
        base = next((p for p in pts if p.defense == "none" and finite(p.rmse)), None)
        scored = [p for p in pts if finite(p.rmse)]
        excluded = {p.defense: f"diverged: {p.diverged}" for p in scored if p.diverged}
        for u in budgets:
            ok = [p for p in scored if not p.diverged and (p.defense == "none" or p.utility.within(u)
                                                          or (math.isinf(u) and p.utility.mean is None))]
            v = Verdict(threat_model=threat, dataset=dataset, model=model, batch_size=size, budget=u, defense=None,
                        attack=None, rmse=None, utility_loss=None,
                        baseline_rmse=base.rmse if base else None, baseline_attack=base.attack if base else None,
                        baseline_chance=base.chance_rmse if base else None, excluded=dict(excluded),
                        incomplete=next((p.incomplete for p in pts if p.incomplete), None),
                        baseline_sd=base.sd if base else EMPTY, metric=pts[0].metric)
            if ok:
                status, pick, tied, margin = _decide(ok)
                v.status, v.tied, v.margin = status, tied, margin
                v.defense, v.attack, v.rmse, v.utility_loss = pick.defense, pick.attack, pick.rmse, pick.utility_loss
                v.gain, v.epsilon, v.chance_rmse = pick.gain, pick.epsilon, pick.chance_rmse
                v.n, v.sd, v.utility, v.seeds = pick.sd.n, pick.sd, pick.utility, pick.utility.interval.n
                v.undetermined = pick.undetermined if status == "undetermined" else None
            if not (v.status == "stops" and v.defense == "none"):  # nothing needed: no other setting matters
                v.edge = _edge(ok, [p for p in scored
                                    if not p.diverged and p.defense != "none" and p.utility.at_edge(u)])
            if v.edge and v.status == "decided":
                v.status = "tied"
            out.append(v)
    return out


# ----------------------------------------------------------------------------- published weights, membership


@dataclass
class WeightsSummary:
    """Counts of one weights attack on one trained target, summed over its usable trials, with their controls.

    ``members_nn`` / ``nonmembers_nn``: training points / non-members that are the nearest neighbour (among
    both) of some reconstruction (the latter is the chance level); ``members_ssim[t]`` / ``control_ssim[t]``:
    training points matched at SSIM ≥ t by some reconstruction / by non-member images used as candidates.
    """

    dataset: str
    model: str
    defense: str
    attack: str
    trials: int = 0
    failed: int = 0
    reasons: list[str] = field(default_factory=list)
    n_train: int = 0
    n_nonmembers: int = 0
    candidates: int = 0
    diverged: int = 0
    members_nn: int = 0
    nonmembers_nn: int = 0
    members_ssim: dict[float, int] = field(default_factory=dict)
    control_ssim: dict[float, int] = field(default_factory=dict)
    kkt_residual: float | None = None
    rows: list[Mapping[str, Any]] = field(default_factory=list)


def _int(value: Any) -> int:
    return int(value) if finite(value) else 0


def _tally(summary: Any, row: Mapping[str, Any], usable_row: bool) -> bool:
    """Count ``row`` into a weights/membership summary: a usable trial (True) or a failure with its reason."""
    if not usable_row:
        summary.failed += 1
        summary.reasons = list(dict.fromkeys([*summary.reasons, _reason(row)]))
        return False
    summary.trials += 1
    summary.rows.append(row)
    return True


def weights_table(rows: Iterable[Mapping[str, Any]]) -> list[WeightsSummary]:
    """One :class:`WeightsSummary` per (dataset, model, defense, attack) of the ``weights`` rows."""
    out: dict[tuple, WeightsSummary] = {}
    residuals: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("kind") != "weights":
            continue
        key = (r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none", r.get("attack") or "")
        s = out.setdefault(key, WeightsSummary(*key))
        m = r.get("metrics") or {}
        if not _tally(s, r, r.get("status") == "done" and finite(m.get("n_train"))):
            continue
        for name in ("n_train", "n_nonmembers", "candidates", "diverged", "members_nn", "nonmembers_nn"):
            setattr(s, name, getattr(s, name) + _int(m.get(name)))
        for t in SSIM_THRESHOLDS:
            s.members_ssim[t] = s.members_ssim.get(t, 0) + _int(m.get(f"members_ssim_{t}"))
            s.control_ssim[t] = s.control_ssim.get(t, 0) + _int(m.get(f"control_ssim_{t}"))
        if finite(m.get("kkt_residual")):
            residuals.setdefault(key, []).append(float(m["kkt_residual"]))
    for key, vals in residuals.items():
        out[key].kkt_residual = sum(vals) / len(vals)
    return list(out.values())


@dataclass
class MembershipScore:
    """A membership attack in one margin-knowledge setting: mean AUC and TPR at low FPR over usable trials."""

    dataset: str
    model: str
    defense: str
    setting: str
    auc: float | None = None
    tpr_at_1pct: float | None = None
    tpr_at_01pct: float | None = None
    members: int = 0
    nonmembers: int = 0
    trials: int = 0
    failed: int = 0
    reasons: list[str] = field(default_factory=list)
    rows: list[Mapping[str, Any]] = field(default_factory=list)


def membership_setting(row: Mapping[str, Any]) -> str:
    """The margin-knowledge setting of a membership row (``spec.options.setting``, else its attack label)."""
    options = (row.get("spec") or {}).get("options") or {}
    return str(options.get("setting") or row.get("attack") or "membership-margin")


def membership_table(rows: Iterable[Mapping[str, Any]]) -> list[MembershipScore]:
    """One :class:`MembershipScore` per (dataset, model, defense, setting) of the margin attack's ``membership``
    rows (the reference-model rows are :func:`~.membership_verdict.membership_defenses`')."""
    out: dict[tuple, MembershipScore] = {}
    values: dict[tuple, dict[str, list]] = {}
    for r in rows:
        if r.get("kind") != "membership" or ((r.get("spec") or {}).get("membership") or {}).get("form") == "reference":
            continue  # reference-model rows: :mod:`.membership_verdict`
        key = (r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none", membership_setting(r))
        s = out.setdefault(key, MembershipScore(*key))
        m = r.get("metrics") or {}
        if not _tally(s, r, r.get("status") == "done" and finite(m.get("auc"))):
            continue
        s.members += _int(m.get("members"))
        s.nonmembers += _int(m.get("nonmembers"))
        for name in ("auc", "tpr_at_fpr_0.01", "tpr_at_fpr_0.001"):
            values.setdefault(key, {}).setdefault(name, []).append(m.get(name))
    for key, v in values.items():
        out[key].auc = _mean(v.get("auc", []))
        out[key].tpr_at_1pct = _mean(v.get("tpr_at_fpr_0.01", []))
        out[key].tpr_at_01pct = _mean(v.get("tpr_at_fpr_0.001", []))
    return list(out.values())


def roc_curve(scores: Any, is_member: Any) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) at every threshold on ``scores`` (higher = member), from (0, 0) to (1, 1).

    Raises ``ValueError`` unless both classes are present, lengths match and every score is finite.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    m = np.asarray(is_member).astype(bool).ravel()
    if s.shape != m.shape or not np.isfinite(s).all():
        raise ValueError(f"expected finite scores, one per is_member flag; got {s.shape} and {m.shape}")
    pos, neg = int(m.sum()), int((~m).sum())
    if pos == 0 or neg == 0:
        raise ValueError("expected members and non-members both present")
    order = np.argsort(-s, kind="stable")
    s, m = s[order], m[order]
    last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]  # the last index of each distinct score
    tp = np.cumsum(m)[last]
    fp = np.cumsum(~m)[last]
    return np.r_[0.0, fp / neg], np.r_[0.0, tp / pos]


__all__ = ["THREAT_MODELS", "BUDGETS", "SSIM_THRESHOLDS", "UTILITY_METRICS", "AttackScore", "Strongest",
           "PrivacyUtilityPoint", "Verdict", "WeightsSummary", "MembershipScore", "finite", "threat_model",
           "batch_size", "usable", "npz_path", "beats_chance", "attack_scores", "strongest", "utility_table",
           "utility_for", "bounds_table", "utility_loss", "privacy_utility", "dominates", "pareto_front",
           "verdicts", "weights_table", "membership_setting", "membership_table", "roc_curve", "scored",
           "is_text_row", "TEXT_METRIC"]
