"""``leakbench report DB --out DIR --pdf``: report.pdf printed by headless Chromium (skipped without one), and one
clear line naming the fix when there is no Chromium."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from leakbench.cli import app
from leakbench.report import pdf as pdf_module
from leakbench.report.pdf import find_chromium, write_pdf

_spec = importlib.util.spec_from_file_location("report_nav_rows", Path(__file__).with_name("test_navigation.py"))
nav_rows = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = nav_rows
_spec.loader.exec_module(nav_rows)

runner = CliRunner()
needs_browser = pytest.mark.skipif(find_chromium() is None, reason="no Chromium on PATH (apt-get install chromium)")


@pytest.fixture
def store(tmp_path):
    nav_rows.build(tmp_path / "results.db").close()
    return tmp_path / "results.db"


@needs_browser
def test_report_pdf_through_the_cli(store, tmp_path):
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", str(store), "--out", str(out), "--pdf"])
    assert result.exit_code == 0, result.output
    pdf = out / "report.pdf"
    data = pdf.read_bytes()
    assert data.startswith(b"%PDF") and len(data) > 20_000
    assert data.count(b"/Type /Page") + data.count(b"/Type/Page") > 1  # not a blank single page
    assert "report.pdf" in result.output
    assert not list(out.glob(".print-*"))  # the printable copy is removed


@needs_browser
def test_write_pdf_is_bounded_by_its_timeout(store, tmp_path, monkeypatch):
    from leakbench.errors import LeakbenchError
    from leakbench.report import write_report

    files = write_report(store, tmp_path / "report")
    slow = tmp_path / "slow-chromium"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    with pytest.raises(LeakbenchError, match="did not print"):
        write_pdf(files.index, browser=str(slow), timeout=1)


def test_no_chromium_is_one_line_naming_the_fix(store, tmp_path, monkeypatch):
    monkeypatch.setenv("LEAKBENCH_CHROMIUM", str(tmp_path / "absent-chromium"))
    assert pdf_module.find_chromium() is None
    result = runner.invoke(app, ["report", str(store), "--out", str(tmp_path / "report"), "--pdf"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: no Chromium found"), result.output
    assert "apt-get install chromium" in lines[0] and "LEAKBENCH_CHROMIUM" in lines[0]
    assert not (tmp_path / "report").exists()  # refused before any work
