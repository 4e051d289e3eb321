"""The benchmarks package lives at the repository root, beside src/: make it importable, and keep the
reproductions off ../shared/data (a user's machine has only the bundled data)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True, scope="session")
def bundled_data(tmp_path_factory):
    """Point the benchmark images at a missing file, so they come from the bundled photos (session-wide:
    module-scoped fixtures of the tests build their rows before any function-scoped patch would apply)."""
    import benchmarks.common

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(benchmarks.common, "CIFAR_NPZ", tmp_path_factory.mktemp("nodata") / "absent.npz")
        yield
