"""The verdict rules: privacy against utility per defense (:class:`PrivacyUtilityPoint`), the Pareto front, and
:func:`verdicts` — per utility budget u in :data:`BUDGETS`, the cheapest defense that stops every attack, else
the one with the highest S_D, with the defenses tied with it.

:func:`verdicts` answers, per utility budget u in :data:`BUDGETS` (the upper end of the utility-loss interval
≤ u, plus "any cost"), which defense to pick: the cheapest of those that stop every attack (the rest listed as
equivalent), otherwise the one with the highest S_D with every defense not significantly below it listed as
tied.  Everything here is a pure function of rows as returned by :meth:`~.store.Store.rows`; missing keys take
their defaults.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..trials.plan import defense_family
from .rows import finite
from .stats import EMPTY, MIN_N, Interval, paired_bootstrap
from .strongest import Strongest
from .utility import UtilityLoss, utility_for, utility_loss

#: utility budgets of the verdict: final training-loss increase over the undefended run (nats); inf = any cost.
BUDGETS = (0.05, 0.1, 0.25, math.inf)


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


__all__ = ["BUDGETS", "PrivacyUtilityPoint", "Verdict", "privacy_utility", "dominates", "pareto_front", "verdicts"]
