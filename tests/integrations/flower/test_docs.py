"""The runnable example of docs/flower.md runs and says what the page says."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")

DOC = Path(__file__).resolve().parents[3] / "docs" / "flower.md"


def test_the_audit_core_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    runnable = [b for b in blocks if "LocalTraining(" in b]
    assert len(runnable) == 1, "docs/flower.md has no runnable audit-core example"
    monkeypatch.chdir(tmp_path)
    exec(compile(runnable[0], str(DOC), "exec"), {"__name__": "docs_flower"})
    out = capsys.readouterr().out
    assert out.startswith("done ") and "chance" in out
    from leakbench.evaluation.store import Store

    with Store(tmp_path / "flower-doc.db", readonly=True) as store:
        assert [r["spec"]["run"] for r in store.rows(kind="federated")] == ["by-hand"]
