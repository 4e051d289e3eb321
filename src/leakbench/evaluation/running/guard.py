"""The ``if __name__ == "__main__":`` guard that worker processes need: finding an unguarded script that
starts a sweep, and refusing it with one message before a spawned child re-runs it."""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

from ...errors import ConfigError

#: the exit code of a spawned worker that found itself re-running an unguarded ``evaluate`` call of the script
UNGUARDED_EXIT = 79


def _guard_message(where: str) -> str:
    return (f"evaluate(..., workers > 1) is called from top-level code of the script ({where}), which every "
            "spawned worker re-runs; wrap the call in `if __name__ == \"__main__\":` (or use workers=1)")


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either operand order)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
        return False
    sides = [node.test.left, *node.test.comparators]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def unguarded_main_call() -> str | None:
    """``"script.py line 12"`` when this call comes from top-level code of the ``__main__`` script outside
    ``if __name__ == "__main__":`` (code a spawned worker re-runs), else None (a guarded call, a function
    called later, an interactive session or notebook, whose main module spawned workers do not re-run)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None
    outer = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            outer = frame
        frame = frame.f_back
    if outer is None:
        return None
    line = outer.f_lineno
    try:
        tree = ast.parse(Path(outer.f_code.co_filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            if _is_main_guard(node) and any(b.lineno <= line <= (b.end_lineno or b.lineno) for b in node.body):
                return None
            return f"{os.path.basename(path)} line {line}"
    return None


def in_spawned_main() -> bool:
    """True inside a spawned child while it re-runs the parent's main script as ``__mp_main__`` (its start-up,
    before ``multiprocessing.parent_process()`` is even set)."""
    if "__mp_main__" not in sys.modules:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


def refuse_unguarded_main() -> None:
    """Refuse to start worker processes from unguarded top-level code of the main script: a
    :class:`ConfigError` here, or (in a worker re-running that code) exit at once with :data:`UNGUARDED_EXIT`."""
    if in_spawned_main():
        raise SystemExit(UNGUARDED_EXIT)
    where = unguarded_main_call()
    if where is not None:
        raise ConfigError(_guard_message(where))


__all__ = ["refuse_unguarded_main", "unguarded_main_call", "UNGUARDED_EXIT"]
