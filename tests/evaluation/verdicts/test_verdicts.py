"""The verdict's decision rules on constructed stores: chance, ties, divergence, gains, incomplete attack sets."""
from __future__ import annotations

import math

import numpy as np

from leakbench.evaluation import Store, TrialResult, TrialSpec
from leakbench.evaluation.verdicts.rules import BUDGETS, privacy_utility, verdicts
from leakbench.evaluation.verdicts.strongest import INCOMPLETE, strongest
from leakbench.evaluation.verdicts.utility import utility_table

CHANCE = 0.30


def attack_rows(defense, values, *, attack="ig", name="inverting-gradients", b=4, chance=CHANCE, threat=None,
                model="cnn"):
    """One row per batch (seed 0, batch i) with the given mean RMSE and per-image values around it."""
    out = []
    for i, v in enumerate(values):
        r = {"kind": "attack", "dataset": "photos", "model": model, "attack": attack, "defense": defense,
             "batch_size": b, "status": "done", "rmse": v, "psnr": -20 * math.log10(max(v, 1e-9)), "seed": 0,
             "batch": i, "spec": {"attack": name, "seed": 0, "batch": i},
             "metrics": {"chance_rmse": chance},
             "per_sample": {"rmse": [v] * b, "chance_rmse": [chance] * b}}
        if threat:
            r["threat_model"] = threat
        out.append(r)
    return out


def utility_rows(defense, losses, *, b=4, initial=2.0):
    return [{"kind": "utility", "status": "done", "dataset": "photos", "model": "cnn", "defense": defense,
             "batch_size": b, "spec": {"utility": {"seed": s}},
             "metrics": {"train_loss": loss, "test_accuracy": 0.5, "initial_loss": initial}}
            for s, loss in enumerate(losses)]


def decide(rows, budgets=BUDGETS):
    return {v.budget: v for v in verdicts(privacy_utility(strongest(rows), utility_table(rows)), budgets)}


def noisy(mean, n=12, sd=0.01, seed=0):
    return list(np.random.default_rng(seed).normal(mean, sd, n))


def test_all_candidates_at_chance_name_the_cheapest_and_list_the_rest_as_equivalent():
    rows = [*attack_rows("none", noisy(0.05)),
            # three defenses whose attacks end at or above chance (capped: one class)
            *attack_rows("noise:0.1", noisy(0.50, seed=1)), *attack_rows("graddrop:0.5", noisy(0.33, seed=2)),
            *attack_rows("dpsgd:1,1", noisy(0.31, seed=3)),
            *utility_rows("none", [1.00, 1.01, 0.99]), *utility_rows("noise:0.1", [1.20, 1.22, 1.19]),
            *utility_rows("graddrop:0.5", [1.05, 1.06, 1.04]), *utility_rows("dpsgd:1,1", [1.6, 1.7, 1.65])]
    found = decide(rows)
    v = found[0.1]
    assert v.status == "stops" and v.defense == "graddrop:0.5" and v.tied == []  # the only one within 0.1
    v = found[math.inf]
    assert v.status == "stops" and v.defense == "graddrop:0.5"
    assert v.tied == ["dpsgd:1,1", "noise:0.1"] and v.n == 12 and v.seeds == 3
    # S_D is capped at chance: the diverged-looking 0.50 is not "safer" than 0.33
    assert math.isclose(v.rmse, CHANCE)


def test_two_defenses_within_noise_are_a_tie_and_names_never_break_it():
    rows = [*attack_rows("none", noisy(0.05)),
            *attack_rows("prune:0.9", noisy(0.200, sd=0.05, seed=5)),
            *attack_rows("noise:0.01", noisy(0.205, sd=0.05, seed=6)),
            *attack_rows("clip:1", noisy(0.06, seed=7))]
    v = decide(rows, (math.inf,))[math.inf]
    assert v.status == "tied"
    assert {v.defense, *v.tied} >= {"prune:0.9", "noise:0.01"} and "clip:1" not in v.tied
    # exact ties: identical values everywhere are a tie whatever the names
    rows = [*attack_rows("none", noisy(0.05)), *attack_rows("a-defense", [0.25] * 6), *attack_rows("b", [0.25] * 6)]
    v = decide(rows, (math.inf,))[math.inf]
    assert v.status == "tied" and {v.defense, *v.tied} == {"a-defense", "b"}


def test_a_clear_winner_is_decided_with_its_margin():
    rows = [*attack_rows("none", noisy(0.05)), *attack_rows("prune:0.9", noisy(0.25, seed=1)),
            *attack_rows("clip:1", noisy(0.06, seed=2))]
    v = decide(rows, (math.inf,))[math.inf]
    assert v.status == "decided" and v.defense == "prune:0.9" and v.tied == []
    assert v.margin.low > 0.15 and v.margin.n == 12


def test_few_batches_decide_nothing():
    rows = [*attack_rows("none", [0.05, 0.06]), *attack_rows("prune:0.9", [0.25, 0.26])]
    v = decide(rows, (math.inf,))[math.inf]
    assert v.status == "undecided" and v.n == 2
    best = {s.defense: s for s in strongest(rows)}
    assert not best["prune:0.9"].stops  # n = 2 < MIN_N: no claim either way


def test_diverged_utility_is_excluded_from_every_budget_and_the_plot():
    rows = [*attack_rows("none", noisy(0.05)), *attack_rows("dpsgd:1,1", noisy(0.32, seed=1)),
            *attack_rows("prune:0.9", noisy(0.20, seed=2)),
            *utility_rows("none", [1.0, 1.01, 0.99]), *utility_rows("prune:0.9", [1.05, 1.06, 1.05]),
            # one seed ends above the untrained model's loss, one is non-finite
            *utility_rows("dpsgd:1,1", [2.5, 1.4, float("nan")])]
    table = utility_table(rows)
    assert table[("photos", "cnn", "dpsgd:1,1", 4)]["diverged"].startswith("2 of 3 seed(s)")
    points = {p.defense: p for p in privacy_utility(strongest(rows), table)}
    assert points["dpsgd:1,1"].utility_loss is None and points["dpsgd:1,1"].diverged
    found = decide(rows)
    assert all(v.defense != "dpsgd:1,1" and "dpsgd:1,1" in v.excluded for v in found.values())  # even at any cost
    assert found[math.inf].defense == "prune:0.9" and found[0.1].defense == "prune:0.9"


def test_a_gain_within_noise_is_shown_as_measured_and_overlaps_zero():
    rows = [*attack_rows("none", noisy(0.05)), *attack_rows("clip:1", noisy(0.06, seed=1)),
            *utility_rows("none", [1.00, 1.10, 0.90]), *utility_rows("clip:1", [0.95, 1.08, 0.88])]
    p = next(p for p in privacy_utility(strongest(rows), utility_table(rows)) if p.defense == "clip:1")
    assert p.gain and p.utility_loss < 0  # not clamped to 0
    assert p.utility.interval.low < 0 < p.utility.interval.high  # the interval says: within noise


def test_budget_uses_the_upper_end_of_the_utility_interval():
    rows = [*attack_rows("none", noisy(0.05)), *attack_rows("prune:0.9", noisy(0.25, seed=1)),
            *utility_rows("none", [1.0, 1.0, 1.0]),
            *utility_rows("prune:0.9", [1.02, 1.20, 1.04])]  # mean cost 0.087 ≤ 0.1, but its upper end is not
    found = decide(rows)
    assert found[0.1].defense == "none"
    assert found[math.inf].defense == "prune:0.9"


def test_an_attack_set_without_gradient_matching_is_flagged():
    analytic = [*attack_rows("none", noisy(0.05), attack="fc-inversion", name="fc-inversion", model="mlp"),
                *attack_rows("noise:0.1", noisy(0.31), attack="fc-inversion", name="fc-inversion", model="mlp")]
    matching = attack_rows("none", noisy(0.05), model="cnn")
    best = {s.model: s for s in strongest([*analytic, *matching])}
    assert best["mlp"].incomplete == INCOMPLETE and best["cnn"].incomplete is None
    v = decide(analytic, (math.inf,))[math.inf]
    assert v.incomplete == INCOMPLETE


def test_per_image_strongest_is_at_most_every_attacks_mean():
    rows = []
    for i in range(6):
        # two attacks, each best on a different half of the images
        for attack, name, vals in (("ig", "inverting-gradients", [0.05, 0.05, 0.2, 0.2]),
                                   ("fc", "fc-inversion", [0.2, 0.2, 0.05, 0.05])):
            rows.append({"kind": "attack", "dataset": "photos", "model": "m", "attack": attack, "defense": "none",
                         "batch_size": 4, "status": "done", "rmse": float(np.mean(vals)), "seed": 0, "batch": i,
                         "spec": {"attack": name}, "metrics": {"chance_rmse": CHANCE},
                         "per_sample": {"rmse": vals, "chance_rmse": [CHANCE] * 4}})
    s = strongest(rows)[0]
    assert math.isclose(s.sd.mean, 0.125) and math.isclose(s.per_image.mean, 0.05)


def test_round_trip_through_the_store_keeps_units_and_per_image_scores(tmp_path):
    store = Store(tmp_path / "r.db")
    specs = [TrialSpec(kind="attack", dataset="photos", model="cnn", defense=d, batch_size=2, images=8, batch=i,
                       seed=0, attack="inverting-gradients", attack_key="ig") for d in ("none", "prune:0.9")
             for i in range(4)]
    store.add(specs)
    rng = np.random.default_rng(0)
    for t in specs:
        v = rng.uniform(0.01, 0.05) if t.defense == "none" else rng.uniform(0.2, 0.25)
        store.commit(TrialResult(key=t.key, status="done", metrics={"rmse": v, "chance_rmse": CHANCE},
                                 per_sample={"rmse": [v, v], "chance_rmse": [CHANCE, CHANCE]}))
    best = {s.defense: s for s in strongest(store.rows(kind="attack"))}
    assert best["prune:0.9"].sd.n == 4 and set(best["prune:0.9"].sd_per_batch) == {(0, i) for i in range(4)}
    v = verdicts(privacy_utility(list(best.values()), {}), (math.inf,))[0]
    assert v.status == "decided" and v.defense == "prune:0.9"


def test_a_setting_whose_cost_straddles_the_budget_is_reported_beside_the_pick_as_a_tie():
    # prune leaks least but costs 0.08 ± ~0.1 (its interval straddles 0.1); clip is surely within 0.1
    rows = [*attack_rows("none", noisy(0.05)), *attack_rows("prune:0.9", noisy(0.25, seed=1)),
            *attack_rows("clip:1", noisy(0.15, seed=2)),
            *utility_rows("none", [1.00, 1.00, 1.00]), *utility_rows("prune:0.9", [1.00, 1.16, 1.08]),
            *utility_rows("clip:1", [1.01, 1.02, 1.015])]
    found = decide(rows, (0.1, 0.5, math.inf))
    v = found[0.1]
    assert v.defense == "clip:1" and v.edge == ["prune:0.9"] and v.status == "tied" and v.tied == []
    from leakbench.report.verdict_text import decision

    assert "straddles the budget" in decision(v) and "prune:0.9" in decision(v)
    assert "tied with" not in decision(v), "no empty tie list"
    # a budget the whole interval fits, or the interval lies above: no edge, decided
    assert found[0.5].defense == "prune:0.9" and found[0.5].edge == [] and found[0.5].status == "decided"
    rows_far = [r for r in rows if not (r["kind"] == "utility" and r["defense"] == "prune:0.9")]
    rows_far += utility_rows("prune:0.9", [1.30, 1.31, 1.32])
    v = decide(rows_far, (0.1,))[0.1]
    assert v.defense == "clip:1" and v.edge == [] and v.status == "decided"
    # an edge setting that would lose anyway is not listed
    rows_weak = [r for r in rows if not (r["kind"] == "attack" and r["defense"] == "prune:0.9")]
    rows_weak += attack_rows("prune:0.9", noisy(0.07, seed=1))
    v = decide(rows_weak, (0.1,))[0.1]
    assert v.defense == "clip:1" and v.edge == [] and v.status == "decided"


def test_beside_a_stopping_pick_edge_settings_that_stop_too_are_listed_unless_nothing_is_needed():
    rows = [*attack_rows("none", noisy(0.05)), *attack_rows("noise:0.1", noisy(0.50, seed=1)),
            *attack_rows("prune:0.9", noisy(0.40, seed=2)),
            *utility_rows("none", [1.00, 1.00, 1.00]), *utility_rows("noise:0.1", [1.05, 1.051, 1.052]),
            *utility_rows("prune:0.9", [1.00, 1.16, 1.08])]  # straddles 0.1
    v = decide(rows, (0.1,))[0.1]
    assert v.status == "stops" and v.defense == "noise:0.1" and v.edge == ["prune:0.9"]
    safe = [r for r in rows if not (r["kind"] == "attack" and r["defense"] == "none")]
    safe += attack_rows("none", noisy(0.45, seed=4))  # no attack beats chance even without a defense
    v = decide(safe, (0.1,))[0.1]
    assert v.status == "stops" and v.defense == "none" and v.edge == []
