#!/usr/bin/env python3
"""Open a leakbench HTML report in headless Chromium and check that every plot and image grid loads.

    python scripts/check_report.py leakbench-demo/report            # or .../report/index.html
    python scripts/check_report.py report/ --screenshot shot.png    # also save what the browser drew

The report carries a tiny inline script that, once the page has loaded, counts the
``<img>`` elements that decoded (``naturalWidth > 0``) and, per threat-model section
(``<section data-threat=…>``), its table rows and decoded images, and writes them into
``<body data-images-ok=… data-images-total=… data-threat-filled="eavesdropper=12 …">``;
the page lists the threat models it covers in ``<body data-threats=…>``.  This script
loads the page from disk (``file://``, no server) with ``chromium --headless
--dump-dom`` and reads them back.  Exit code 0 when every image loaded and every
threat model the page covers has a non-empty section, 1 otherwise, 2 when no
Chromium is installed (``apt-get install chromium``) or the page is missing.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-dev-shm-usage", "--allow-file-access-from-files", "--virtual-time-budget=15000"]


def find_browser(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit if Path(explicit).exists() or shutil.which(explicit) else None
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


class Check(NamedTuple):
    """What the browser saw: images decoded / on the page, and per threat model the items of its section."""

    ok: int
    total: int
    threats: dict[str, int]
    expected: list[str]

    @property
    def empty(self) -> list[str]:
        """Threat models the page covers whose section is missing or holds nothing."""
        return [t for t in self.expected if self.threats.get(t, 0) == 0]

    @property
    def passed(self) -> bool:
        return self.total > 0 and self.ok == self.total and not self.empty


def check(index: Path, browser: str, *, screenshot: Path | None = None, timeout: float = 120) -> Check:
    """Load ``index`` headless and read back what the page's check script recorded."""
    url = index.resolve().as_uri()
    dom = subprocess.run([browser, *FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=timeout)
    body = re.search(r"<body([^>]*)>", dom.stdout)
    if body is None:
        raise RuntimeError(f"{browser} returned no page (exit {dom.returncode}): {dom.stderr.strip()[-500:]}")
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1)))
    if "data-images-ok" not in attrs or "data-images-total" not in attrs:
        raise RuntimeError("the page's image check did not run (JavaScript disabled, or not a leakbench report)")
    filled = {}
    for item in attrs.get("data-threat-filled", "").split():
        name, _, count = item.rpartition("=")
        filled[name] = int(count) if count.isdigit() else 0
    if screenshot is not None:
        subprocess.run([browser, *FLAGS, f"--screenshot={screenshot.resolve()}", "--window-size=1280,3000", url],
                       capture_output=True, timeout=timeout, check=False)
    return Check(int(attrs["data-images-ok"]), int(attrs["data-images-total"]), filled,
                 attrs.get("data-threats", "").split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="report directory or its index.html")
    parser.add_argument("--browser", help="Chromium executable (default: found on PATH)")
    parser.add_argument("--screenshot", type=Path, help="also save a screenshot of the rendered page")
    args = parser.parse_args(argv)
    index = args.report / "index.html" if args.report.is_dir() else args.report
    if not index.is_file():
        print(f"error: no report at {index} (run `leakbench report results.db --out DIR` first)", file=sys.stderr)
        return 2
    browser = find_browser(args.browser)
    if browser is None:
        print("error: no Chromium found; install one (apt-get install chromium) or pass --browser PATH",
              file=sys.stderr)
        return 2
    result = check(index, browser, screenshot=args.screenshot)
    print(f"{index}: {result.ok} of {result.total} images loaded in {Path(browser).name}")
    sections = ", ".join(f"{t} ({result.threats.get(t, 0)} items)" for t in result.expected) or "none"
    print(f"threat-model sections: {sections}")
    if result.empty:
        print(f"error: empty section for {', '.join(result.empty)}", file=sys.stderr)
    if args.screenshot is not None:
        print(f"screenshot: {args.screenshot}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
