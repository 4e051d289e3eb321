"""Systematic evaluation: trials per minute with 1 and 2 local workers and with Ray; the store's overhead per trial.

1. The same small sweep (Inverting Gradients on digits, a tanh CNN, defenses × batch sizes) run from an
   empty store in-process, with a pool of 2 spawned workers and as Ray tasks on a local 2-CPU cluster;
   trials per minute and the ratio to the in-process run (the pool's and Ray's start-up are timed
   separately: they are paid once per sweep).
2. What committing one finished trial costs: the SQLite transaction alone, + the NPZ arrays,
   + the PNG tile — measured on real trial results, against the median trial's own time.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from leakbench.evaluation import Store, Sweep, evaluate, load_spec, plan, run_trial
from leakbench.evaluation.running.images import save_trial_files
from leakbench.evaluation.running.pool import PoolRunner

from .common import table


def _spec(quick: bool) -> dict:
    return {
        "name": "bench",
        "datasets": [{"name": "digits"}],
        "models": [{"spec": "cnn:3-8-2-1", "act": "tanh"}],
        "batch_sizes": [1, 4],
        "images": 4 if quick else 8,
        "attacks": [{"name": "inverting-gradients", "options": {"iterations": 60 if quick else 150}}],
        "defenses": ["none", "noise:0.01"] if quick else ["none", "noise:0.01", "prune:0.9"],
    }


def _load() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"load average {one:.1f} {five:.1f} {fifteen:.1f}"
    except OSError:
        return "load average n/a"


def throughput(quick: bool) -> None:
    spec = _spec(quick)
    n = len(plan(load_spec(spec)))
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        summary = evaluate(spec, Path(tmp) / "local.db")
        wall = time.perf_counter() - t
        assert summary.complete, summary
        base = 60 * n / wall
        rows.append(("in-process (1 worker)", n, wall, base, 1.0))

        pool = PoolRunner(2, cache_dir=Path(tmp) / "cache")
        try:
            t = time.perf_counter()  # start both workers (spawn + imports) before the clock runs
            pool.start(wait=True)
            start_up = time.perf_counter() - t
            t = time.perf_counter()
            sweep = Sweep(spec, Path(tmp) / "pool.db", runner=pool)
            summary = sweep.run()
            wall = time.perf_counter() - t
            sweep.store.close()
        finally:
            pool.close()
        assert summary.complete, summary
        rate = 60 * n / wall
        rows.append((f"process pool, 2 workers (+{start_up:.1f} s start-up)", n, wall, rate, rate / base))
        try:
            import ray  # noqa: F401

            from leakbench.evaluation.running.ray_runner import RayRunner

            runner = RayRunner("local", num_cpus=2)
            t = time.perf_counter()
            runner.start(wait=True)  # ray.init and the actors' imports
            start_up = time.perf_counter() - t
            try:
                t = time.perf_counter()
                sweep = Sweep(spec, Path(tmp) / "ray.db", runner=runner)
                summary = sweep.run()
                wall = time.perf_counter() - t
                sweep.store.close()
            finally:
                runner.close()
            assert summary.complete, summary
            rate = 60 * n / wall
            rows.append((f"Ray, local cluster of 2 CPUs (+{start_up:.1f} s ray.init + actors)", n, wall, rate, rate / base))
        except ImportError:
            rows.append(("Ray: not installed (pip install 'leakbench[ray]')", n, float("nan"), float("nan"),
                         float("nan")))
    table("Sweep throughput — trials per minute", ["executor", "trials", "wall s", "trials/min", "× 1 worker"],
          rows, note=f"{n} Inverting Gradients trials on digits (cnn:3-8-2-1 tanh), 1 torch thread per trial, "
                     f"{os.cpu_count()} CPUs, {_load()} at the end")


def store_overhead(quick: bool) -> None:
    spec = load_spec(_spec(True))
    trials = [t for t in plan(spec)][: 4 if quick else 8]
    results = [run_trial(t) for t in trials]
    trial_s = statistics.median(r.seconds for r in results)
    repeat = 20 if quick else 50
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "r.db")
        store.add(trials)

        def per_commit(files: bool, png: bool) -> float:
            best = []
            for i in range(repeat):
                r = results[i % len(results)]
                t = time.perf_counter()
                paths = save_trial_files(store.images_dir, r, png=png) if files else {}
                store.commit(r, paths)
                best.append(time.perf_counter() - t)
            return statistics.median(best)

        for label, files, png in (("SQLite commit only", False, False), ("+ NPZ arrays", True, False),
                                  ("+ NPZ + PNG tile (what a sweep does)", True, True)):
            s = per_commit(files, png)
            rows.append((label, 1000 * s, 100 * s / trial_s))
        store.close()
    table("Store overhead per finished trial", ["what", "ms / trial", "% of median trial"], rows,
          note=f"median over {repeat} commits of real results (B = 1 and 4, 8×8 digits); median trial "
               f"{trial_s:.2f} s; WAL, synchronous=NORMAL; torch threads {torch.get_num_threads()}; {_load()}")


def run(quick: bool = False) -> None:
    throughput(quick)
    store_overhead(quick)
