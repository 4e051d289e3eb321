"""The report as a PDF, printed by headless Chromium: ``write_pdf("report/index.html")`` → ``report/report.pdf``.

Chromium is found on ``PATH`` (:data:`BROWSERS`) or named by ``$LEAKBENCH_CHROMIUM``; without one,
:func:`write_pdf` raises a :class:`~leakbench.errors.ConfigError` that names the fix.  The page is printed from
a temporary copy beside ``index.html`` with every collapsible section open (a closed ``<details>`` would print
as its title only); print CSS shows every metric of the attack tables, each under its name, and hides the
contents bar.  Chromium runs with no network and a timeout, in a process group of its own: past the timeout
(or on any interruption) the whole group — the browser and every child it started — is killed.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
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
    """The Chromium executable: ``$LEAKBENCH_CHROMIUM`` when set (and an executable file), else the first of
    :data:`BROWSERS` on ``PATH``; None when there is none (:func:`chromium_problem` says why)."""
    explicit = os.environ.get("LEAKBENCH_CHROMIUM")
    if explicit:
        return None if _problem(explicit) else (explicit if Path(explicit).is_file() else shutil.which(explicit))
    return next((found for b in BROWSERS if (found := shutil.which(b))), None)


def _problem(browser: str) -> str | None:
    """Why ``browser`` (a path, or a name on PATH) cannot be run; None when it can."""
    path = Path(browser)
    if not path.exists():
        found = shutil.which(browser) if os.sep not in browser else None
        return None if found else "no such file" + ("" if os.sep in browser else " (nor a program of that name on PATH)")
    if path.is_dir():
        return "a directory, not a program"
    if not os.access(path, os.X_OK):
        return f"not executable (chmod +x {browser})"
    return None


def chromium_problem() -> str:
    """The one-line reason no Chromium was found, naming the fix."""
    explicit = os.environ.get("LEAKBENCH_CHROMIUM")
    why = _problem(explicit) if explicit else None
    if why and why.startswith("no such file"):
        return NO_BROWSER.format(names=", ".join(BROWSERS)) + f" (LEAKBENCH_CHROMIUM={explicit!r}: {why})"
    if why:
        return (f"expected LEAKBENCH_CHROMIUM to name a Chromium executable, got {explicit!r}: {why} "
                "(environment LEAKBENCH_CHROMIUM); point it at the browser, or unset it to look on PATH")
    return NO_BROWSER.format(names=", ".join(BROWSERS))


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the browser's whole process group (it was started as the leader of a new session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass


def _run(command: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, stderr) of ``command`` run in a new session; past ``timeout`` its whole group is killed and
    :class:`subprocess.TimeoutExpired` raised."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err or ""
    finally:
        _kill_group(proc)  # a timeout, an interrupt, or children left behind by a browser that exited


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
    if browser is not None and (why := _problem(browser)):
        raise ConfigError(f"expected a Chromium executable, got {browser!r}: {why} (argument browser)")
    browser = browser or find_chromium()
    if browser is None:
        raise ConfigError(chromium_problem())
    pdf = Path(pdf) if pdf is not None else index.with_name("report.pdf")
    pdf.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".print-", suffix=".html", dir=index.parent)  # beside it: relative images
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_all_open(index.read_text(encoding="utf-8")))
        with tempfile.TemporaryDirectory(prefix="leakbench-chromium-") as profile:
            try:
                code, stderr = _run([browser, *FLAGS, f"--user-data-dir={profile}",
                                     f"--print-to-pdf={pdf.resolve()}", Path(tmp).resolve().as_uri()], timeout)
            except subprocess.TimeoutExpired:
                raise LeakbenchError(f"{browser} did not print {index} within {timeout:g} s (it and its children "
                                     "were stopped)") from None
            except OSError as err:
                raise ConfigError(f"expected a Chromium executable, got {browser!r}: {err.strerror or err} "
                                  "(LEAKBENCH_CHROMIUM or argument browser)") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    if not pdf.is_file() or pdf.stat().st_size == 0:
        tail = " ".join(stderr.split())[-300:]
        raise LeakbenchError(f"{browser} wrote no PDF (exit {code}): {tail}")
    return pdf


__all__ = ["write_pdf", "find_chromium", "chromium_problem", "BROWSERS"]
