"""The report rendered by headless Chromium: every plot and grid decodes and every threat model the sweep covers
has a non-empty section (skipped without a Chromium)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from leakbench.evaluation.trials.trial import THREAT_MODELS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_report.py"
spec = importlib.util.spec_from_file_location("check_report", SCRIPT)
check_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_report)

# the hand-made store of all five threat models (test_threats.build)
_threats_spec = importlib.util.spec_from_file_location("report_threat_rows",
                                                      Path(__file__).with_name("test_threats.py"))
threat_rows = importlib.util.module_from_spec(_threats_spec)
sys.modules[_threats_spec.name] = threat_rows  # its dataclass looks its module up while it is defined
_threats_spec.loader.exec_module(threat_rows)

BROWSER = check_report.find_browser()
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no Chromium on PATH (apt-get install chromium); "
                                                           "see scripts/check_report.py")


@needs_browser
def test_report_renders_in_headless_chromium(tmp_path):
    from leakbench.evaluation import evaluate
    from leakbench.report import write_report

    spec = {"datasets": [{"name": "digits"}], "models": [{"spec": "mlp:20", "act": "relu"}], "batch_sizes": [1],
            "images": 1, "attacks": [{"name": "fc-inversion", "preset": "quick"}], "defenses": ["none", "prune:0.5"]}
    evaluate(spec, tmp_path / "r.db")
    files = write_report(tmp_path / "r.db", tmp_path / "report")
    result = check_report.check(files.index, BROWSER)
    assert result.total == len(files.plots) + len(files.grids) > 0
    assert result.ok == result.total and result.passed
    assert result.expected == files.threats == ["eavesdropper"] and result.threats["eavesdropper"] > 0
    # a broken image is reported as such
    files.grids[0].write_bytes(b"not a png")
    result = check_report.check(files.index, BROWSER)
    assert result.ok == result.total - 1 and not result.passed


@pytest.mark.slow  # ~11 s: `make test-slow` (tests/report/test_threats.py checks the same sections in the HTML; test_report_renders_in_headless_chromium stays)
@needs_browser
def test_every_threat_model_has_a_non_empty_section(tmp_path, capsys):
    from leakbench.report import write_report

    with threat_rows.build(tmp_path / "results.db") as store:
        files = write_report(store, tmp_path / "report")
    result = check_report.check(files.index, BROWSER)
    assert result.expected == list(THREAT_MODELS) and not result.empty and result.passed
    assert all(result.threats[t] > 0 for t in THREAT_MODELS)
    assert check_report.main([str(tmp_path / "report")]) == 0
    # a section that renders empty fails the check and is named
    page = files.index.read_text(encoding="utf-8")
    start = page.index('data-threat="membership">')
    end = page.index("</section>", start)
    files.index.write_text(page[:start] + 'data-threat="membership"><h2>Membership</h2>' + page[end:],
                           encoding="utf-8")
    assert check_report.main([str(tmp_path / "report")]) == 1
    assert "empty section for membership" in capsys.readouterr().err
    assert re.search(r"membership=0", files.index.read_text()) is None  # the count is computed by the browser


def test_script_without_report_exits_2(tmp_path, capsys):
    assert check_report.main([str(tmp_path / "nothing")]) == 2
    assert "no report" in capsys.readouterr().err
