"""The benchmarks' shared pieces that pick work from the environment, and the trained-layout batches."""
from __future__ import annotations

import pytest
import torch

from benchmarks.bench_trained_layouts import LAYOUTS, LAYOUTS_ENV, _batches
from benchmarks.common import env_names, env_pick, tv_variants

KNOWN = {"distinct": 1, "mixed": 2, "2x4": 3}


def test_env_names_strips_and_drops_empty_entries(monkeypatch):
    monkeypatch.setenv("LB_TEST_NAMES", " a, ,b ,,")
    assert env_names("LB_TEST_NAMES") == ["a", "b"]
    monkeypatch.delenv("LB_TEST_NAMES")
    assert env_names("LB_TEST_NAMES") == []


def test_env_pick_keeps_the_known_order_and_all_when_unset(monkeypatch):
    monkeypatch.delenv("LB_TEST_PICK", raising=False)
    assert env_pick("LB_TEST_PICK", KNOWN) == KNOWN
    monkeypatch.setenv("LB_TEST_PICK", "2x4,distinct")
    assert list(env_pick("LB_TEST_PICK", KNOWN)) == ["distinct", "2x4"]


def test_env_pick_names_the_variable_the_unknown_and_the_known(monkeypatch):
    monkeypatch.setenv(LAYOUTS_ENV, "mixed,nope")
    with pytest.raises(SystemExit, match=f"{LAYOUTS_ENV}: unknown nope; known: distinct, mixed, 2x4"):
        env_pick(LAYOUTS_ENV, LAYOUTS)


def test_tv_variants_parse_or_exit_with_an_example(monkeypatch):
    monkeypatch.setenv("LB_TEST_TV", "0.03, 0.1")
    assert tv_variants("LB_TEST_TV") == [0.03, 0.1]
    monkeypatch.setenv("LB_TEST_TV", "strong")
    with pytest.raises(SystemExit, match="LB_TEST_TV=0.03,0.1"):
        tv_variants("LB_TEST_TV")


def test_trained_layout_batches_are_disjoint_in_the_pool_and_follow_the_pattern():
    labels = torch.arange(200) % 10
    pool = list(range(50, 200))
    for pattern in ([5, 6, 7, 8, 9, 5, 6, 7], [5, 5, 5, 5, 7, 7, 7, 7]):
        batches = _batches(labels, pool, pattern, 3)
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat) == 3 * len(pattern)
        assert set(flat) <= set(pool)
        assert all([int(labels[i]) for i in b] == pattern for b in batches)


def test_interval_agrees_with_scipy_and_is_infinite_below_two_values():
    from scipy import stats

    from benchmarks.common import interval, mean_cell

    values = [0.3, -1.2, 2.5, 0.9, 1.4]
    mean, half = interval(values)
    lo, hi = stats.t.interval(0.95, len(values) - 1, loc=stats.tmean(values), scale=stats.sem(values))
    assert mean == pytest.approx((lo + hi) / 2) and half == pytest.approx((hi - lo) / 2)
    assert interval([1.5]) == (1.5, float("inf"))
    assert mean_cell([1.0, 2.0, 3.0]) == "+2.00 [-0.48, +4.48]" and mean_cell([-1.0]) == "-1.00"
