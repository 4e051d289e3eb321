"""The strongest attack S_D per defense setting and the privacy–utility points (Liu et al. 2024).

Eq. (3): S_D = max over attacks A of the reconstruction quality d(S, A(D(G)));
as in the paper's Table 4, for each (dataset, model, defense, batch size) the
strongest attack is the one with the lowest mean RMSE over the attacked images
(ties broken by higher PSNR, then higher SSIM).  Attacks that could not run on
the setting (``n/a``) or failed are listed but never selected.  Figure 3 plots
that best RMSE against the defense's utility loss: the increase of the final
training loss (and the drop of test accuracy) relative to ``none``.

Everything here is a pure function of rows as returned by
:meth:`~.store.Store.rows` (dicts with dataset, model, defense, batch_size,
attack, status, rmse, psnr, ssim, error; utility rows carry ``metrics``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from .plan import defense_family


@dataclass
class AttackScore:
    """One attack's mean scores on one setting (over its finished trials)."""

    attack: str
    rmse: float
    psnr: float
    ssim: Optional[float]
    trials: int
    failed: int = 0
    not_applicable: Optional[str] = None


@dataclass
class Strongest:
    """S_D for one (dataset, model, defense, batch size): the best attack and every attack's scores."""

    dataset: str
    model: str
    defense: str
    batch_size: int
    attack: Optional[str]
    rmse: float
    psnr: float
    ssim: Optional[float]
    scores: list[AttackScore] = field(default_factory=list)

    @property
    def family(self) -> str:
        return defense_family(self.defense)[0]

    @property
    def parameter(self) -> str:
        return defense_family(self.defense)[1]


@dataclass
class PrivacyUtilityPoint:
    """A dot of Figure 3: a defense setting at one batch size, its best-attack RMSE and utility loss."""

    dataset: str
    model: str
    defense: str
    batch_size: int
    attack: Optional[str]
    rmse: float
    train_loss: Optional[float]
    train_loss_increase: Optional[float]
    test_accuracy: Optional[float]
    accuracy_drop: Optional[float]
    bound: Optional[float] = None

    @property
    def family(self) -> str:
        return defense_family(self.defense)[0]


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if len(finite) < len(values):  # a diverged reconstruction (NaN) counts as no reconstruction at all
        return float("nan")
    return sum(finite) / len(finite) if finite else float("nan")


def _rank(score: AttackScore) -> tuple:
    """Lower is stronger: RMSE, then −PSNR, then −SSIM; NaN or no trials sort last."""
    def val(v, sign):
        return math.inf if v is None or math.isnan(v) else sign * v
    return (val(score.rmse, 1), val(score.psnr, -1), val(score.ssim, -1), score.attack)


def attack_scores(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, list[AttackScore]]:
    """(dataset, model, defense, batch_size) → the scores of every attack that has rows there."""
    groups: dict[tuple, dict[str, list[Mapping]]] = {}
    for r in rows:
        if r.get("kind", "attack") != "attack":
            continue
        setting = (r["dataset"], r["model"], r["defense"], int(r["batch_size"]))
        groups.setdefault(setting, {}).setdefault(r["attack"], []).append(r)
    out: dict[tuple, list[AttackScore]] = {}
    for setting, by_attack in groups.items():
        scores = []
        for name, trials in by_attack.items():
            done = [t for t in trials if t["status"] == "done"]
            na = [t for t in trials if t["status"] == "n/a"]
            failed = [t for t in trials if t["status"] == "failed"]
            ssims = [t.get("ssim") for t in done]
            scores.append(AttackScore(
                attack=name, rmse=_mean([t.get("rmse") for t in done]), psnr=_mean([t.get("psnr") for t in done]),
                ssim=None if not done or all(s is None for s in ssims) else _mean(ssims), trials=len(done),
                failed=len(failed), not_applicable=(na[0].get("error") or "not applicable") if na and not done else None))
        out[setting] = sorted(scores, key=_rank)
    return out


def strongest(rows: Iterable[Mapping[str, Any]]) -> list[Strongest]:
    """S_D per setting (the paper's Table 4 highlight), settings in first-seen order."""
    result = []
    for (dataset, model, defense, size), scores in attack_scores(rows).items():
        usable = [s for s in scores if s.trials > 0 and not math.isnan(s.rmse)]
        best = min(usable, key=_rank) if usable else None
        result.append(Strongest(dataset=dataset, model=model, defense=defense, batch_size=size,
                                attack=best.attack if best else None,
                                rmse=best.rmse if best else float("nan"),
                                psnr=best.psnr if best else float("nan"),
                                ssim=best.ssim if best else None, scores=scores))
    return result


def utility_table(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, Optional[float]]]:
    """(dataset, model, defense) → utility metrics of the finished utility trials."""
    table = {}
    for r in rows:
        if r.get("kind") == "utility" and r["status"] == "done":
            table[(r["dataset"], r["model"], r["defense"])] = dict(r.get("metrics") or {})
    return table


def bounds_table(rows: Iterable[Mapping[str, Any]], *, metric: str = "exact_rmse") -> dict[tuple, float]:
    """(dataset, model, defense, batch_size) → mean lower bound on the RMSE over the finished bound trials."""
    values: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("kind") == "bound" and r["status"] == "done":
            v = (r.get("metrics") or {}).get(metric)
            if v is not None:
                values.setdefault((r["dataset"], r["model"], r["defense"], int(r["batch_size"])), []).append(v)
    return {k: sum(v) / len(v) for k, v in values.items()}


def privacy_utility(best: Iterable[Strongest], utility: Mapping[tuple, Mapping[str, Any]],
                    bounds: Optional[Mapping[tuple, float]] = None) -> list[PrivacyUtilityPoint]:
    """One point per strongest-attack setting; utility loss relative to the same dataset and model without defense."""
    points = []
    for s in best:
        u = utility.get((s.dataset, s.model, s.defense), {})
        base = utility.get((s.dataset, s.model, "none"), {})

        def diff(key: str, sign: float, u=u, base=base) -> Optional[float]:
            a, b = u.get(key), base.get(key)
            return None if a is None or b is None else sign * (a - b)

        points.append(PrivacyUtilityPoint(
            dataset=s.dataset, model=s.model, defense=s.defense, batch_size=s.batch_size, attack=s.attack,
            rmse=s.rmse, train_loss=u.get("train_loss"), train_loss_increase=diff("train_loss", 1.0),
            test_accuracy=u.get("test_accuracy"), accuracy_drop=diff("test_accuracy", -1.0),
            bound=(bounds or {}).get((s.dataset, s.model, s.defense, s.batch_size))))
    return points


__all__ = ["AttackScore", "Strongest", "PrivacyUtilityPoint", "attack_scores", "strongest", "utility_table",
           "bounds_table",
           "privacy_utility"]
