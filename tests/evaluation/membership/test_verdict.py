"""The membership verdict: strongest attack per defense by AUC with intervals, utility paired by model, decisions
and ties as in the reconstruction verdicts."""
from __future__ import annotations

import math

import numpy as np
from sklearn.metrics import roc_auc_score

from leakbench.evaluation.membership.verdict import (auc_bootstrap, membership_defenses, membership_rows,
                                                     membership_verdicts)

N = 1200  # 600 members, 600 non-members


def _row(defense: str, attack: str, shift: float, losses: list[float], *, seed: int = 0, n: int = N,
         noise_seed: int = 0, status: str = "done") -> dict:
    g = np.random.default_rng([noise_seed, seed])
    member = np.r_[np.ones(n // 2, bool), np.zeros(n - n // 2, bool)]
    score = g.normal(size=n) + shift * member
    return {"kind": "membership", "dataset": "digits", "model": "mlp", "defense": defense, "attack": attack,
            "status": status, "error": None if status == "done" else "boom",
            "spec": {"membership": {"form": "reference"}, "seed": seed, "attack": "membership-" + attack},
            "metrics": {"auc": float(roc_auc_score(member, score)), "train_losses": losses, "test_accuracy": 0.9,
                        "epsilon": 2.0 if defense.startswith("dpsgd") else None},
            "per_sample": {"score": score.tolist(), "member": member.astype(int).tolist()}}


def _rows() -> list[dict]:
    base = [0.20, 0.22, 0.21, 0.19, 0.20]
    return [
        _row("none", "loss", 0.6, base, noise_seed=1), _row("none", "lira", 1.0, base, noise_seed=2),
        # DP-SGD: no signal left, a large utility cost
        _row("dpsgd:1,1", "loss", 0.0, [0.9, 0.95, 0.92, 0.91, 0.93], noise_seed=3),
        _row("dpsgd:1,1", "lira", 0.0, [0.9, 0.95, 0.92, 0.91, 0.93], noise_seed=4),
        # dropout: half the signal at a small cost
        _row("dropout:0.3", "loss", 0.3, [b + 0.02 for b in base], noise_seed=5),
        _row("dropout:0.3", "lira", 0.5, [b + 0.02 for b in base], noise_seed=6),
        _row("dropout:0.3", "rmia", 0.0, [], status="failed"),
    ]


def test_auc_and_its_paired_difference_match_independent_computations():
    g = np.random.default_rng(0)
    m = np.r_[np.ones(300, bool), np.zeros(300, bool)]
    a, b = g.normal(size=600) + 0.8 * m, g.normal(size=600) + 0.2 * m
    single = auc_bootstrap({0: (a, m)})
    assert math.isclose(single.mean, roc_auc_score(m, a)) and single.low < single.mean < single.high
    assert single.n == 600
    diff = auc_bootstrap({0: (a, m)}, {0: (b, m)})
    assert math.isclose(diff.mean, roc_auc_score(m, a) - roc_auc_score(m, b)) and diff.above(0.0)
    same = auc_bootstrap({0: (a, m)}, {0: (a.copy(), m)})
    assert same.mean == same.low == same.high == 0.0  # an exact tie stays exact


def test_tpr_is_given_only_where_the_non_members_measure_it():
    small = membership_rows([_row("none", "lira", 1.0, [0.2], n=1000)])[0]  # 500 non-members
    assert small.tpr[0.01] is None and small.tpr[0.001] is None and small.tpr0.n == 500
    big = membership_rows([_row("none", "lira", 3.0, [0.2], n=2000)])[0]  # 1 000 non-members
    t = big.tpr[0.01]
    assert t is not None and big.tpr[0.001] is None and t.n == 1000 and t.above(0.01)
    # its threshold admits at most 1 % of the non-members
    s, m = big.points[0]
    assert big.tpr0.mean <= t.mean


def test_the_strongest_attack_per_defense_and_its_paired_utility_cost():
    found = {d.defense: d for d in membership_defenses(_rows())}
    assert found["none"].strongest.attack == "lira"  # the larger shift: the higher AUC
    assert found["dropout:0.3"].strongest.attack == "lira"
    rmia = next(a for a in found["dropout:0.3"].attacks if a.attack == "rmia")
    assert rmia.trials == 0 and rmia.failed == 1 and "boom" in rmia.reasons[0]
    assert found["dpsgd:1,1"].stops and not found["none"].stops
    cost = found["dropout:0.3"].utility.interval
    assert math.isclose(cost.mean, 0.02) and cost.n == 5  # paired by model: the target and 4 reference models
    assert found["dpsgd:1,1"].utility.mean > 0.5 and found["dpsgd:1,1"].epsilon == 2.0


def test_verdicts_stop_decide_and_tie_like_the_reconstruction_verdicts():
    found = {v.budget: v for v in membership_verdicts(membership_defenses(_rows()))}
    # any cost: DP-SGD stops every attack (no AUC above chance)
    assert found[math.inf].status == "stops" and found[math.inf].defense == "dpsgd:1,1"
    # within 0.05: dropout leaks significantly less than none (paired over the same points)
    v = found[0.05]
    assert v.status == "decided" and v.defense == "dropout:0.3" and v.tied == []
    assert v.margin.above(0.0) and v.auc.n == N and v.baseline.mean > v.auc.mean
    # a defense no different from none is tied with it, never decided by its name
    rows = [r for r in _rows() if r["defense"] == "none"]
    rows += [{**_row("prune:0.5", a, s, [0.21] * 5, noise_seed=k), "defense": "prune:0.5"}
             for a, s, k in (("loss", 0.6, 1), ("lira", 1.0, 2))]
    same = [v for v in membership_verdicts(membership_defenses(rows)) if v.budget == 0.05][0]
    assert same.status == "tied" and {same.defense, *same.tied} == {"none", "prune:0.5"}


def test_the_resampled_auc_counts_agree_with_rank_sums_on_tied_scores():
    from scipy.stats import rankdata

    from leakbench.evaluation.membership.verdict import _auc_weighted

    g = np.random.default_rng(3)
    s = np.round(g.normal(size=300), 1)  # many ties
    m = g.random(300) < 0.4
    rows = g.integers(0, 300, size=(7, 300))
    for r, got in zip(rows, _auc_weighted(s, m, rows)):
        ss, mm = s[r], m[r]
        ranks = rankdata(ss)
        want = (ranks[mm].sum() - mm.sum() * (mm.sum() + 1) / 2) / (mm.sum() * (~mm).sum())
        assert math.isclose(got, want, rel_tol=1e-12)
