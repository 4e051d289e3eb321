"""Issue 48: a ``--pdf`` time-out stops the browser and every child it started; a LEAKBENCH_CHROMIUM that cannot
run is named as the problem (not "no Chromium found")."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from leakbench.errors import ConfigError, LeakbenchError
from leakbench.report.pdf import chromium_problem, find_chromium, write_pdf


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())  # a zombie has stopped


@pytest.fixture
def index(tmp_path):
    page = tmp_path / "report" / "index.html"
    page.parent.mkdir()
    page.write_text("<html><body>report</body></html>")
    return page


def test_a_timeout_kills_the_browser_and_its_children(tmp_path, index):
    pids = tmp_path / "pids"
    browser = tmp_path / "fake-chromium"
    browser.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pids}\n(sleep 60; echo) &\necho $! >> {pids}\nsleep 60\n")
    browser.chmod(0o755)
    start = time.perf_counter()
    with pytest.raises(LeakbenchError, match="did not print"):
        write_pdf(index, browser=str(browser), timeout=0.5)
    assert time.perf_counter() - start < 1.5
    children = [int(p) for p in pids.read_text().split()]
    assert len(children) == 2
    deadline = time.time() + 1
    while any(_alive(p) for p in children) and time.time() < deadline:
        time.sleep(0.02)
    assert not any(_alive(p) for p in children), "the browser's children outlived its timeout"


@pytest.mark.parametrize("make, words", [
    (lambda p: (p.write_text("#!/bin/sh\n"), p.chmod(0o644)), "not executable (chmod +x"),
    (lambda p: p.mkdir(), "a directory"),
])
def test_a_bad_leakbench_chromium_is_named(tmp_path, monkeypatch, index, make, words):
    target = tmp_path / "chromium"
    make(target)
    monkeypatch.setenv("LEAKBENCH_CHROMIUM", str(target))
    assert find_chromium() is None
    assert words in chromium_problem() and "LEAKBENCH_CHROMIUM" in chromium_problem()
    with pytest.raises(ConfigError, match="expected LEAKBENCH_CHROMIUM to name a Chromium executable") as err:
        write_pdf(index)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_an_absent_leakbench_chromium_names_the_install_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAKBENCH_CHROMIUM", str(tmp_path / "absent"))
    assert find_chromium() is None
    why = chromium_problem()
    assert why.startswith("no Chromium found") and "apt-get install chromium" in why and "no such file" in why


def test_a_browser_argument_that_cannot_run_is_one_line(tmp_path, index):
    script = tmp_path / "chromium"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(ConfigError, match="not executable .*argument browser"):
        write_pdf(index, browser=str(script))
