"""Every code block of README.md and docs/*.md runs on its own, as a reader would paste it.

``python`` blocks run in a fresh interpreter each; ``bash``/``sh`` blocks run as one bash script with the
venv's ``leakbench`` on PATH; ``yaml`` blocks parse, and a block that is a whole sweep spec validates.
Each block runs in its own empty directory holding a link to ``examples/`` and ``scripts/``. Blocks
without a language are program output and are not run.

A block is marked by an HTML comment on the line before its fence:

- ``<!-- docs-test: slow -->`` — runs with ``make test-slow`` only (longer than a few seconds);
- ``<!-- docs-test: skip REASON -->`` — never runs here, with the reason (the set-up commands
  themselves, a Ray cluster, a package the machine cannot install).
"""
from __future__ import annotations

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


@pytest.mark.parametrize("block", list(_params()))
def test_block_runs(block: Block, tmp_path: Path) -> None:
    cwd = _workdir(tmp_path)
    if block.lang == "yaml":
        doc = yaml.safe_load(block.code)
        if isinstance(doc, dict) and {"datasets", "models"} <= set(doc):
            from leakbench.evaluation.sweep_spec.model import load_spec

            load_spec(doc)
        return
    if block.lang == "python":
        cmd = [sys.executable, "-c", block.code]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    try:
        done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                              timeout=TIMEOUT[block.mark == "slow"])
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id}: still running after {TIMEOUT[block.mark == 'slow']} s — mark it "
                    "<!-- docs-test: slow --> or shorten it")
    assert done.returncode == 0, f"{block.id} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, f"{block.id} printed a traceback:\n{done.stderr[-3000:]}"
    warned = [line for line in done.stderr.splitlines() if "Warning:" in line]
    assert not warned, f"{block.id} printed library warnings (a reader's output must be clean):\n" + "\n".join(warned)


def test_every_block_is_run_or_says_why() -> None:
    """A new block in an unknown language, or a mark without a reason, is caught here."""
    for b in ALL:
        assert b.lang in RUN or b.lang in ("", "text", "console"), f"{b.id}: unknown block language {b.lang!r}"
        assert b.mark != "skip" or b.reason, f"{b.id}: a skipped block needs its reason"
    assert sum(b.lang == "python" for b in ALL) >= 20
