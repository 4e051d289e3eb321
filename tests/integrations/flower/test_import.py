"""leakbench never imports Flower; the integration without Flower says how to install it (runs without flwr too)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[3] / "src")

PROBE = """
import sys
import leakbench, leakbench.cli, leakbench.report, leakbench.evaluation.store
print("flwr loaded:", "flwr" in sys.modules)
sys.modules["flwr"] = None  # as if Flower were not installed
try:
    import leakbench.integrations.flower
except ImportError as err:
    print("error:", err)
"""


def test_leakbench_never_imports_flwr_and_the_integration_names_the_extra():
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "flwr loaded: False"
    assert lines[1].startswith("error: leakbench.integrations.flower needs Flower")
    assert "pip install '.[flower]'" in lines[1]
