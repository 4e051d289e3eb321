"""Issue 32 §2: ``lb.evaluate(spec, workers=2)`` in a script without ``if __name__ == "__main__":`` is refused
with the fix (spawned workers re-run the script's top level), and a sweep whose trials fail is not truthy."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import leakbench
from leakbench.evaluation import SweepSummary, evaluate

SPEC = ('{"name": "guard", "datasets": [{"name": "digits"}], "models": ["mlp:8"], "batch_sizes": [1], "images": 2, '
        '"attacks": ["fc-inversion"], "defenses": ["none"]}')
FIX = 'wrap the call in `if __name__ == "__main__":`'


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    path = tmp_path / "sweep_script.py"
    path.write_text(textwrap.dedent(body).lstrip())
    src = str(Path(leakbench.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_an_unguarded_script_is_refused_before_any_worker_starts(tmp_path):
    done = _script(tmp_path, f"""
        import leakbench as lb
        from leakbench.evaluation.running.guard import unguarded_main_call

        def where():
            return unguarded_main_call()

        def main():
            print("guarded:", where())

        print("top:", where())
        if __name__ == "__main__":
            main()
        lb.evaluate({SPEC}, "r.db", workers=2)
        """)
    assert done.stdout.splitlines() == ["top: sweep_script.py line 10", "guarded: None"]
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("leakbench.errors.ConfigError: evaluate(..., workers > 1)") and FIX in last
    assert "sweep_script.py line 13" in last
    assert not (tmp_path / "r.db").exists()  # refused before the store was touched


@pytest.mark.slow  # two spawned workers import torch (≈ 20 s on 2 shared cores)
def test_a_worker_that_re_runs_an_unguarded_call_exits_and_the_sweep_is_refused(tmp_path):
    # the parent's check switched off: the spawned workers re-run the call, exit at once, and the pool says why
    done = _script(tmp_path, f"""
        import leakbench as lb
        from leakbench.evaluation.running import guard

        guard.unguarded_main_call = lambda: None
        lb.evaluate({SPEC}, "r.db", workers=2)
        """)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("leakbench.errors.ConfigError: evaluate(..., workers > 1)") and FIX in last


def test_a_summary_with_failed_trials_is_false_and_says_how_many():
    def summary(**counts):
        return SweepSummary(db=Path("r.db"), planned=108, skipped=0, ran=108, counts=counts)

    assert not summary(failed=108) and "all 108 trials failed" in repr(summary(failed=108))
    some = summary(done=96, failed=10, **{"timed out": 2})
    assert not some and some.failed == 12 and repr(some).startswith("SweepSummary(12 of 108 trials failed")
    fine = summary(done=100, **{"n/a": 8})
    assert fine and fine.complete and repr(fine).startswith("SweepSummary(108 of 108 trials finished")


def test_evaluate_warns_and_returns_false_when_trials_fail(tmp_path, monkeypatch):
    from leakbench.evaluation.running import run

    def broken(spec, clock, cache_dir):
        raise RuntimeError("boom")

    monkeypatch.setitem(run.RUNNERS, "attack", broken)
    spec = {"name": "fails", "datasets": [{"name": "digits"}], "models": ["mlp:8"], "batch_sizes": [1], "images": 2,
            "attacks": ["fc-inversion"], "defenses": ["none"]}
    with pytest.warns(RuntimeWarning, match="all 2 trials failed"):
        result = evaluate(spec, tmp_path / "r.db")
    assert not result and result.counts == {"failed": 2} and "all 2 trials failed" in repr(result)
