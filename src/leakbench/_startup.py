"""Ctrl-C while the ``leakbench`` command is still importing: one line and exit code 130, no traceback.

The command's own handler (:func:`leakbench.cli.common.reports_errors`) exists only once the
package is imported, which takes seconds (torch).  A ``KeyboardInterrupt`` before that reaches the
interpreter's top level; when this process is the ``leakbench`` command (the console script or
``python -m leakbench.cli``), :func:`install` makes that one line and exit code 130.  A program
that imports leakbench as a library keeps its own hook.
"""
from __future__ import annotations

import os
import sys

#: set by a sweep for the pool workers it starts: the pid they must not outlive.
PARENT_ENV = "LEAKBENCH_PARENT_PID"


def die_with_parent_early() -> None:
    """In a pool worker still starting (``LEAKBENCH_PARENT_PID`` set): die with that parent from now on.

    Linux's ``PR_SET_PDEATHSIG`` is armed here, before torch is imported, and a parent already gone ends
    this process at once; :func:`leakbench.evaluation.running.workers.die_with_parent` adds the watchdog later.
    """
    value = os.environ.pop(PARENT_ENV, "")
    if not value.isdigit():
        return
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != int(value):
        os._exit(1)


def _is_cli() -> bool:
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if os.path.basename(sys.argv[0] if sys.argv else "") == "leakbench":
        return True
    return any(a == "-m" and i + 1 < len(argv) and argv[i + 1].startswith("leakbench")
               for i, a in enumerate(argv))


def install() -> None:
    """Hook uncaught ``KeyboardInterrupt`` of the ``leakbench`` command into ``interrupted`` + exit 130
    (and arm a starting pool worker's death with its parent: :func:`die_with_parent_early`)."""
    die_with_parent_early()
    if not _is_cli() or getattr(sys.excepthook, "_leakbench", False):
        return
    previous = sys.excepthook
    import signal

    seen = []

    def on_sigint(signum, frame) -> None:
        # remembered: a KeyboardInterrupt that lands inside a module's import can leave that module half
        # imported, and what reaches the top level is then another error (numpy's lazy attributes recurse)
        seen.append(signum)
        signal.default_int_handler(signum, frame)

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)

    def hook(kind, value, tb) -> None:
        if issubclass(kind, KeyboardInterrupt) or seen:
            try:
                sys.stderr.write("interrupted\n")
                sys.stderr.flush()
            finally:
                os._exit(130)
        previous(kind, value, tb)

    hook._leakbench = True  # type: ignore[attr-defined]
    sys.excepthook = hook
