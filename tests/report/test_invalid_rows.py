"""The report never takes an invalid result as fact: a negative RMSE is flagged like a non-finite one, left out
of every score, and the report says how many finished rows it left out and why."""
from __future__ import annotations

import sqlite3

import pytest

from leakbench.evaluation import Sweep
from leakbench.evaluation.verdicts.rows import invalid_result, usable
from leakbench.evaluation.verdicts.strongest import strongest
from leakbench.report import write_report

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = {"name": "inv", "datasets": [{"name": "digits", "options": {"size": 8}}],
        "models": [{"spec": "mlp:16", "act": "relu"}], "batch_sizes": [1], "images": 4,
        "attacks": ["fc-inversion"], "defenses": ["none"]}


def test_negative_and_non_finite_rmse_are_invalid():
    assert invalid_result({"rmse": 0.2}) is None and invalid_result({"rmse": 0.0}) is None
    assert "negative RMSE" in invalid_result({"rmse": -0.1})
    assert "non-finite" in invalid_result({"rmse": float("nan")}) and "non-finite" in invalid_result({})
    assert not usable({"status": "done", "rmse": -0.1}) and usable({"status": "done", "rmse": 0.1})


def test_the_report_flags_and_counts_the_rows_it_leaves_out(tmp_path):
    sweep = Sweep(SPEC, tmp_path / "r.db")
    sweep.run()
    keys = [r["key"] for r in sweep.store.rows(kind="attack")]
    sweep.store.close()
    assert len(keys) == 4
    with sqlite3.connect(tmp_path / "r.db") as conn:
        conn.execute("UPDATE results SET rmse = -0.5 WHERE key = ?", (keys[0],))
        conn.execute("UPDATE results SET rmse = NULL WHERE key = ?", (keys[1],))
    sweep = Sweep(SPEC, tmp_path / "r.db")
    rows = sweep.store.rows()
    (best,) = strongest(rows)
    assert best.sd.n == 2  # the two valid batches only
    page = write_report(sweep.store, tmp_path / "rep").index.read_text()
    assert "2 of 4 finished row(s) left out of every score" in page
    assert "1 negative RMSE" in page and "1 non-finite result" in page
    assert "negative RMSE -0.5" in page  # the failed table says why
    sweep.store.close()
