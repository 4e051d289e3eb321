"""What the generative peer benchmarks (``bench_peers_gias``, ``_ggl``, ``_gifd``) share: finding the peer's
environment, the images they attack (``bench_learned_prior``'s variables), calling a reference runner in its own
process, and the paired verdict."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from leakbench.attacks import create
from leakbench.models.prior import PriorConfig, learned_generator

from ..bench_learned_prior import POOLS
from ..common import console, env_ints, interval

HERE = Path(__file__).parent


def environment(name: str, variable: str, marker: str, needs: str) -> tuple[str, str] | None:
    """(python, repo) from ``LEAKBENCH_{variable}_PYTHON`` / ``_REPO`` when the Python exists and the checkout holds
    ``marker``; else None, the reason printed (the benchmark skips)."""
    python = os.environ.get(f"LEAKBENCH_{variable}_PYTHON", "")
    repo = os.environ.get(f"LEAKBENCH_{variable}_REPO", "")
    if python and Path(python).is_file() and repo and (Path(repo) / marker).exists():
        return python, repo
    console.print(f"[yellow]{name} skipped: set LEAKBENCH_{variable}_PYTHON (a Python with {needs}) and "
                  f"LEAKBENCH_{variable}_REPO (a checkout of the authors' repository); see this benchmark's "
                  "docstring[/yellow]")
    return None


@dataclass
class Images:
    """Which images a peer benchmark attacks: ``bench_learned_prior``'s size, count, first batch and pool."""

    size: int
    count: int
    first: int
    pool: str

    @classmethod
    def from_env(cls, quick: bool) -> Images:
        size = env_ints("LEAKBENCH_PRIOR_SIZE", "16")[0]
        count = env_ints("LEAKBENCH_PRIOR_N", "1" if quick else "8")[0]
        first = env_ints("LEAKBENCH_PRIOR_FIRST", "0")[0]
        pool = os.environ.get("LEAKBENCH_PRIOR_POOL", "report")
        if pool not in POOLS or not 0 <= first < count:
            raise SystemExit(f"LEAKBENCH_PRIOR_POOL in {', '.join(POOLS)} and 0 ≤ LEAKBENCH_PRIOR_FIRST < N, got "
                             f"{pool!r} and {first}")
        return cls(size, count, first, pool)


def prior(attack: str, options: dict, shape) -> tuple:
    """(``attack``'s options object for ``options``, the library generator they name, in eval mode)."""
    o = create(attack, **options).options
    gen, _ = learned_generator(shape, public=o.public, config=PriorConfig(
        latent=o.latent, width=o.prior_width, steps=o.prior_steps, seed=o.prior_seed))
    return o, gen.eval()


def call(python: str, runner: str, folder: Path, args: dict, what: str) -> dict:
    """Run ``peers/runner`` with ``python`` on the files in ``folder`` (``--out folder/out.npz``, the caller's thread
    count): its ``.npz`` output as arrays; a failure exits with the runner's last line."""
    cmd = [python, str(HERE / runner), "--out", str(folder / "out.npz"), "--threads", str(torch.get_num_threads())]
    for key, value in args.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the reference {what} failed: {done.stderr.strip().splitlines()[-1:]}")
    with np.load(folder / "out.npz", allow_pickle=False) as out:
        return {k: out[k] for k in out.files}


def paired(ours: list[float], theirs: list[float]) -> tuple[list[float], str]:
    """Per-item differences and the verdict: a tie when the 95 % t-interval of their mean holds 0."""
    diff = [a - b for a, b in zip(ours, theirs)]
    mean, half = interval(diff)
    verdict = "a tie" if abs(mean) <= half else ("leakbench higher" if mean > 0 else "reference higher")
    return diff, f"higher on {sum(d > 0 for d in diff)} of {len(diff)}: {verdict}"
