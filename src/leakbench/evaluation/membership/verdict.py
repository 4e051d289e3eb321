"""The strongest membership attack per defense, its utility cost, and the verdict — as for reconstruction.

Rows: the reference-model ``membership`` trials of a sweep (:mod:`.reference_trial`), one per seed × attack ×
defense, each with per-point scores over the pool (``per_sample``: ``score``, ``member``).  For every
(dataset, model, defense):

- each attack's **AUC** (Mann–Whitney) with a stratified bootstrap interval over points (members and
  non-members resampled apart, within each seed; with several seeds the AUC is the mean of the seeds'), and
  its TPR at 1 % / 0.1 % FPR where ≥ 10/FPR non-members measure it (:func:`~.stats.measurable_fpr`), with
  Clopper–Pearson intervals, and TPR with no false positive among the n non-members;
- the **strongest attack**: the highest AUC (the analogue of Liu et al.'s S_D, eq. (3): the best attack per
  defense setting); an attack *beats chance* when its AUC interval lies above 0.5 (n ≥ :data:`~.stats.MIN_N`
  points) or, where measured, its TPR interval at 1 % FPR lies above 1 %; a defense *stops every membership
  attack run here* when none beats chance;
- the **utility cost**: the increase of the final training loss over the undefended run of the same model
  (the target and every reference model train with the defense, so the cost is paired over those
  ``reference_models + 1`` runs per seed, with a Student-t interval — :class:`~.strongest.UtilityLoss`).

:func:`membership_verdicts` then decides, per (dataset, model) and utility budget u in
:data:`~.strongest.BUDGETS`, with the reconstruction verdict's rules (:func:`~.strongest.verdicts`): the cheapest
setting that stops every attack (the others equivalent), else the setting whose strongest attack has the lowest
AUC, *decided* when the paired bootstrap interval (the same points, pool and members under every defense of a
seed) of every other candidate's AUC minus the pick's lies above 0, otherwise *tied* with those it does not
separate — never broken by a name; settings whose cost interval straddles u and would be named or tied are the
``edge`` (and turn ``decided`` into ``tied``).  Everything is a pure function of the rows.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..trials.plan import defense_family
from ..verdicts.stats import CONFIDENCE, EMPTY, MIN_N, SEED, Interval, binomial, measurable_fpr, paired_t
from ..verdicts.rules import BUDGETS
from ..verdicts.utility import UtilityLoss
from ..verdicts.rows import finite

__all__ = ["MembershipAttack", "MembershipDefense", "MembershipVerdict", "membership_rows", "membership_defenses",
           "membership_verdicts", "auc_bootstrap", "is_reference", "FPRS", "AUC_RESAMPLES"]

#: false-positive rates of the tables and of the chance test (1 %, 0.1 %).
FPRS = (0.01, 0.001)
#: bootstrap resamples of the AUC intervals and paired AUC differences (seeded).
AUC_RESAMPLES = 1000


def is_reference(row: Mapping[str, Any]) -> bool:
    """A reference-model membership row (not the margin attack on a two-layer target)."""
    spec = row.get("spec") or {}
    return row.get("kind") == "membership" and (spec.get("membership") or {}).get("form") in ("reference", "run")


def _points(row: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    per = row.get("per_sample") or {}
    s, m = per.get("score"), per.get("member")
    if not s or not m or len(s) != len(m):
        return None
    s = np.asarray(s, dtype=np.float64)
    m = np.asarray(m).astype(bool)
    if not np.isfinite(s).all() or m.all() or not m.any():
        return None
    return s, m


def _auc_weighted(scores: np.ndarray, members: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """AUC (Mann–Whitney, ties one half) of ``scores`` against ``members`` for each bootstrap resample in ``rows``
    (R×k indices into the points; None: the points themselves, one row), in O(R·n) per block: each resample is a
    vector of multiplicities over the points sorted once, and a member's U-count is the non-member weight below
    its score (plus half the weight tied with it)."""
    n = scores.size
    order = np.argsort(scores, kind="stable")
    starts = np.r_[0, np.flatnonzero(np.diff(scores[order])) + 1]  # groups of equal scores, sorted
    pos = members[order]
    if rows is None:
        rows = np.arange(n)[None, :]
    out = []
    block = max(1, 4_000_000 // max(n, 1))  # bounded memory: ≤ 4 M multiplicities at a time
    for lo in range(0, rows.shape[0], block):
        r = rows[lo:lo + block]
        w = np.bincount((r + n * np.arange(r.shape[0])[:, None]).ravel(), minlength=r.shape[0] * n)
        w = w.reshape(r.shape[0], n)[:, order]
        wp = np.add.reduceat(w * pos, starts, axis=1)
        wn = np.add.reduceat(w * ~pos, starts, axis=1)
        below = np.cumsum(wn, axis=1) - wn
        out.append((wp * (below + 0.5 * wn)).sum(1) / (wp.sum(1) * wn.sum(1)))
    return np.concatenate(out)


def auc_bootstrap(a: Mapping[int, tuple[np.ndarray, np.ndarray]],
                  b: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None, *,
                  resamples: int = AUC_RESAMPLES, seed: int = SEED, confidence: float = CONFIDENCE) -> Interval:
    """The mean over seeds of AUC(a) (minus AUC(b), paired: the same resampled points) with its stratified
    percentile-bootstrap interval.  ``a``/``b``: seed → (scores, is_member) over the same points in the same
    order; seeds missing from either are left out.  ``n``: the points."""
    seeds = sorted(k for k in a if b is None or k in b)
    if not seeds:
        return EMPTY
    rng = np.random.default_rng(seed)
    point, boot, n = 0.0, np.zeros(resamples), 0
    for s in seeds:
        sa, m = a[s]
        sb = None if b is None else b[s][0]
        if sb is not None and (sb.shape != sa.shape or not np.array_equal(b[s][1], m)):
            continue  # not the same points: no pairing
        pos, neg = np.flatnonzero(m), np.flatnonzero(~m)
        idx = np.concatenate([pos[rng.integers(0, pos.size, (resamples, pos.size))],
                              neg[rng.integers(0, neg.size, (resamples, neg.size))]], axis=1)
        est = _auc_weighted(sa, m)[0]
        res = _auc_weighted(sa, m, idx)
        if sb is not None:
            est -= _auc_weighted(sb, m)[0]
            res = res - _auc_weighted(sb, m, idx)
        point += est / len(seeds)
        boot += res / len(seeds)
        n += int(m.size)
    if n == 0:
        return EMPTY
    alpha = (1 - confidence) / 2
    low, high = np.quantile(boot, [alpha, 1 - alpha])
    return Interval(float(point), float(low), float(high), n, "stratified bootstrap")


def _tpr(points: Mapping[int, tuple[np.ndarray, np.ndarray]], fpr: float) -> Interval | None:
    """TPR at the largest threshold whose FPR ≤ ``fpr`` (pooled counts over seeds), Clopper–Pearson; None where
    the non-members cannot measure it (< 10/FPR; 0 % FPR is always measured: members above every non-member)."""
    nonmembers = sum(int((~m).sum()) for _, m in points.values())
    if fpr > 0 and not measurable_fpr(fpr, nonmembers):
        return None
    k = total = 0
    for s, m in points.values():
        neg = np.sort(s[~m])[::-1]
        allowed = int(math.floor(fpr * neg.size + 1e-9))
        # the threshold: strictly above the (allowed+1)-th highest non-member score
        cut = neg[allowed] if allowed < neg.size else -math.inf
        k += int((s[m] > cut).sum())
        total += int(m.sum())
    return binomial(k, total)


@dataclass
class MembershipAttack:
    """One membership attack against one defense setting: AUC and TPR at low FPR with their intervals."""

    dataset: str
    model: str
    defense: str
    attack: str
    name: str = ""
    auc: Interval = EMPTY
    tpr: dict[float, Interval | None] = field(default_factory=dict)
    tpr0: Interval = EMPTY
    members: int = 0
    nonmembers: int = 0
    trials: int = 0
    failed: int = 0
    reasons: list[str] = field(default_factory=list)
    not_applicable: str | None = None
    points: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    rows: list[Mapping[str, Any]] = field(default_factory=list)

    @property
    def beats_chance(self) -> bool:
        """AUC significantly above 0.5, or (where measured) TPR at 1 % FPR significantly above 1 %."""
        t = self.tpr.get(0.01)
        return self.auc.above(0.5) or (t is not None and t.above(0.01))


@dataclass
class MembershipDefense:
    """One defense setting: every attack, the strongest (highest AUC), the utility cost and the DP audit."""

    dataset: str
    model: str
    defense: str
    attacks: list[MembershipAttack] = field(default_factory=list)
    strongest: MembershipAttack | None = None
    utility: UtilityLoss = field(default_factory=UtilityLoss)
    losses: dict[tuple, float] = field(default_factory=dict)
    test_accuracy: float | None = None
    epsilon: float | None = None
    #: DP-SGD: (attack, audited ε lower bound, its counts) per attack with an audit
    audits: list[dict[str, Any]] = field(default_factory=list)
    #: DP-SGD with canaries: the one-run audit per seed (Steinke et al. 2023)
    one_run: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def stops(self) -> bool:
        """No attack beats chance, on at least MIN_N points."""
        return (self.strongest is not None and self.strongest.auc.n >= MIN_N
                and not any(a.beats_chance for a in self.attacks if a.trials))

    @property
    def family(self) -> str:
        return defense_family(self.defense)[0]


def _reason(row: Mapping[str, Any]) -> str:
    status = row.get("status") or "unknown"
    lines = (row.get("error") or "").strip().splitlines()
    return f"{status}: {lines[0]}" if lines else str(status)


def membership_rows(rows: Iterable[Mapping[str, Any]]) -> list[MembershipAttack]:
    """One :class:`MembershipAttack` per (dataset, model, defense, attack label) of the reference-model rows."""
    out: dict[tuple, MembershipAttack] = {}
    for r in rows:
        if not is_reference(r):
            continue
        key = (r.get("dataset") or "", r.get("model") or "", r.get("defense") or "none", r.get("attack") or "")
        a = out.setdefault(key, MembershipAttack(*key, name=(r.get("spec") or {}).get("attack") or key[3]))
        pts = _points(r) if r.get("status") == "done" and finite((r.get("metrics") or {}).get("auc")) else None
        if pts is None:
            if r.get("status") == "n/a":
                a.not_applicable = r.get("error") or "not applicable"
            else:
                a.failed += 1
                a.reasons = list(dict.fromkeys([*a.reasons, _reason(r)]))
            continue
        seed = int((r.get("spec") or {}).get("seed", r.get("seed") or 0))
        a.points[seed] = pts
        a.trials += 1
        a.rows.append(r)
    for a in out.values():
        if not a.points:
            continue
        a.auc = auc_bootstrap(a.points)
        a.members = sum(int(m.sum()) for _, m in a.points.values())
        a.nonmembers = sum(int((~m).sum()) for _, m in a.points.values())
        a.tpr = {f: _tpr(a.points, f) for f in FPRS}
        a.tpr0 = _tpr(a.points, 0.0) or EMPTY
    return list(out.values())


def _rank(a: MembershipAttack) -> tuple:
    """Higher is stronger: AUC, then TPR at 1 % and 0.1 % FPR where measured; the label last (display order)."""
    def val(i: Interval | None) -> float:
        return i.mean if i is not None and finite(i.mean) else -math.inf
    return (a.trials > 0, val(a.auc), val(a.tpr.get(0.01)), val(a.tpr.get(0.001)), val(a.tpr0))


def membership_defenses(rows: Iterable[Mapping[str, Any]]) -> list[MembershipDefense]:
    """Per (dataset, model, defense): the attacks, the strongest, the utility cost (paired by model) and audits."""
    rows = list(rows)
    attacks = membership_rows(rows)
    out: dict[tuple, MembershipDefense] = {}
    for a in attacks:
        d = out.setdefault((a.dataset, a.model, a.defense), MembershipDefense(a.dataset, a.model, a.defense))
        d.attacks.append(a)
    for d in out.values():
        d.attacks.sort(key=_rank, reverse=True)
        ran = [a for a in d.attacks if a.trials]
        d.strongest = ran[0] if ran else None
        accuracies, eps = [], []
        for a in ran:
            for r in a.rows:
                m = r.get("metrics") or {}
                seed = int((r.get("spec") or {}).get("seed", 0))
                for i, v in enumerate(m.get("train_losses") or []):
                    if finite(v):
                        d.losses[(seed, i)] = float(v)
                if finite(m.get("test_accuracy")):
                    accuracies.append(float(m["test_accuracy"]))
                if finite(m.get("epsilon")):
                    eps.append(float(m["epsilon"]))
                if finite(m.get("one_run_epsilon")):
                    d.one_run[seed] = {k[len("one_run_"):]: v for k, v in m.items() if k.startswith("one_run_")}
                if finite(m.get("audit_epsilon")):
                    d.audits.append({"attack": a.attack, "seed": seed, **{k: m.get(k) for k in (
                        "audit_epsilon", "audit_tp", "audit_members", "audit_fp", "audit_nonmembers",
                        "audit_delta", "epsilon")}})
        d.test_accuracy = sum(accuracies) / len(accuracies) if accuracies else None
        d.epsilon = max(eps) if eps else None
    for d in out.values():
        base = out.get((d.dataset, d.model, "none"))
        if d.defense == "none":
            d.utility = UtilityLoss(Interval(0.0, 0.0, 0.0, len(d.losses), "t"))
        elif base is not None and d.losses and base.losses:
            d.utility = UtilityLoss(paired_t(d.losses, base.losses))
    return list(out.values())


@dataclass
class MembershipVerdict:
    """The membership answer for one (dataset, model) at a utility budget (statuses as
    :data:`~.strongest.VERDICT_STATUSES`); ``auc``: the pick's strongest attack; ``margin``: the next candidate's
    strongest AUC minus the pick's (paired over points)."""

    dataset: str
    model: str
    budget: float
    defense: str | None = None
    attack: str | None = None
    auc: Interval = EMPTY
    utility: UtilityLoss = field(default_factory=UtilityLoss)
    epsilon: float | None = None
    status: str = "none"
    tied: list[str] = field(default_factory=list)
    margin: Interval = EMPTY
    baseline: Interval = EMPTY
    baseline_attack: str | None = None
    edge: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.auc.n


def _cost(d: MembershipDefense) -> float:
    return d.utility.mean if d.utility.mean is not None else math.inf


def _decide(pts: Sequence[MembershipDefense], memo: dict | None = None,
            ) -> tuple[str, MembershipDefense, list[str], Interval]:
    """(status, pick, tied/equivalent defenses, margin) among candidates (non-empty, each with a strongest);
    ``memo`` keeps the paired bootstraps of one :func:`membership_verdicts` call (budgets share them)."""
    memo = {} if memo is None else memo
    stopping = [p for p in pts if p.stops]
    if stopping:
        pick = min(stopping, key=lambda p: (_cost(p), p.strongest.auc.mean, p.defense != "none"))
        return "stops", pick, sorted(p.defense for p in stopping if p is not pick), pick.strongest.auc
    if max(p.strongest.auc.n for p in pts) < MIN_N:
        pick = min(pts, key=lambda p: p.strongest.auc.mean)
        return "undecided", pick, [], EMPTY
    low = min(p.strongest.auc.mean for p in pts)
    pick = min((p for p in pts if p.strongest.auc.mean == low), key=lambda p: (_cost(p), p.defense))
    tied, margins = [], []
    for p in pts:
        if p is pick:
            continue
        key = (p.dataset, p.model, p.defense, pick.defense)
        if key not in memo:
            memo[key] = auc_bootstrap(p.strongest.points, pick.strongest.points)
        diff = memo[key]
        if diff.above(0.0):
            margins.append(diff)
        else:
            tied.append(p.defense)
    margin = min(margins, key=lambda i: i.mean) if margins else EMPTY
    return ("tied" if tied else "decided"), pick, sorted(tied), margin


def membership_verdicts(defenses: Iterable[MembershipDefense], budgets: Sequence[float] = BUDGETS,
                        ) -> list[MembershipVerdict]:
    """Per (dataset, model) and budget: the decision among the defenses within it (module docstring)."""
    groups: dict[tuple, list[MembershipDefense]] = {}
    for d in defenses:
        if d.strongest is not None:
            groups.setdefault((d.dataset, d.model), []).append(d)
    out: list[MembershipVerdict] = []
    memo: dict = {}
    for (dataset, model), pts in groups.items():
        base = next((p for p in pts if p.defense == "none"), None)
        for u in budgets:
            ok = [p for p in pts if p.defense == "none" or p.utility.within(u)
                  or (math.isinf(u) and p.utility.mean is None)]
            v = MembershipVerdict(dataset, model, u, baseline=base.strongest.auc if base else EMPTY,
                                  baseline_attack=base.strongest.attack if base else None)
            if ok:
                v.status, pick, v.tied, v.margin = _decide(ok, memo)
                v.defense, v.attack, v.auc = pick.defense, pick.strongest.attack, pick.strongest.auc
                v.utility, v.epsilon = pick.utility, pick.epsilon
            if not (v.status == "stops" and v.defense == "none"):
                edge = [p for p in pts if p.defense != "none" and p.utility.at_edge(u)]
                if edge:
                    _, pick2, tied2, _ = _decide([*ok, *edge], memo)
                    names = {p.defense for p in edge}
                    v.edge = sorted(d for d in {pick2.defense, *tied2} if d in names)
            if v.edge and v.status == "decided":
                v.status = "tied"
            out.append(v)
    return out
