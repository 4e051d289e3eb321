"""The report as a PDF, printed by headless Chromium: ``write_pdf("report/index.html")`` → ``report/report.pdf``.

Chromium is found on ``PATH`` (:data:`BROWSERS`) or named by ``$LEAKBENCH_CHROMIUM``; without one,
:func:`write_pdf` raises a :class:`~leakbench.errors.ConfigError` that names the fix.  The page is printed from
a temporary copy beside ``index.html`` with every collapsible section open (a closed ``<details>`` would print
as its title only); print CSS shows every metric of the attack tables, each under its name, and hides the
contents bar.  Chromium runs with no network and a timeout.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import ConfigError, LeakbenchError

#: executables tried in turn on ``PATH``.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: Chromium's flags: headless, no sandbox (containers), no GPU, no network.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage",
         "--allow-file-access-from-files", "--no-pdf-header-footer", "--virtual-time-budget=15000")
NO_BROWSER = ("no Chromium found to print the PDF (looked for {names} on PATH and $LEAKBENCH_CHROMIUM); "
              "install one (e.g. `apt-get install chromium`) or point LEAKBENCH_CHROMIUM at it, or open "
              "index.html in a browser and print it")


def find_chromium() -> str | None:
    """The Chromium executable: ``$LEAKBENCH_CHROMIUM`` when set (and present), else the first of
    :data:`BROWSERS` on ``PATH``; None when there is none."""
    explicit = os.environ.get("LEAKBENCH_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() or shutil.which(explicit) else None
    return next((found for b in BROWSERS if (found := shutil.which(b))), None)


def _all_open(page: str) -> str:
    return re.sub(r"<details(?![^>]*\sopen)", "<details open", page)


def write_pdf(index: str | Path, pdf: str | Path | None = None, *, browser: str | None = None,
              timeout: float = 180) -> Path:
    """Print the report ``index`` (its ``index.html``) to ``pdf`` (default: ``report.pdf`` beside it)."""
    index = Path(index)
    if index.is_dir():
        index = index / "index.html"
    if not index.is_file():
        raise ConfigError(f"expected a report's index.html, got {str(index)!r} (no such file)")
    browser = browser or find_chromium()
    if browser is None:
        raise ConfigError(NO_BROWSER.format(names=", ".join(BROWSERS)))
    pdf = Path(pdf) if pdf is not None else index.with_name("report.pdf")
    pdf.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".print-", suffix=".html", dir=index.parent)  # beside it: relative images
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_all_open(index.read_text(encoding="utf-8")))
        with tempfile.TemporaryDirectory(prefix="leakbench-chromium-") as profile:
            try:
                done = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}",
                                       f"--print-to-pdf={pdf.resolve()}", Path(tmp).resolve().as_uri()],
                                      capture_output=True, text=True, timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                raise LeakbenchError(f"{browser} did not print {index} within {timeout:g} s") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    if not pdf.is_file() or pdf.stat().st_size == 0:
        raise LeakbenchError(f"{browser} wrote no PDF (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return pdf


__all__ = ["write_pdf", "find_chromium", "BROWSERS"]
