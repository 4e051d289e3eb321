"""The benchmarks package lives at the repository root, beside src/: make it importable, and keep the
reproductions off ../shared/data (a user's machine has only the bundled data)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def bundled_data(monkeypatch, tmp_path):
    """Point the benchmark images at a missing file, so they come from the bundled photos."""
    import benchmarks.common

    monkeypatch.setattr(benchmarks.common, "CIFAR_NPZ", tmp_path / "absent.npz")
