"""``leakbench demo``: the systematic evaluation on bundled photos (what ``make demo`` runs).

Runs the sweep shipped in ``leakbench/evaluation/presets/demo.yaml`` — every threat
model (eavesdropper, informed eavesdropper, malicious server, published weights,
membership) on 32×32 scikit-image photos with models trained for one epoch, batch
sizes 1, 4 and 8, every defense family, quick budgets — into ``--out`` (default
``./leakbench-demo/``): ``results.db``, ``results-images/`` and ``report/index.html``;
prints the strongest attack per defense setting (S_D) and the report's path.
Re-running resumes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from ..errors import ConfigError
from ..evaluation import Sweep, load_spec, strongest
from ..evaluation.sweep_spec.bundled import preset_path
from ..report import write_report
from .common import app, check_out_dir, clean, console, err_console, reports_errors
from .evaluate import print_failures, print_summary, print_verdicts, strongest_tables


def demo_spec_path() -> Path:
    """The bundled demo spec."""
    return preset_path("demo")


@app.command("demo")
@reports_errors
def demo_command(
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("leakbench-demo"),
    workers: Annotated[int | None, typer.Option(
        help="Local processes running trials (default: 2, or 1 on a single core).")] = None,
    spec: Annotated[Path | None, typer.Option(help="Run this sweep spec instead of the bundled one.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar; print only the report path.")] = False,
) -> None:
    """Every threat model on bundled 32×32 photos (B = 1, 4, 8; 64 on a wide MLP): results.db, report/index.html."""
    workers = workers if workers is not None else min(2, os.cpu_count() or 1)
    if workers < 1:
        raise ConfigError(f"expected --workers ≥ 1, got {workers}")
    check_out_dir(out, "--out")  # a file, /dev/null or a read-only place: one line naming --out, before any work
    sweep_spec = load_spec(spec if spec is not None else demo_spec_path())
    sweep = Sweep(sweep_spec, out / "results.db", workers=workers)
    for note in sweep.notes:
        err_console.print(Text(clean(note), style="yellow"), soft_wrap=True, highlight=False)
    try:
        if not quiet:
            console.print(Text.assemble(("leakbench demo", "bold"), clean(
                f": {len(sweep.trials)} trials ({len(sweep_spec.attacks)} attacks × "
                f"{len(sweep_spec.defense_specs())} defense settings × batch sizes "
                f"{', '.join(map(str, sweep_spec.batch_sizes))}) with {workers} worker(s)")), highlight=False)
        try:
            summary = sweep.run(progress=not quiet)
        except KeyboardInterrupt:
            counts = sweep.store.counts(sweep.by_key)
            kept = sum(counts.get(s, 0) for s in ("done", "failed", "timed out", "n/a"))
            again = "leakbench demo" + (f" --out {out}" if out != Path("leakbench-demo") else "") + \
                (f" --spec {spec}" if spec is not None else "")
            err_console.print(Text(clean(f"interrupted: {kept} of {len(sweep.trials)} trial(s) are kept in "
                                         f"{out / 'results.db'}; resume with: {again}"), style="yellow"),
                              soft_wrap=True, highlight=False)
            raise typer.Exit(130) from None
        files = write_report(sweep.store, out / "report")
        if not quiet:
            print_summary(summary)
            print_failures(sweep.store, sweep.by_key)
            for table in strongest_tables(strongest(sweep.store.rows(kind="attack"))):
                console.print(table)
            print_verdicts(sweep.store)
            console.print(clean(f"report: {files.index}"), highlight=False, soft_wrap=True)
        else:
            console.print(clean(files.index), highlight=False, soft_wrap=True)
    finally:
        sweep.store.close()
