"""Reproductions: each seed paper's headline result as one command, the paper's numbers beside ours.

``python -m benchmarks reproduce NAME [--full]``: ``NAME`` is one of :data:`REPRODUCTIONS` (or ``all``);
without ``--full`` every entry runs at a budget that fits 2 CPU cores, with ``--full`` at the paper's
budget.  Every reconstruction table carries its chance controls (grey image, noise gradient, non-member
images, as fits the metric).  The tables and every departure from the papers: ``docs/reproductions.md``.
"""
from __future__ import annotations

import importlib
import time

#: name → (module, what it reproduces)
REPRODUCTIONS = {
    "chen-campbell": ("chen_campbell",
                      "Chen & Campbell 2022: Table 1 (security metric) and Appendix E (R-GAP vs hybrid vs IG)"),
    "pan": ("pan", "Pan et al. 2022: fraction reconstructable through neuron exclusivity against batch size"),
    "liu-table1": ("liu_table1", "Liu et al. 2024 Table 1: Cramér–Rao bound scaling in width, dimension, defenses"),
    "liu-table4": ("liu_table4", "Liu et al. 2024 Table 4 (slice): 4 attacks × defenses at B = 2/4/8"),
    "liu-headline": ("liu_headline", "Liu et al. 2024 Sec. 5.2: at matched utility, does pruning leak less than "
                                     "noise? (paired, with intervals)"),
    "cpa-presets": ("cpa_presets", "Cocktail Party: default vs the paper preset with / without the paper's TV term"),
    "haim": ("haim",
             "Haim et al. 2022 / Buzaglo et al. 2023: kkt reconstruction counts vs the nearest-neighbour control"),
    "text": ("text", "DAGER / LAMP / TAG: ROUGE and exact sequences at B = 1/4/16/64 against the published ordering"),
    "provable-margin": ("provable_margin", "Provable attacks on shallow nets, Figure 1: margin fractions against d"),
}


def module(name: str):
    """The module of reproduction ``name``."""
    return importlib.import_module(f"{__name__}.{REPRODUCTIONS[name][0]}")


def run(names: list[str], *, full: bool = False) -> None:
    from .common import console

    for name in names:
        start = time.perf_counter()
        console.rule(f"reproduce {name}{' --full' if full else ''}: {REPRODUCTIONS[name][1]}")
        module(name).run(full=full)
        console.print(f"[dim]{name}: {time.perf_counter() - start:.0f} s[/dim]")
