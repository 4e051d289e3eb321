"""Run benchmarks: ``python -m benchmarks [inverting ...] [--quick]``;
reproductions: ``python -m benchmarks reproduce NAME [--full]``."""
from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
import time
from pathlib import Path

from .common import console


def reproduce(argv: list[str]) -> None:
    from .reproduce import REPRODUCTIONS, run

    listing = "; ".join(f"{k}: {v[1]}" for k, v in REPRODUCTIONS.items())
    parser = argparse.ArgumentParser(prog="python -m benchmarks reproduce",
                                     description="a seed paper's headline result beside ours, with its chance control")
    parser.add_argument("names", nargs="+", metavar="NAME", help=f"'all' or any of — {listing}")
    parser.add_argument("--full", action="store_true", help="the paper's budget (hours on 2 cores for some entries)")
    args = parser.parse_args(argv)
    names = list(REPRODUCTIONS) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in REPRODUCTIONS]
    if unknown:
        parser.error(f"unknown reproduction {unknown[0]!r}; known: {', '.join(REPRODUCTIONS)} (or all)")
    run(names, full=args.full)


def main() -> None:
    if sys.argv[1:2] == ["reproduce"]:
        reproduce(sys.argv[2:])
        return
    here = Path(__file__).parent
    names = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="leakbench benchmarks "
                                     "(and `python -m benchmarks reproduce NAME [--full]`: the papers' results)")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: all): {', '.join(names)}")
    parser.add_argument("--quick", action="store_true", help="smaller budgets, for a smoke run")
    parser.add_argument("--device", default="cpu",
                        help="torch device for the benchmarks that take one (batched): cpu (default) or cuda")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in names]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; known: {', '.join(names)}")
    for name in args.names or names:
        start = time.perf_counter()
        console.rule(f"benchmark {name}")
        bench = importlib.import_module(f"benchmarks.bench_{name}")
        takes_device = "device" in inspect.signature(bench.run).parameters
        if args.device != "cpu" and not takes_device:
            console.print(f"[yellow]{name} runs on the CPU only (it takes no --device)[/yellow]")
        bench.run(quick=args.quick, **({"device": args.device} if takes_device else {}))
        console.print(f"[dim]{name}: {time.perf_counter() - start:.0f} s[/dim]")


if __name__ == "__main__":
    main()
