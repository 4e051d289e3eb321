"""results.csv: labels cannot become spreadsheet formulas; numbers stay numbers."""
from __future__ import annotations

import csv

import pytest

from leakbench.report.export import safe_cell, write_csv


@pytest.mark.parametrize("text", ["=HYPERLINK(\"http://x\",\"y\")", "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)",
                                  "\tdlg", "\r=1+1", "=1", "-", "-inf", "+nan"])
def test_formula_cells_are_quoted(text):
    assert safe_cell(text) == "'" + text


@pytest.mark.parametrize("value", [-0.5, 3, None, True, "-0.5", "+1e-3", "dlg", "prune:0.9", "a=b", ""])
def test_other_cells_are_unchanged(value):
    assert safe_cell(value) == value


def test_written_csv_reads_back_as_text_and_numbers(tmp_path):
    records = [{"attack": "=cmd()", "defense": "@x", "rmse": -0.25, "seed": 3, "label": "-1"}]
    path = write_csv(records, tmp_path / "results.csv")
    (row,) = csv.DictReader(path.open())
    assert row == {"attack": "'=cmd()", "defense": "'@x", "rmse": "-0.25", "seed": "3", "label": "-1"}
    assert float(row["rmse"]) == -0.25
