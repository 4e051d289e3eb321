"""One-row slices of every reproduction (``python -m benchmarks reproduce NAME``): the paper's claim
and the chance control, on the bundled data at tiny budgets."""
from __future__ import annotations

import math

import pytest

from benchmarks.reproduce import REPRODUCTIONS, module

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_IG = {"iterations": 30}
TINY_HYBRID = {"iters_1": 20, "iters_2": 20, "iters_rest": 20}


def test_every_reproduction_is_a_module_with_run():
    for name in REPRODUCTIONS:
        assert callable(module(name).run) and module(name).__doc__


def test_cli_refuses_an_unknown_name(capsys):
    from benchmarks.__main__ import reproduce

    with pytest.raises(SystemExit) as stop:
        reproduce(["nope"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "unknown reproduction 'nope'" in err and "chen-campbell" in err


def test_chen_campbell_table1_row_matches_the_paper():
    (row,) = module("chen-campbell").table1(["CNN3 V2"])
    assert row["rd"] == row["paper_rd"] == [-1470, -1050]
    assert round(row["metric"]) == row["paper_metric"]


def test_chen_campbell_appendix_e_row_rgap_exact_where_full_rank_not_on_a_noise_gradient():
    cc = module("chen-campbell")
    rows, _ = cc.appendix_e(only=["CNN2 V1"], names=("rgap",))
    psnr = {r["attack"]: r["psnr"] for r in rows}
    assert psnr["rgap"] > 100  # full rank: exact (the paper: 197.00 − 48.13 = 148.9 dB)
    assert psnr["rgap on noise gradient"] < 30 and psnr["grey image"] < 30
    (row,) = [r for r in rows if r["attack"] == "rgap"]
    assert row["paper_psnr"] == pytest.approx(cc.PAPER_PSNR255["CNN2 V1"][0] - 48.13)


@pytest.mark.slow
def test_chen_campbell_appendix_e_row_with_every_attack_and_control():
    rows, _ = module("chen-campbell").appendix_e(only=["CNN2 V2"], overrides={"hybrid": TINY_HYBRID,
                                                                             "inverting-gradients": TINY_IG})
    psnr = {r["attack"]: r["psnr"] for r in rows}
    assert set(psnr) == {"rgap", "hybrid", "inverting-gradients", "grey image", "rgap on noise gradient",
                         "hybrid on noise gradient", "inverting-gradients on noise gradient"}
    assert all(math.isfinite(v) for v in psnr.values())
    assert psnr["rgap"] > psnr["rgap on noise gradient"]


@pytest.fixture(scope="module")
def pan_row():
    return module("pan").one("mlp:500", 4)


def test_pan_row_attack_recovers_at_least_the_samples_proposition_2_predicts(pan_row):
    assert 0 < pan_row["predicted"] <= pan_row["recovered"] <= pan_row["unique"]
    assert pan_row["noise_recovered"] == 0  # a noise gradient yields no exact sample


def test_pan_row_every_sample_the_attack_calls_unique_is_exact(pan_row):
    # bundled photos, mlp:500, B = 4: Proposition 2 predicts 3 (the 4th sample has one ExAN); a group of neurons
    # shared by two same-label samples used to pass as a 4th sample, a mixture of the two flagged unique at
    # 29.3 dB — the attack's verification (exan_inversion._explains) now withdraws that flag
    assert pan_row["unique"] == pan_row["recovered"]


def test_liu_table1_row_the_bound_falls_like_one_over_sqrt_width():
    rows = module("liu-table1").slopes([64, 128, 256], [10, 20, 40])
    assert abs(rows[0]["trace"] + 0.5) < 0.15 and abs(rows[1]["trace"] - 0.5) < 0.2


def test_liu_table1_clipping_scales_the_bound_by_norm_over_c():
    clip = [r for r in module("liu-table1").defenses(m=32) if r["defense"].startswith("clip")]
    for r in clip:
        assert 0.9 * r["paper"] < r["trace"] < 1.4 * r["paper"]


@pytest.mark.slow
def test_liu_table4_row_imprint_is_exact_under_clipping_and_beats_grey():
    row = module("liu-table4").one(2, "clip:4", attacks=("gradient-inversion", "robbing-the-fed"))
    # clipping scales ∇W and ∇b alike: the ratio the imprint attack reads is exact
    assert row["rmse"]["robbing-the-fed"] < 1e-3 < row["grey"]
    assert row["best"] == "robbing-the-fed" and row["paper"] == (0.17, 0.23, 0.23, 0.22)


@pytest.mark.slow
def test_haim_row_control_uses_non_members_and_counts_agree_with_voting():
    (row,) = module("haim").rows(only=["binary"], binary=2, steps=200, runs=1, iters=100, width="mlp:100-100")
    assert row["n"] == row["n_control"] == 4
    assert 0 <= row["c06"] <= row["c04"] <= row["n_control"] and 0 <= row["m06"] <= row["m04"] <= row["n"]


def test_provable_margin_row_high_dimension_separates_members():
    (row,) = module("provable-margin").rows(only=[300], width=200, n_test=200, steps=300)
    assert row["train_acc"] == 1.0 and row["on_margin"] >= 0.5
    assert row["test_reach"] <= 0.05 and row["auc"] > 0.9


@pytest.mark.slow
def test_cpa_presets_row_every_preset_beats_the_chance_controls():
    row = module("cpa-presets").one("mlp:256", 4, iterations=300)
    p = row["psnr"]
    for label in ("default", "paper"):
        assert p[label] > p["grey image"] + 5 and p[label] > p["paper on noise gradient"] + 5


def test_liu_headline_compares_only_matched_utility_pairs():
    """Pairs whose utility intervals overlap are compared, batch by batch; the others are not."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluation" / "verdicts"))
    from test_verdicts import attack_rows, noisy, utility_rows

    headline = module("liu-headline")
    rows = [*attack_rows("none", noisy(0.05)), *utility_rows("none", [1.0, 1.0, 1.0]),
            # prune:0.9 and noise:0.01 cost the same; prune:0.9 leaks less (higher S_D, same batches)
            *attack_rows("prune:0.9", noisy(0.25, seed=1)), *utility_rows("prune:0.9", [1.05, 1.06, 1.04]),
            *attack_rows("noise:0.01", noisy(0.15, seed=2)), *utility_rows("noise:0.01", [1.05, 1.04, 1.06]),
            # noise:0.1 costs far more: not matched with prune:0.9
            *attack_rows("noise:0.1", noisy(0.29, seed=3)), *utility_rows("noise:0.1", [1.9, 2.0, 1.95],
                                                                            initial=3.0)]
    found = headline.matched(rows)
    assert [(r[0], r[1], r[-1]) for r in found] == [("prune:0.9", "noise:0.01", "prune leaks less")]
    assert headline.spec(full=False)["defenses"][1] == {"prune": [0.3, 0.5, 0.7, 0.9, 0.99]}


@pytest.mark.slow  # 9 s: LAMP trains its prior once per process
def test_text_rows_dager_exact_above_chance_at_tiny_budgets():
    rows = module("text").rows(batches=(4,), iterations=4)
    by = {r[0]: r for r in rows}
    assert set(by) == {"TAG", "LAMP", "DAGER", "chance (unigram)"} and all(r[1] == 4 and r[2] == 16 for r in rows)
    assert by["DAGER"][5] == by["DAGER"][6] == 1.0 and by["DAGER"][7] == "8/8"  # n = 2 batches of 4
    assert by["chance (unigram)"][5] < 0.2 and by["chance (unigram)"][7] == "0/8"
    assert all(math.isfinite(r[5]) and math.isfinite(r[8]) for r in rows)
