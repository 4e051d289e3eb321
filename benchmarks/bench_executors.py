"""Executors: trials per second for 1 worker, a warm pool of 2 and Ray on 2 CPUs, for short and long trials.

The same sweep (Inverting Gradients on digits, ``cnn:3-8-2-1`` tanh, B = 1, one trial per image) at two
lengths — about 0.2 s a trial (60 steps) and about 3 s (1 000 steps) — run into a fresh store by

- ``1 worker``: in this process (``--workers 1``);
- ``pool ×2``: :class:`~leakbench.evaluation.runners.PoolRunner` with 2 long-lived workers;
- ``Ray, 2 CPUs``: :class:`~leakbench.evaluation.runners.RayRunner` on a local cluster of 2 CPUs (2 actors).

The steps are calibrated in-process at the start.  Every executor is warmed first (imports, dataset; a throw-away sweep of a few trials reaches every
worker), and that start-up is reported apart: it is paid once per sweep.  Targets (issue 16): pool ×2 ≥
1.8 × 1 worker; Ray ≥ 0.8 × pool ×2.  Run ``python -m benchmarks executors`` on a quiet machine: the
ratios are only as good as the free cores.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from leakbench.evaluation import Sweep
from leakbench.evaluation.runners import InProcessRunner, PoolRunner, Runner

from .common import console, table

TARGETS = {"short": 0.2, "long": 3.0}  # seconds a trial, reached by calibrating Inverting Gradients' steps


def _spec(steps: int, images: int, seed: int = 0) -> dict:
    return {"name": f"bench-executors-{steps}", "datasets": [{"name": "digits"}],
            "models": [{"spec": "cnn:3-8-2-1", "act": "tanh"}], "batch_sizes": [1], "images": images,
            "seeds": [seed], "attacks": [{"name": "inverting-gradients", "options": {"iterations": steps}}],
            "defenses": ["none"]}


def _load() -> str:
    try:
        return "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load average n/a"


def _sweep(runner: Runner, spec: dict, db: Path) -> tuple[float, float]:
    """(wall seconds, mean trial seconds) of one sweep from an empty store."""
    t = time.perf_counter()
    sweep = Sweep(spec, db, runner=runner)
    summary = sweep.run()
    wall = time.perf_counter() - t
    seconds = [r["seconds"] for r in sweep.store.rows()]
    sweep.store.close()
    assert summary.complete and summary.counts == {"done": summary.planned}, summary
    return wall, sum(seconds) / len(seconds)


def _calibrate(tmp: Path) -> dict[str, int]:
    """Steps that make a trial last about ``TARGETS`` seconds here (the machine's load included)."""
    runner = InProcessRunner()
    _sweep(runner, _spec(50, 2, seed=98), tmp / "calibrate-warm.db")
    _, mean = _sweep(runner, _spec(400, 2, seed=97), tmp / "calibrate.db")
    return {length: max(10, round(400 * seconds / mean)) for length, seconds in TARGETS.items()}


def _ray():
    try:
        import ray  # noqa: F401
    except ImportError:
        return None
    from leakbench.evaluation.runners import RayRunner

    return lambda: RayRunner("local", num_cpus=2).start(wait=True)


def run(quick: bool = False) -> None:
    counts = {"short": 12 if quick else 24, "long": 2 if quick else 4}
    rounds = 1 if quick else 2
    makers = {"1 worker": InProcessRunner, "pool ×2": lambda: PoolRunner(2).start(wait=True)}
    if _ray() is not None:
        makers["Ray, 2 CPUs"] = _ray()
    else:
        console.print("Ray: not installed (pip install 'leakbench[ray]'); its rows are left out", highlight=False)
    before = _load()
    best: dict[str, dict[str, tuple[float, float, float]]] = {name: {} for name in makers}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        steps = _calibrate(tmp)
        runners: dict[str, Runner] = {}
        try:
            for name, make in makers.items():  # start and warm every executor (imports, dataset)
                t = time.perf_counter()
                runners[name] = make()
                _sweep(runners[name], _spec(steps["short"], 4, seed=99), tmp / f"{name}-warm.db")
                console.print(f"[dim]{name}: start-up and warm-up {time.perf_counter() - t:.1f} s[/dim]",
                              highlight=False)
            for r in range(rounds):  # executors interleaved, best round kept: load spikes hit all alike
                for name, runner in runners.items():
                    for length, n in counts.items():
                        wall, mean = _sweep(runner, _spec(steps[length], n, seed=r),
                                            tmp / f"{name}-{length}-{r}.db")
                        if length not in best[name] or n / wall > best[name][length][0]:
                            best[name][length] = (n / wall, wall, mean)
        finally:
            for runner in runners.values():
                runner.close()
    after = _load()
    rows = []
    for length, n in counts.items():
        base, pool = best["1 worker"][length][0], best["pool ×2"][length][0]
        for name, by_length in best.items():
            rate, wall, mean = by_length[length]
            workers = 1 if name == "1 worker" else 2
            rows.append((name, f"{length} ({steps[length]} steps)", f"{mean:.2f}", n, wall, rate, rate / base,
                         rate / pool, f"{100 * n * mean / (workers * wall):.0f}"))
    table("Executors — trials per second (warm workers, best of the rounds)",
          ["executor", "trials", "mean trial s", "n", "wall s", "trials/s", "× 1 worker", "× pool ×2",
           "busy %"], rows,
          note=f"IG on digits, cnn:3-8-2-1 tanh, B = 1, 1 torch thread a trial; {os.cpu_count()} CPUs; "
               f"{rounds} round(s); {before} before, {after} after. "
               "Targets: pool ×2 ≥ 1.8 × 1 worker, Ray ≥ 0.8 × pool ×2. busy % = time inside trials / "
               "(workers × wall): the executor's own efficiency, whatever the load (a loaded machine "
               "stretches the trials instead).")
    for length in counts:
        rates = {name: best[name][length][0] for name in best}
        line = (f"{length} trials ({best['1 worker'][length][2]:.2f} s each in-process): fastest "
                f"{max(rates, key=rates.get)}; pool ×2 = {rates['pool ×2'] / rates['1 worker']:.2f} × 1 worker")
        if "Ray, 2 CPUs" in rates:
            line += f", Ray = {rates['Ray, 2 CPUs'] / rates['pool ×2']:.2f} × pool ×2"
        console.print(line, highlight=False)
