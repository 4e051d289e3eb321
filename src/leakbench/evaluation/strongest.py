"""The strongest attack S_D per threat model and defense setting, utility, the Pareto front and the verdict.

Liu et al. (2024), eq. (3): S_D = max over attacks A of the reconstruction
quality d(S, A(D(G))).  As in the paper's Table 4, for each setting — (threat
model, dataset, model, defense, batch size) — the strongest attack is the one
with the lowest mean RMSE over its usable trials (ties broken by higher PSNR,
then higher SSIM).  Attack rows of different threat models are different
settings: an attack that needs a malicious server is never the strongest
attack against an eavesdropper.

A trial is *usable* when its status is ``done`` and its RMSE is finite.  Trials
with any other status (``failed``, ``n/a``, ``timed out``, ...) or a non-finite
value are counted beside the attack's score (``failed``, with the reasons) and
never averaged in; an attack with no usable trial is never selected.  Beside each score sits its chance
level (``chance_rmse`` of the rows: a flat image at the data mean); an RMSE not below it means the attack
learnt nothing about the batch (:func:`beats_chance`), and the report says so.

Utility (Table 5) is joined to a setting on (dataset, model, defense, batch
size), falling back to batch size 0 (a store whose utility applies to every
batch size).  The utility loss of Figure 3 is the increase of the final
training loss over the undefended run at the same batch size.  A *negative*
increase is not shown as a benefit: it is clamped to 0 and flagged
(:attr:`PrivacyUtilityPoint.gain`), since defended and undefended runs train
on the same samples and a lower loss is run-to-run noise.

:func:`pareto_front` keeps the settings no other setting dominates in
(higher best-attack RMSE, lower utility loss); :func:`verdicts` answers, per
utility budget u in :data:`BUDGETS` (training-loss increase in nats, plus "any
cost"), which defense leaks least against the strongest attack.

Published-weights rows (kind ``weights``) and membership rows (kind
``membership``) are summed per (dataset, model, defense, attack) by
:func:`weights_table` and :func:`membership_table`; :func:`roc_curve` gives a
membership attack's ROC.  Everything here is a pure function of rows as
returned by :meth:`~.store.Store.rows`; missing keys take their defaults.
"""
from __future__ import annotations

import math
import numbers
import statistics
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .plan import defense_family
from .published import SSIM_THRESHOLDS
from .trial import THREAT_MODELS
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


def usable(row: Mapping[str, Any]) -> bool:
    """A finished attack trial with a finite RMSE."""
    return row.get("status") == "done" and finite(row.get("rmse"))


def npz_path(row: Mapping[str, Any]) -> str | None:
    """The row's saved arrays (``npz`` column, or ``images["npz"]``), None when it has none."""
    images = row.get("images")
    path = row.get("npz") or (images.get("npz") if isinstance(images, Mapping) else None)
    return str(path) if path else None


def _reason(row: Mapping[str, Any]) -> str:
    status = row.get("status") or "unknown"
    if status == "done":
        return "non-finite result (NaN/inf)"
    error = (row.get("error") or "").strip().splitlines()
    return f"{status}: {error[0]}" if error else str(status)


def _mean(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if finite(v)]
    return sum(vals) / len(vals) if vals else None


@dataclass
class AttackScore:
    """One attack's mean scores on one setting (over its usable trials)."""

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


@dataclass
class Strongest:
    """S_D for one setting: the best attack and every attack's scores."""

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

    @property
    def family(self) -> str:
        return defense_family(self.defense)[0]

    @property
    def beats_chance(self) -> bool | None:
        """False when the strongest attack is no closer than a flat image at the data mean (None: unknown)."""
        return beats_chance(self.rmse, self.chance_rmse)

    @property
    def parameter(self) -> str:
        return defense_family(self.defense)[1]


@dataclass
class PrivacyUtilityPoint:
    """A dot of Figure 3: a defense setting at one batch size, its best-attack RMSE and utility loss.

    ``train_loss_increase`` is the measured difference; ``utility_loss`` the same clamped at 0 (``gain`` is
    True where it was negative); None where utility was not measured (``none`` always costs 0).
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

    @property
    def family(self) -> str:
        return defense_family(self.defense)[0]


@dataclass
class Verdict:
    """The answer for one (threat model, dataset, model, batch size) at a utility budget."""

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


def attack_scores(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, list[AttackScore]]:
    """(threat model, dataset, model, defense, batch size) → the scores of every attack with rows there."""
    groups: dict[tuple, dict[str, list[Mapping]]] = {}
    for r in rows:
        if (r.get("kind") or "attack") != "attack":
            continue
        setting = (threat_model(r), r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none",
                   batch_size(r))
        groups.setdefault(setting, {}).setdefault(r.get("attack") or "", []).append(r)
    out: dict[tuple, list[AttackScore]] = {}
    for setting, by_attack in groups.items():
        scores = []
        for name, trials in by_attack.items():
            good = [t for t in trials if usable(t)]
            na = [t for t in trials if t.get("status") == "n/a"]
            bad = [t for t in trials if not usable(t) and t.get("status") != "n/a"]
            rmses = [float(t["rmse"]) for t in good]
            ssims = [t.get("ssim") for t in good if finite(t.get("ssim"))]
            scores.append(AttackScore(
                attack=name, rmse=_mean(rmses) if good else math.nan,
                psnr=_mean(t.get("psnr") for t in good) if good else math.nan,
                ssim=_mean(ssims) if ssims else None, trials=len(good), failed=len(bad),
                not_applicable=(na[0].get("error") or "not applicable") if na and not good else None,
                rmse_std=statistics.stdev(rmses) if len(rmses) > 1 else None,
                reasons=list(dict.fromkeys(_reason(t) for t in bad)),
                timed_out=sum(t.get("status") == "timed out" for t in trials),
                chance_rmse=_mean((t.get("metrics") or {}).get("chance_rmse") for t in good)))
        out[setting] = sorted(scores, key=_rank)
    return out


def strongest(rows: Iterable[Mapping[str, Any]]) -> list[Strongest]:
    """S_D per setting (the paper's Table 4 highlight), settings in first-seen order."""
    result = []
    for (threat, dataset, model, defense, size), scores in attack_scores(rows).items():
        ok = [s for s in scores if s.trials > 0 and finite(s.rmse)]
        best = min(ok, key=_rank) if ok else None
        result.append(Strongest(dataset=dataset, model=model, defense=defense, batch_size=size,
                                attack=best.attack if best else None, rmse=best.rmse if best else math.nan,
                                psnr=best.psnr if best else math.nan, ssim=best.ssim if best else None,
                                scores=scores, threat_model=threat,
                                chance_rmse=best.chance_rmse if best else None))
    return result


UTILITY_METRICS = ("train_loss", "train_accuracy", "test_accuracy", "epsilon", "samples_seen")


def utility_table(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, float | None]]:
    """(dataset, model, defense, batch size) → mean utility metrics of the usable utility trials.

    A utility trial is usable when it is ``done`` with a finite training loss.  Batch size 0 = a utility
    that applies to every batch size.  ``trials`` counts the trials averaged.
    """
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        metrics = r.get("metrics") or {}
        if r.get("kind") == "utility" and r.get("status") == "done" and finite(metrics.get("train_loss")):
            key = (r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none", batch_size(r))
            groups.setdefault(key, []).append(metrics)
    return {key: {**{name: _mean(m.get(name) for m in ms) for name in UTILITY_METRICS}, "trials": len(ms)}
            for key, ms in groups.items()}


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


def utility_loss(table: Mapping[tuple, Mapping[str, Any]], dataset: str, model: str, defense: str,
                 size: int) -> tuple[float | None, float | None, bool]:
    """(measured training-loss increase over ``none``, the same clamped at 0, True if it was a gain).

    ``none`` costs 0 by definition; (None, None, False) where either training was not measured.
    """
    u = utility_for(table, dataset, model, defense, size) or {}
    base = utility_for(table, dataset, model, "none", size) or {}
    a, b = u.get("train_loss"), base.get("train_loss")
    increase = a - b if finite(a) and finite(b) else None
    if defense == "none":
        return increase, 0.0, False
    return increase, None if increase is None else max(0.0, increase), increase is not None and increase < 0


def privacy_utility(best: Iterable[Strongest], utility: Mapping[tuple, Mapping[str, Any]],
                    bounds: Mapping[tuple, float] | None = None) -> list[PrivacyUtilityPoint]:
    """One point per S_D setting; utility loss against the undefended run of the same dataset, model and B."""
    points = []
    for s in best:
        u = utility_for(utility, s.dataset, s.model, s.defense, s.batch_size) or {}
        base = utility_for(utility, s.dataset, s.model, "none", s.batch_size) or {}

        def diff(key: str, sign: float, u=u, base=base) -> float | None:
            a, b = u.get(key), base.get(key)
            return sign * (a - b) if finite(a) and finite(b) else None

        increase, loss, gain = utility_loss(utility, s.dataset, s.model, s.defense, s.batch_size)
        points.append(PrivacyUtilityPoint(
            dataset=s.dataset, model=s.model, defense=s.defense, batch_size=s.batch_size, attack=s.attack,
            rmse=s.rmse, train_loss=u.get("train_loss"), train_loss_increase=increase,
            test_accuracy=u.get("test_accuracy"), accuracy_drop=diff("test_accuracy", -1.0),
            bound=(bounds or {}).get((s.threat_model, s.dataset, s.model, s.defense, s.batch_size)),
            threat_model=s.threat_model, utility_loss=loss, gain=gain,
            epsilon=u.get("epsilon"), chance_rmse=s.chance_rmse))
    return points


def dominates(a: PrivacyUtilityPoint, b: PrivacyUtilityPoint) -> bool:
    """``a`` leaks no more (RMSE ≥) at no higher utility loss (≤) than ``b``, and strictly better in one."""
    return (a.rmse >= b.rmse and a.utility_loss <= b.utility_loss
            and (a.rmse > b.rmse or a.utility_loss < b.utility_loss))


def pareto_front(points: Iterable[PrivacyUtilityPoint]) -> list[PrivacyUtilityPoint]:
    """The points with finite RMSE and utility loss that no other such point dominates, by utility loss.

    Call it on the points of one (threat model, dataset, model, batch size): the front is a choice among
    defenses for one attacker and one batch size.
    """
    pts = [p for p in points if finite(p.rmse) and finite(p.utility_loss)]
    front = [p for p in pts if not any(dominates(q, p) for q in pts)]
    return sorted(front, key=lambda p: (p.utility_loss, -p.rmse, p.defense))


def verdicts(points: Iterable[PrivacyUtilityPoint], budgets: Sequence[float] = BUDGETS) -> list[Verdict]:
    """Per (threat model, dataset, model, batch size) and budget u: the defense with the highest best-attack RMSE
    among those with utility loss ≤ u (ties: lower loss, then name), and the undefended RMSE beside it.

    A defense whose utility was not measured only competes at u = inf ("any cost").
    """
    groups: dict[tuple, list[PrivacyUtilityPoint]] = {}
    for p in points:
        groups.setdefault((p.threat_model, p.dataset, p.model, p.batch_size), []).append(p)
    out = []
    for (threat, dataset, model, size), pts in groups.items():
        base = next((p for p in pts if p.defense == "none" and finite(p.rmse)), None)
        for u in budgets:
            ok = [p for p in pts if finite(p.rmse)
                  and (finite(p.utility_loss) and p.utility_loss <= u or math.isinf(u))]
            pick = min(ok, key=lambda p: (-p.rmse, p.utility_loss if finite(p.utility_loss) else math.inf,
                                          p.defense)) if ok else None
            out.append(Verdict(threat_model=threat, dataset=dataset, model=model, batch_size=size, budget=u,
                               defense=pick.defense if pick else None, attack=pick.attack if pick else None,
                               rmse=pick.rmse if pick else None, utility_loss=pick.utility_loss if pick else None,
                               baseline_rmse=base.rmse if base else None,
                               baseline_attack=base.attack if base else None,
                               gain=bool(pick and pick.gain), epsilon=pick.epsilon if pick else None,
                               chance_rmse=pick.chance_rmse if pick else None,
                               baseline_chance=base.chance_rmse if base else None))
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
    """One :class:`MembershipScore` per (dataset, model, defense, setting) of the ``membership`` rows."""
    out: dict[tuple, MembershipScore] = {}
    values: dict[tuple, dict[str, list]] = {}
    for r in rows:
        if r.get("kind") != "membership":
            continue
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
           "verdicts", "weights_table", "membership_setting", "membership_table", "roc_curve"]
