"""The robustness tests' shared folders: one work folder with a finished store (``w``) and the issue-29
files (``u``), built once per session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _robust import make_untrusted, make_work  # noqa: E402


@pytest.fixture(scope="session")
def w(tmp_path_factory) -> Path:
    """A work folder with a finished results store and every bad file the tables refer to."""
    return make_work(tmp_path_factory.mktemp("robust"))


@pytest.fixture(scope="session")
def u(w) -> Path:
    """The files of the issue-29 cases, in the robustness work folder."""
    return make_untrusted(w)
