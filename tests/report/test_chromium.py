"""The report rendered by headless Chromium: every plot and grid decodes (skipped without a Chromium)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_report.py"
spec = importlib.util.spec_from_file_location("check_report", SCRIPT)
check_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_report)

BROWSER = check_report.find_browser()


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on PATH (apt-get install chromium); "
                                            "see scripts/check_report.py")
def test_report_renders_in_headless_chromium(tmp_path):
    from leakbench.evaluation import evaluate
    from leakbench.report import write_report

    spec = {"datasets": [{"name": "digits"}], "models": [{"spec": "mlp:20", "act": "relu"}], "batch_sizes": [1],
            "images": 1, "attacks": [{"name": "fc-inversion", "preset": "quick"}], "defenses": ["none", "prune:0.5"]}
    evaluate(spec, tmp_path / "r.db")
    files = write_report(tmp_path / "r.db", tmp_path / "report")
    ok, total = check_report.check(files.index, BROWSER)
    assert total == len(files.plots) + len(files.grids) > 0
    assert ok == total
    # a broken image is reported as such
    files.grids[0].write_bytes(b"not a png")
    ok, total = check_report.check(files.index, BROWSER)
    assert ok == total - 1


def test_script_without_report_exits_2(tmp_path, capsys):
    assert check_report.main([str(tmp_path / "nothing")]) == 2
    assert "no report" in capsys.readouterr().err
