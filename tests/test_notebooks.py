"""The notebooks under ``notebooks/`` run top to bottom (nbclient, the ``python3`` kernel of this Python).

The quick start runs in the default suite; every notebook runs under ``-m slow`` (``make test-slow``).  The kernel
imports leakbench from this checkout (checked in the kernel itself), the committed notebooks carry no outputs,
and they match ``scripts/make_notebooks.py``, which writes them.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the dev extra installs nbformat, nbclient and ipykernel")
nbclient = pytest.importorskip("nbclient", reason="the dev extra installs nbformat, nbclient and ipykernel")
pytest.importorskip("ipykernel", reason="the dev extra installs nbformat, nbclient and ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SRC = ROOT / "src"
_spec = importlib.util.spec_from_file_location("make_notebooks", ROOT / "scripts" / "make_notebooks.py")
make_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_notebooks)

#: run in the kernel before the notebook: where leakbench and the kernel's Python come from.
WHERE = "import json, sys, leakbench; print(json.dumps({'file': leakbench.__file__, 'python': sys.executable}))"


def execute(name: str, tmp_path: Path, monkeypatch, timeout: int) -> nbformat.NotebookNode:
    """Run ``notebooks/NAME.ipynb`` in a fresh ``python3`` kernel with ``tmp_path`` as its working folder."""
    # the kernel inherits this environment: the checkout's src first (as `pip install -e .` gives), one thread
    monkeypatch.setenv("PYTHONPATH", str(SRC) + (":" + p if (p := __import__("os").environ.get("PYTHONPATH")) else ""))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(WHERE))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    where = json.loads("".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("name") == "stdout"))
    assert Path(where["file"]).resolve().is_relative_to(SRC.resolve()), where  # leakbench from this checkout
    assert Path(where["python"]).resolve().parent == Path(sys.executable).resolve().parent, where  # this venv
    return nb


def _stdout(nb, index: int) -> str:
    return "".join(o.get("text", "") for o in nb.cells[index + 1].outputs if o.get("name") == "stdout")


def test_notebooks_are_committed_without_outputs_and_match_their_script():
    names = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert names == sorted(make_notebooks.NOTEBOOKS)
    for name in names:
        text = (NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8")
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, name
        assert text == make_notebooks.text(name), f"{name}: run python scripts/make_notebooks.py"


@pytest.mark.slow  # the notebook end to end, ~11 s: `make test-slow` (tests/test_docs.py runs the README's quick start)
def test_quick_start_notebook_runs(tmp_path, monkeypatch):
    nb = execute("quick-start", tmp_path, monkeypatch, timeout=120)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    scores = "".join(o.get("text", "") for o in cells[3].outputs)
    assert "chance" in scores and "better than chance: True" in scores
    assert any("image/png" in o.get("data", {}) for o in cells[-1].outputs)  # the grid is shown
    assert (tmp_path / "quick-start.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quick-start", "own-round", "compare-defenses", "flower"])
def test_every_notebook_runs(name, tmp_path, monkeypatch):
    if name == "flower":
        pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'leakbench[flower]'")
        pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install 'leakbench[flower]'")
    nb = execute(name, tmp_path, monkeypatch, timeout=300)
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    expect = {"quick-start": "better than chance: True", "own-round": "update 3",
              "compare-defenses": "eavesdropper · digits", "flower": "4 updates audited"}[name]
    assert expect in printed, printed[-2000:]
