"""A warm interpreter for ``tests/test_docs.py``: it imports leakbench (and torch) once, then runs each python block
in a fork of itself, in a fresh ``__main__`` module and working directory, as ``python -c CODE`` would.

Protocol (one JSON object per line): the test sends ``{"code", "cwd", "out", "err", "timeout"}``; this process
forks, the child runs the code with its stdout/stderr in the files ``out``/``err``, and this process answers
``{"rc": exit status or null, "timed_out": bool}``.  The start-up's own stderr (import-time warnings) is written
to the path in ``argv[1]`` before the line ``ready``.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time


def _child(code: str, cwd: str, out: str, err: str) -> int:
    import atexit
    import traceback
    import types

    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdin = open(os.devnull)
    sys.argv = ["-c"]
    main = types.ModuleType("__main__")          # as `python -c`: no __file__, a module of its own
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    sys.path[0] = ""
    rc = 0
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as stop:
        rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 — the block's own failure, printed as the interpreter would
        traceback.print_exc()
        rc = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return rc


def main() -> None:
    log = open(sys.argv[1], "w")
    os.dup2(log.fileno(), 2)
    import leakbench  # noqa: F401 — the warm part: torch, scipy's lazy pieces stay lazy as for a reader
    import matplotlib

    matplotlib.use("Agg")
    sys.stderr.flush()
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                rc = _child(job["code"], job["cwd"], job["out"], job["err"])
            finally:
                os._exit(rc)
        deadline = time.monotonic() + float(job["timeout"])
        status, timed_out = None, False
        while True:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(code)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        print(json.dumps({"rc": status, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    main()
