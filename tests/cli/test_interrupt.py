"""``leakbench attack`` under Ctrl-C: it stops within seconds, keeps the best reconstruction so far, labelled
partial, and exits 130 (a stub model whose forward sleeps makes the steps slow, not a wall-clock budget)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

SLOW = '''
import time
import torch
from torch import nn


class Slow(nn.Module):
    def __init__(self, input_shape=(1, 8, 8), num_classes=10):
        super().__init__()
        self.fc = nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)

    def forward(self, x):
        time.sleep(0.05)
        return self.fc(x.reshape(len(x), -1))
'''


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_keeps_the_partial_reconstruction_and_exits_130(tmp_path):
    (tmp_path / "slowmod.py").write_text(SLOW)
    out = tmp_path / "run"
    # the module is named on PYTHONPATH: the current directory is never searched for user code
    env = {**os.environ, "LEAKBENCH_PROGRESS_EVERY": "0", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "leakbench.cli", "attack", "--data", "digits", "--model",
                             "slowmod:Slow", "--attack", "inverting-gradients", "--preset", "quick", "--option",
                             "iterations=100000", "--out", str(out)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            # a shell's background job inherits SIGINT ignored; the user's terminal does not
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        seen = ""
        while "steps" not in seen and time.monotonic() < deadline:  # wait for the optimisation to run
            seen += proc.stdout.readline()
        assert "steps" in seen, seen
        time.sleep(1.0)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, seen + rest
    assert took < 15, f"Ctrl-C took {took:.1f} s"  # a step is ~0.2 s; scoring and writing the files follow
    assert "labelled partial" in rest
    record = json.loads((out / "metrics.json").read_text())
    assert record["partial"].startswith("interrupted at step")
    assert (out / "reconstruction.npz").exists() and (out / "grid.png").exists()
