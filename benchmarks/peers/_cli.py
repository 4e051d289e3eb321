"""The command line every reference runner of ``benchmarks/peers`` shares (imported by their ``main`` only: the
runners are scripts run in the peers' own environments, this folder first on their path)."""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch


def parse(description: str, files: tuple[str, ...], **numbers: int) -> argparse.Namespace:
    """Arguments: ``--repo`` and ``--out``, the input ``files`` (each required), integer ``numbers`` (name: default,
    ``latent_steps`` as ``--latent-steps``), ``--threads`` and ``--seed``.  Then torch's thread count is set, torch
    and NumPy are seeded, and the checkout is put first on the import path."""
    parser = argparse.ArgumentParser(description=description)
    for name in ("repo", *files, "out"):
        parser.add_argument(f"--{name}", required=True)
    for name, default in {**numbers, "threads": 1, "seed": 0}.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)           # nevergrad draws its random state from NumPy's global one
    sys.path.insert(0, args.repo)
    return args
