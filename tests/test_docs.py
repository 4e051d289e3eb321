"""Every code block of README.md and docs/*.md runs on its own, as a reader would paste it.

``python`` blocks run each in a fresh fork of one warm interpreter that has imported leakbench once
(``tests/_warm_python.py``: a new ``__main__`` module and working directory per block, as ``python -c`` gives;
``LEAKBENCH_DOCS_COLD=1`` runs each in a new interpreter instead); ``bash``/``sh`` blocks run as one bash script with the
venv's ``leakbench`` on PATH; ``yaml`` blocks parse, and a block that is a whole sweep spec validates.
Each block runs in its own empty directory holding a link to ``examples/`` and ``scripts/``. Blocks
without a language are program output and are not run.

A block is marked by an HTML comment on the line before its fence:

- ``<!-- docs-test: slow -->`` — runs with ``make test-slow`` only (longer than a few seconds);
- ``<!-- docs-test: skip REASON -->`` — never runs here, with the reason (the set-up commands
  themselves, a Ray cluster, a package the machine cannot install).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*docs-test:\s*(slow|skip)\s*(.*?)\s*-->\s*$")
RUN = ("python", "bash", "sh", "yaml")
TIMEOUT = {False: 240, True: 1800}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    mark: str  # "" | "slow" | "skip"
    reason: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` with their language and docs-test mark."""
    out, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        mark = MARK.match(lines[start - 1]) if start else None
        out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         mark.group(1) if mark else "", mark.group(2) if mark else ""))
        i = j + 1
    return out


ALL = [b for f in FILES for b in blocks(f)]


def _params():
    for b in ALL:
        if b.lang not in RUN:
            continue
        marks = [pytest.mark.slow] if b.mark == "slow" else []
        if b.mark == "skip":
            marks.append(pytest.mark.skip(reason=b.reason or "marked docs-test: skip"))
        yield pytest.param(b, id=b.id, marks=marks)


def _workdir(tmp_path: Path) -> Path:
    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MPLBACKEND"] = "Agg"
    return env


class _Warm:
    """The warm interpreter (:mod:`tests._warm_python`), started on first use and shared by the session."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_warm_python.py"), str(log)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
        ready = self.proc.stdout.readline().strip()
        assert ready == "ready", f"the warm interpreter did not start:\n{log.read_text()[-3000:]}"
        self.startup = log.read_text()   # import-time warnings count against every block, as they would

    def run(self, code: str, cwd: Path, timeout: float) -> tuple[int | None, bool, str, str]:
        out, err = cwd.parent / f"{cwd.name}.stdout", cwd.parent / f"{cwd.name}.stderr"   # outside the block's cwd
        job = {"code": code, "cwd": str(cwd), "out": str(out), "err": str(err), "timeout": timeout}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        texts = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
        for p in (out, err):
            p.unlink(missing_ok=True)
        return answer["rc"], answer["timed_out"], texts[0], self.startup + texts[1]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    if os.environ.get("LEAKBENCH_DOCS_COLD"):
        yield None
        return
    server = _Warm(tmp_path_factory.mktemp("warm") / "startup.err")
    yield server
    server.close()


@pytest.mark.parametrize("block", list(_params()))
def test_block_runs(block: Block, tmp_path: Path, warm) -> None:
    cwd = _workdir(tmp_path)
    if block.lang == "yaml":
        doc = yaml.safe_load(block.code)
        if isinstance(doc, dict) and {"datasets", "models"} <= set(doc):
            from leakbench.evaluation.sweep_spec.model import load_spec

            load_spec(doc)
        return
    limit = TIMEOUT[block.mark == "slow"]
    late = (f"{block.id}: still running after {limit} s — mark it <!-- docs-test: slow --> or shorten it")
    if block.lang == "python" and warm is not None:
        rc, timed_out, stdout, stderr = warm.run(block.code, cwd, limit)
        if timed_out:
            pytest.fail(late)
    else:
        cmd = [sys.executable, "-c", block.code] if block.lang == "python" else \
            ["bash", "-euo", "pipefail", "-c", block.code]
        try:
            done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            pytest.fail(late)
        rc, stdout, stderr = done.returncode, done.stdout, done.stderr
    assert rc == 0, f"{block.id} failed ({rc}):\n{stdout[-2000:]}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, f"{block.id} printed a traceback:\n{stderr[-3000:]}"
    warned = [line for line in stderr.splitlines() if "Warning:" in line]
    assert not warned, f"{block.id} printed library warnings (a reader's output must be clean):\n" + "\n".join(warned)


def test_every_block_is_run_or_says_why() -> None:
    """A new block in an unknown language, or a mark without a reason, is caught here."""
    for b in ALL:
        assert b.lang in RUN or b.lang in ("", "text", "console"), f"{b.id}: unknown block language {b.lang!r}"
        assert b.mark != "skip" or b.reason, f"{b.id}: a skipped block needs its reason"
    assert sum(b.lang == "python" for b in ALL) >= 20
