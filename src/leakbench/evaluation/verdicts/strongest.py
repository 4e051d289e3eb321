"""The strongest attack S_D per threat model and defense setting, with its n and interval.

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

Utility and its loss are in :mod:`.utility`, the verdict rules in :mod:`.rules`, the tables of published weights
in :mod:`.weights`; everything here is a pure function of rows as returned by :meth:`~..store.Store.rows`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..trials.plan import defense_family
from .rows import (
    TEXT_METRIC,
    _chance,
    _mean,
    _per_image,
    _reason,
    batch_size,
    finite,
    is_text_row,
    scored,
    threat_model,
    unit,
    usable,
)
from .stats import EMPTY, MIN_N, Interval, bootstrap_mean, paired_bootstrap


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


__all__ = ["AttackScore", "Strongest", "beats_chance", "attack_scores", "strongest"]
