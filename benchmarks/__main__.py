"""Run benchmarks: ``python -m benchmarks [inverting ...] [--quick]``."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import time
from pathlib import Path

from .common import console


def main() -> None:
    here = Path(__file__).parent
    names = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="leakbench benchmarks")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: all): {', '.join(names)}")
    parser.add_argument("--quick", action="store_true", help="smaller budgets, for a smoke run")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in names]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; known: {', '.join(names)}")
    for name in args.names or names:
        start = time.perf_counter()
        console.rule(f"benchmark {name}")
        importlib.import_module(f"benchmarks.bench_{name}").run(quick=args.quick)
        console.print(f"[dim]{name}: {time.perf_counter() - start:.0f} s[/dim]")


if __name__ == "__main__":
    main()
