#!/usr/bin/env python3
"""Open a leakbench HTML report in headless Chromium and check that every plot and image grid loads.

    python scripts/check_report.py leakbench-demo/report            # or .../report/index.html
    python scripts/check_report.py report/ --screenshot shot.png    # also save what the browser drew

The report carries a tiny inline script that, once the page has loaded, counts the
``<img>`` elements that decoded (``naturalWidth > 0``) and writes the counts into
``<body data-images-ok=… data-images-total=…>``.  This script loads the page from
disk (``file://``, no server) with ``chromium --headless --dump-dom`` and reads
them back.  Exit code 0 when every image loaded, 1 when one did not, 2 when no
Chromium is installed (``apt-get install chromium``) or the page is missing.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-dev-shm-usage", "--allow-file-access-from-files", "--virtual-time-budget=15000"]


def find_browser(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit if Path(explicit).exists() or shutil.which(explicit) else None
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def check(index: Path, browser: str, *, screenshot: Path | None = None, timeout: float = 120) -> tuple[int, int]:
    """(images loaded, images on the page) as the browser saw them."""
    url = index.resolve().as_uri()
    dom = subprocess.run([browser, *FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=timeout)
    body = re.search(r"<body([^>]*)>", dom.stdout)
    if body is None:
        raise RuntimeError(f"{browser} returned no page (exit {dom.returncode}): {dom.stderr.strip()[-500:]}")
    ok = re.search(r'data-images-ok="(\d+)"', body.group(1))
    total = re.search(r'data-images-total="(\d+)"', body.group(1))
    if ok is None or total is None:
        raise RuntimeError("the page's image check did not run (JavaScript disabled, or not a leakbench report)")
    if screenshot is not None:
        subprocess.run([browser, *FLAGS, f"--screenshot={screenshot.resolve()}", "--window-size=1280,3000", url],
                       capture_output=True, timeout=timeout, check=False)
    return int(ok.group(1)), int(total.group(1))


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
    ok, total = check(index, browser, screenshot=args.screenshot)
    print(f"{index}: {ok} of {total} images loaded in {Path(browser).name}")
    if args.screenshot is not None:
        print(f"screenshot: {args.screenshot}")
    return 0 if total > 0 and ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
