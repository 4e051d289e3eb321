"""Progress off a terminal: periodic log lines instead of a silent bar."""
from __future__ import annotations

import pytest

import subprocess
import sys

from leakbench.progress import LogLines, rich_progress, sweep_progress


def test_log_lines_are_rate_limited_with_first_and_last():
    now = [0.0]
    out: list[str] = []
    lines = LogLines("attack", "steps", every=30, write=out.append, clock=lambda: now[0])
    for step in range(1, 101):
        now[0] = step * 1.0  # one second per step
        lines(step, 100, f"loss {1 / step:.3g}")
    assert len(out) == 1 + 99 // 30 + 1  # the first, one per 30 s, the last
    assert "attack: 1/100 steps (1%)" in out[0] and "ETA" in out[1]
    assert "100/100 steps (100%)" in out[-1] and "1m40s elapsed" in out[-1]


def test_off_a_terminal_the_attack_and_the_sweep_print_lines(capsys, monkeypatch):
    monkeypatch.setenv("LEAKBENCH_PROGRESS_EVERY", "0")
    with rich_progress("inverting-gradients") as report:
        for step in (1, 2, 3):
            report(step, 3, 0.5)
    with sweep_progress(4, 1, "demo") as advance:
        advance("done")
        advance("failed")
    text = capsys.readouterr().out.splitlines()
    assert any("inverting-gradients: 3/3 steps (100%)" in t and "loss 0.5" in t for t in text)
    assert any("demo: 1/4 trials" in t and "resuming" in t for t in text)
    assert any("demo: 3/4 trials" in t and "done 1 failed 1" in t for t in text)


@pytest.mark.slow  # a CLI run in a subprocess, ~7 s: `make test-slow` (the other tests here check the lines)
def test_an_attack_run_into_a_file_reports_progress(tmp_path):
    """`leakbench attack … > log`: the log has progress lines, not one bar at the end (issue 20)."""
    code = ("import leakbench as lb\n"
            "d = lb.load('digits', size=8)\n"
            "m = lb.build('mlp:16', input_shape=d.shape, classes=10, seed=0)\n"
            "x, y = d.batch(1, seed=0)\n"
            "lb.attack('inverting-gradients', lb.observe(m, x, y), preset='quick', iterations=40, progress=True)\n")
    log = tmp_path / "log.txt"
    with log.open("w") as fh:
        subprocess.run([sys.executable, "-c", code], stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=120,
                       env={"LEAKBENCH_PROGRESS_EVERY": "0", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    lines = [t for t in log.read_text().splitlines() if "inverting-gradients:" in t]
    assert len(lines) >= 2 and "40/40 steps (100%)" in lines[-1]


class _SlowStep:
    """A stub model factory: a linear classifier whose every forward pass sleeps (a slow step, no wall-clock
    budget on a real attack)."""

    @staticmethod
    def build(seconds: float):
        import time

        import torch
        from torch import nn

        class Slow(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(4, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                time.sleep(seconds)
                return self.fc(x.reshape(len(x), -1))

        return Slow()


def test_a_step_slower_than_the_interval_still_gives_lines(capsys, monkeypatch):
    import torch

    import leakbench as lb

    monkeypatch.setenv("LEAKBENCH_PROGRESS_EVERY", "0.4")  # lines at most every 0.4 s, a heartbeat every 0.05 s
    model = _SlowStep.build(0.5)  # each step: a forward and a double backward through a 0.5 s forward
    obs = lb.Observation.from_gradients(model, torch.autograd.grad(
        torch.nn.functional.cross_entropy(model(torch.rand(1, 4)), torch.tensor([1])), list(model.parameters())),
        batch_size=1, input_shape=(4,))
    with rich_progress("dlg") as report:
        lb.attack("dlg", obs, iterations=2, optimizer="adam", progress=report)
    lines = capsys.readouterr().out.splitlines()
    running = [line for line in lines if "running" in line]
    assert running, lines  # lines while a step was still running, not only when it ended
    assert any("dlg: 1/2 steps" in line or "dlg: 2/2 steps" in line for line in lines)


def test_a_long_run_is_announced_with_its_estimate_and_the_cheaper_way(capsys, monkeypatch):
    import time

    monkeypatch.setenv("LEAKBENCH_PROGRESS_EVERY", "1000")
    with rich_progress("inverting-gradients", advice="for a quick look use --preset quick", warn_after=60) as report:
        for step in range(1, 6):
            time.sleep(0.3)
            report(step, 4800, 0.5)
    text = capsys.readouterr().out
    assert "this run will take about" in text and "4,800 steps at" in text and "--preset quick" in text
    with rich_progress("short", advice="x", warn_after=60) as report:
        for step in range(1, 6):
            time.sleep(0.25)
            report(step, 10, 0.5)
    assert "will take about" not in capsys.readouterr().out
