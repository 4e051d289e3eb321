"""S_D per threat model on hand-made tables (Liu et al. 2024, Table 4), utility joins, the Pareto front against a
brute force, the verdict, weights/membership aggregation and the ROC against an independent computation."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from leakbench.evaluation import privacy_utility, strongest, utility_table
from leakbench.evaluation.trials.plan import defense_family
from leakbench.evaluation.verdicts.rules import BUDGETS, PrivacyUtilityPoint, pareto_front, verdicts
from leakbench.evaluation.verdicts.weights import membership_table, roc_curve, weights_table
from leakbench.evaluation.verdicts.rows import threat_model
from leakbench.evaluation.verdicts.utility import utility_for


def row(attack, defense, b, rmse, psnr=None, ssim=None, status="done", error=None, dataset="d", model="m",
        threat=None):
    r = {"kind": "attack", "dataset": dataset, "model": model, "attack": attack, "defense": defense,
         "batch_size": b, "status": status, "rmse": rmse, "psnr": psnr if psnr is not None else
         (None if rmse is None or not math.isfinite(rmse) or rmse <= 0 else -20 * math.log10(rmse)),
         "ssim": ssim, "error": error}
    if threat is not None:
        r["threat_model"] = threat
    return r


def util(defense, loss, acc=None, b=None, status="done", eps=None, dataset="d", model="m"):
    r = {"kind": "utility", "status": status, "dataset": dataset, "model": model, "defense": defense,
         "metrics": {"train_loss": loss, "test_accuracy": acc, "epsilon": eps}}
    if b is not None:
        r["batch_size"] = b
    return r


TABLE = [
    # defense none, B=2: ig wins on mean RMSE (0.20 vs 0.25) although dlg has the single best trial
    row("ig", "none", 2, 0.10), row("ig", "none", 2, 0.30),
    row("dlg", "none", 2, 0.05), row("dlg", "none", 2, 0.45),
    row("fc", "none", 2, None, status="n/a", error="fc needs an MLP"),
    # prune:0.9, B=2: equal RMSE, PSNR breaks the tie
    row("ig", "prune:0.9", 2, 0.40, psnr=8.0), row("dlg", "prune:0.9", 2, 0.40, psnr=9.0),
    # prune:0.9, B=4: dlg failed everywhere (its failed row even carries a low RMSE), ig diverged (NaN) once:
    # ig's mean is over its one usable trial, the NaN counts as failed
    row("dlg", "prune:0.9", 4, 0.01, status="failed", error="boom"),
    row("ig", "prune:0.9", 4, 0.2), row("ig", "prune:0.9", 4, float("nan")),
    row("cpa", "prune:0.9", 4, 0.35, ssim=0.5),
    # noise, B=2: only n/a attacks, a timed-out one and an infinite result
    row("fc", "noise:0.1", 2, None, status="n/a", error="fc needs an MLP"),
    row("ig", "noise:0.1", 2, 0.001, status="timed out", error="ran past 5 s"),
    row("dlg", "noise:0.1", 2, float("inf")),
]


def test_strongest_picks_lowest_mean_rmse_and_skips_na_failed_and_non_finite():
    best = {(s.defense, s.batch_size): s for s in strongest(TABLE)}
    assert best[("none", 2)].attack == "ig" and math.isclose(best[("none", 2)].rmse, 0.20)
    scores = {a.attack: a for a in best[("none", 2)].scores}
    assert scores["fc"].not_applicable == "fc needs an MLP" and scores["fc"].trials == 0
    assert scores["dlg"].trials == 2 and math.isclose(scores["dlg"].rmse, 0.25)
    assert math.isclose(scores["ig"].rmse_std, np.std([0.1, 0.3], ddof=1))
    assert best[("prune:0.9", 2)].attack == "dlg"  # same RMSE, higher PSNR
    b4 = best[("prune:0.9", 4)]
    assert b4.attack == "ig" and math.isclose(b4.rmse, 0.2)
    by = {a.attack: a for a in b4.scores}
    assert by["dlg"].failed == 1 and by["dlg"].trials == 0 and "failed: boom" in by["dlg"].reasons
    assert by["ig"].trials == 1 and by["ig"].failed == 1 and by["ig"].rmse_std is None
    assert by["cpa"].ssim == 0.5
    none_ran = best[("noise:0.1", 2)]
    assert none_ran.attack is None and math.isnan(none_ran.rmse)
    assert {a.attack: a.failed for a in none_ran.scores} == {"fc": 0, "ig": 1, "dlg": 1}
    assert [s.defense for s in strongest(TABLE)] == ["none", "prune:0.9", "prune:0.9", "noise:0.1"]


def test_sd_never_picks_unusable_rows_against_a_brute_force():
    """Random tables: S_D equals the min over attacks of the mean over the done, finite rows only."""
    rng = random.Random(0)
    statuses = ["done", "done", "done", "failed", "n/a", "timed out"]
    for _ in range(30):
        rows = [row(f"a{rng.randrange(4)}", "none", 1, rng.choice([rng.random(), float("nan"), float("inf")]),
                    status=rng.choice(statuses), threat=rng.choice([None, "malicious-server"]))
                for _ in range(12)]
        for s in strongest(rows):
            means = {}
            for a in {r["attack"] for r in rows}:
                vals = [r["rmse"] for r in rows if r["attack"] == a and threat_model(r) == s.threat_model
                        and r["status"] == "done" and math.isfinite(r["rmse"])]
                if vals:
                    means[a] = sum(vals) / len(vals)
            if means:
                assert math.isclose(s.rmse, min(means.values()))
                assert s.attack in means and math.isclose(means[s.attack], s.rmse)
            else:
                assert s.attack is None


def test_chance_level_travels_with_the_strongest_attack():
    rows = [{**row("ig", "none", 1, 0.1), "metrics": {"chance_rmse": 0.3}},
            {**row("ig", "none", 1, 0.2), "metrics": {"chance_rmse": 0.5}},
            {**row("dlg", "none", 1, 0.5), "metrics": {"chance_rmse": 0.4}},
            {**row("ig", "noise:1", 1, 0.6), "metrics": {"chance_rmse": 0.4}},
            row("ig", "prune:0.9", 1, 0.2)]
    best = {s.defense: s for s in strongest(rows)}
    assert math.isclose(best["none"].chance_rmse, 0.4) and best["none"].beats_chance is True
    assert best["noise:1"].beats_chance is False and best["prune:0.9"].beats_chance is None
    found = {v.budget: v for v in verdicts(privacy_utility(strongest(rows), {}), (math.inf,))}
    assert found[math.inf].defense == "noise:1" and found[math.inf].chance_rmse == 0.4
    assert math.isclose(found[math.inf].baseline_chance, 0.4)


def test_threat_models_are_separate_settings():
    rows = [row("ig", "none", 1, 0.3), row("rtf", "none", 1, 0.0, threat="malicious-server"),
            row("ig", "none", 1, 0.1, threat="informed-eavesdropper"),
            {**row("ig", "none", 1, 0.2), "spec": {"threat_model": "eavesdropper"}}]
    best = {s.threat_model: s for s in strongest(rows)}
    assert set(best) == {"eavesdropper", "malicious-server", "informed-eavesdropper"}
    assert best["eavesdropper"].attack == "ig" and math.isclose(best["eavesdropper"].rmse, 0.25)
    assert best["malicious-server"].attack == "rtf"
    assert math.isclose(best["informed-eavesdropper"].rmse, 0.1)
    assert threat_model({"kind": "weights"}) == "published-weights"
    assert threat_model({"kind": "membership"}) == "membership"
    assert threat_model({"kind": "utility"}) == "eavesdropper"


def test_settings_are_kept_apart():
    rows = [row("ig", "none", 1, 0.1, dataset="a"), row("dlg", "none", 1, 0.2, dataset="a"),
            row("ig", "none", 1, 0.3, dataset="b"), row("dlg", "none", 1, 0.2, dataset="b")]
    assert [(s.dataset, s.attack) for s in strongest(rows)] == [("a", "ig"), ("b", "dlg")]


def test_utility_joins_per_batch_size_with_the_zero_fallback():
    rows = [util("none", 0.30, 0.90, b=2), util("none", 0.50, 0.85, b=4),
            util("prune:0.9", 0.50, 0.80, b=2), util("prune:0.9", 0.70, 0.70, b=4),
            util("noise:0.1", 0.35, 0.88),  # an old row without batch size: applies to every B
            util("noise:0.1", float("nan"), 0.1, b=2),  # NaN training loss: diverged, no utility number
            util("clip:1", 0.4, status="failed", b=2),
            {**util("dpsgd:1", 0.9, 0.5, eps=3.0), "spec": {"batch_size": 4}}]
    table = utility_table(rows)
    assert set(table) == {("d", "m", "none", 2), ("d", "m", "none", 4), ("d", "m", "prune:0.9", 2),
                          ("d", "m", "prune:0.9", 4), ("d", "m", "noise:0.1", 0), ("d", "m", "noise:0.1", 2),
                          ("d", "m", "dpsgd:1", 4)}
    assert table[("d", "m", "noise:0.1", 2)]["diverged"].startswith("1 of 1 seed(s): non-finite")
    assert table[("d", "m", "noise:0.1", 2)]["train_loss"] is None
    assert utility_for(table, "d", "m", "noise:0.1", 4)["train_loss"] == 0.35
    assert utility_for(table, "d", "m", "prune:0.9", 8) is None
    best = strongest([row("ig", d, b, 0.1 * (i + 1)) for i, d in enumerate(["none", "prune:0.9", "noise:0.1",
                                                                            "dpsgd:1", "clip:1"])
                      for b in (2, 4)])
    points = {(p.defense, p.batch_size): p for p in privacy_utility(best, table)}
    assert math.isclose(points[("prune:0.9", 2)].utility_loss, 0.2)
    assert math.isclose(points[("prune:0.9", 4)].utility_loss, 0.2)  # 0.7 − 0.5 at B = 4, not 0.7 − 0.3
    assert math.isclose(points[("prune:0.9", 4)].accuracy_drop, 0.15)
    # one seed: a number, but no interval, so it fits no finite budget
    assert points[("prune:0.9", 4)].utility.interval.n == 1 and not points[("prune:0.9", 4)].utility.within(1.0)
    # noise: diverged at B = 2 (no utility number); at B = 4 the B-0 utility against the per-B baseline: a
    # gain, reported as measured (−0.15), not clamped
    assert points[("noise:0.1", 2)].utility_loss is None and points[("noise:0.1", 2)].diverged
    p = points[("noise:0.1", 4)]
    assert math.isclose(p.utility_loss, -0.15) and p.gain and math.isclose(p.train_loss_increase, -0.15)
    assert points[("dpsgd:1", 4)].epsilon == 3.0 and points[("dpsgd:1", 2)].utility_loss is None
    assert points[("clip:1", 2)].utility_loss is None  # failed utility trial
    assert points[("none", 2)].utility_loss == 0.0 and not points[("none", 2)].gain


def _point(defense, rmse, loss, b=1, threat="eavesdropper"):
    return PrivacyUtilityPoint(dataset="d", model="m", defense=defense, batch_size=b, attack="ig", rmse=rmse,
                               train_loss=None, train_loss_increase=loss, test_accuracy=None, accuracy_drop=None,
                               threat_model=threat, utility_loss=loss)


def test_pareto_front_equals_a_brute_force():
    rng = random.Random(1)
    for _ in range(40):
        pts = [_point(f"d{i}", rng.choice([0.1, 0.2, 0.3, rng.random()]), rng.choice([0.0, 0.1, rng.random()]))
               for i in range(rng.randrange(1, 12))]
        pts.append(_point("broken", float("nan"), 0.0))
        pts.append(_point("unmeasured", 9.0, None))
        finite = [p for p in pts if math.isfinite(p.rmse) and p.utility_loss is not None]
        brute = set()
        for p in finite:
            if not any((q.rmse >= p.rmse and q.utility_loss <= p.utility_loss)
                       and (q.rmse, q.utility_loss) != (p.rmse, p.utility_loss) for q in finite):
                brute.add(p.defense)
        front = pareto_front(pts)
        assert {p.defense for p in front} == brute
        assert [p.utility_loss for p in front] == sorted(p.utility_loss for p in front)
        assert all(a.rmse < b.rmse for a, b in itertools.pairwise(front) if a.utility_loss < b.utility_loss)


def test_verdict_picks_the_least_leaking_defense_within_each_budget():
    # four batches per setting, utility over three seeds: every difference here is far outside the noise
    def rows_of(attack, defense, values, threat=None):
        return [{**row(attack, defense, 1, v, threat=threat), "seed": 0, "batch": i,
                 "metrics": {"chance_rmse": 2.0}} for i, v in enumerate(values)]

    def utils(defense, loss):
        return [{**util(defense, loss + 0.001 * s), "spec": {"utility": {"seed": s}}} for s in range(3)]

    rows = [*rows_of("ig", "none", [0.05, 0.06, 0.05, 0.04]), *rows_of("dlg", "none", [0.02, 0.03, 0.02, 0.01]),
            *rows_of("ig", "noise:0.01", [0.10, 0.11, 0.10, 0.09]), *rows_of("ig", "noise:0.1", [0.30, 0.31, 0.3, 0.29]),
            *rows_of("ig", "prune:0.9", [0.50, 0.51, 0.5, 0.49]),
            *rows_of("ig", "dpsgd:1", [0.90, 0.91, 0.9, 0.89]),  # the best RMSE, but its utility was never measured
            *rows_of("ig", "none", [0.9, 0.91, 0.9, 0.89], threat="malicious-server"),
            *rows_of("rtf", "noise:0.1", [0.0, 0.0, 0.0, 0.0], threat="malicious-server")]
    table = utility_table([*utils("none", 1.0), *utils("noise:0.01", 1.02), *utils("noise:0.1", 1.08),
                           *utils("prune:0.9", 1.2)])
    found = {(v.threat_model, v.budget): v for v in verdicts(privacy_utility(strongest(rows), table))}
    assert found["eavesdropper", 0.05].defense == "noise:0.01"
    assert math.isclose(found["eavesdropper", 0.05].rmse, 0.10)
    assert found["eavesdropper", 0.1].defense == "noise:0.1"
    assert found["eavesdropper", 0.25].defense == "prune:0.9"
    assert found["eavesdropper", math.inf].defense == "dpsgd:1"
    assert all(found["eavesdropper", u].status == "decided" and found["eavesdropper", u].n == 4 for u in BUDGETS)
    assert all(math.isclose(found["eavesdropper", u].baseline_rmse, 0.02) for u in BUDGETS)
    assert found["eavesdropper", 0.05].baseline_attack == "dlg"
    # under a malicious server RtF reads noise:0.1 exactly: no defense beats "none" there
    assert found["malicious-server", 0.25].defense == "none"
    assert math.isclose(found["malicious-server", 0.25].rmse, 0.9)


def test_weights_and_membership_tables():
    def w(attack, status="done", **m):
        return {"kind": "weights", "dataset": "d", "model": "m", "defense": "none", "attack": attack,
                "status": status, "metrics": m, "error": "crashed" if status != "done" else None}
    counts = dict(n_train=20, n_nonmembers=20, candidates=50, diverged=2, members_nn=5, nonmembers_nn=1,
                  **{"members_ssim_0.4": 19, "control_ssim_0.4": 20, "members_ssim_0.6": 3, "control_ssim_0.6": 0})
    found = {s.attack: s for s in weights_table([w("kkt", kkt_residual=0.1, **counts),
                                                  w("kkt", kkt_residual=0.3, **counts), w("kkt", "failed"),
                                                  w("univariate", "done", n_train=float("nan"))])}
    k = found["kkt"]
    assert (k.trials, k.failed, k.n_train, k.members_nn, k.nonmembers_nn) == (2, 1, 40, 10, 2)
    assert k.members_ssim == {0.4: 38, 0.6: 6} and k.control_ssim == {0.4: 40, 0.6: 0}
    assert math.isclose(k.kkt_residual, 0.2) and k.diverged == 4
    assert found["univariate"].trials == 0 and found["univariate"].failed == 1

    def m(setting, auc, status="done", via="options"):
        spec = {"options": {"setting": setting}} if via == "options" else {}
        return {"kind": "membership", "dataset": "d", "model": "m", "defense": "none", "status": status,
                "attack": setting if via == "label" else "membership-margin", "spec": spec,
                "metrics": {"auc": auc, "tpr_at_fpr_0.01": 0.05, "tpr_at_fpr_0.001": 0.0, "members": 100,
                            "nonmembers": 100}}
    found = {s.setting: s for s in membership_table([m("known", 0.7), m("known", 0.8), m("leaked", 0.6, via="label"),
                                                      m("bounded", float("nan"))])}
    assert math.isclose(found["known"].auc, 0.75) and found["known"].members == 200
    assert found["leaked"].trials == 1 and found["bounded"].trials == 0 and found["bounded"].failed == 1


def test_roc_curve_matches_thresholds_and_mann_whitney():
    rng = np.random.default_rng(0)
    scores = np.round(rng.normal(size=60), 1)  # ties
    member = rng.random(60) < 0.4
    fpr, tpr = roc_curve(scores, member)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0, 0, 1, 1)
    for t in np.unique(scores):  # every threshold's (FPR, TPR) is a point of the curve
        point = ((scores >= t) & ~member).sum() / (~member).sum(), ((scores >= t) & member).sum() / member.sum()
        assert any(math.isclose(f, point[0]) and math.isclose(r, point[1]) for f, r in zip(fpr, tpr))
    auc = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
    pos, neg = scores[member], scores[~member]
    mw = np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg])
    assert math.isclose(auc, mw)
    with pytest.raises(ValueError, match="both"):
        roc_curve([0.1, 0.2], [True, True])
    with pytest.raises(ValueError, match="finite"):
        roc_curve([0.1, float("nan")], [True, False])


def test_defense_family():
    assert defense_family("none") == ("none", "")
    assert defense_family("prune:0.9") == ("prune", "0.9")
    assert defense_family("clip:4+noise:0.01") == ("clip+noise", "4, 0.01")


@pytest.mark.parametrize("names", [("a", "z"), ("z", "a")])
def test_ssim_breaks_a_tie_of_rmse_and_psnr_towards_the_higher_ssim(names):
    """Liu et al. (2024), Table 4 as the module reads it: equal RMSE and PSNR, then the higher SSIM is stronger
    (both name orders, so the last tie-break by name cannot decide it)."""
    better, worse = names
    rows = [row(worse, "none", 2, 0.3, psnr=10.0, ssim=0.2), row(better, "none", 2, 0.3, psnr=10.0, ssim=0.7)]
    (best,) = strongest(rows)
    assert best.attack == better and best.ssim == 0.7
    assert [s.attack for s in best.scores] == [better, worse]
