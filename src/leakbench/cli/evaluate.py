"""``leakbench evaluate`` (run or resume a sweep into a SQLite store) and ``leakbench report`` (HTML + CSV).

    leakbench evaluate examples/sweep-tiny.yaml --db results.db --workers 2
    leakbench evaluate sweep.yaml --db results.db --ray auto      # Ray tasks (pip install 'leakbench[ray]')
    leakbench report results.db --out report/                     # report/index.html, results.csv
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, Sequence

import typer
from rich.table import Table

from ..errors import ConfigError
from ..evaluation import Store, Sweep, SweepSummary, load_spec, plan, strongest
from ..evaluation.strongest import Strongest
from ..report import write_report
from .common import app, console, reports_errors


def strongest_tables(best: Sequence[Strongest]) -> list[Table]:
    """Rich tables of S_D, one per (dataset, model): per defense and B the strongest attack, its scores and
    how many of the attacks ran (the others were not applicable or failed)."""
    def num(v: Any, digits: int = 3) -> str:
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"

    tables: dict[tuple, Table] = {}
    for s in best:
        where = (s.threat_model, s.dataset, s.model)
        table = tables.get(where)
        if table is None:
            table = tables[where] = Table(title=f"Strongest attack S_D — {s.threat_model}: {s.dataset} · {s.model}")
            for name in ("defense", "B", "strongest attack", "RMSE", "PSNR", "SSIM", "ran"):
                table.add_column(name, justify="left" if name in ("defense", "strongest attack") else "right",
                                 no_wrap=True)
        ran = sum(1 for a in s.scores if a.trials)
        late = sum(a.timed_out for a in s.scores)
        table.add_row(s.defense, str(s.batch_size), s.attack or "[dim]none ran[/dim]", num(s.rmse),
                      num(s.psnr, 2), num(s.ssim), f"{ran}/{len(s.scores)}" + (f" ({late} timed out)" if late else ""))
    return list(tables.values())


def print_summary(summary: SweepSummary) -> None:
    counts = ", ".join(f"{v} {k}" for k, v in sorted(summary.counts.items()))
    stopped = f" (stopped: {summary.stopped})" if summary.stopped else ""
    console.print(f"{summary.ran} trial(s) run in {summary.seconds:.1f} s, {summary.skipped} already finished; "
                  f"store {summary.db}: {counts}{stopped}", highlight=False, soft_wrap=True)


def print_failures(store: Store, keys: Mapping[str, Any], limit: int = 5) -> None:
    failed = [r for r in store.rows(status="failed") if r["key"] in keys]
    for r in failed[:limit]:
        first = (r.get("error") or "").splitlines()[0][:200]
        console.print(f"[yellow]failed[/yellow] {keys[r['key']].label}: {first}", highlight=False, soft_wrap=True)
    if len(failed) > limit:
        console.print(f"… and {len(failed) - limit} more failed trial(s); see the report", highlight=False)


@app.command("evaluate")
@reports_errors
def evaluate_command(
    spec: Annotated[Optional[Path], typer.Argument(help="Sweep spec (YAML), see docs/evaluation.md.")] = None,
    preset: Annotated[Optional[str], typer.Option(
        help="Run a bundled spec instead: demo, liu2024 (Liu et al. 2024's setting, for a GPU or Ray).")] = None,
    db: Annotated[Path, typer.Option(help="SQLite results store (created or resumed).")] = Path("results.db"),
    workers: Annotated[int, typer.Option(help="Local processes running trials (1 = in this process).")] = 1,
    ray: Annotated[Optional[str], typer.Option(
        help="Run trials as Ray tasks: auto (a running cluster, else a local one), local, or an ADDRESS.")] = None,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Run failed trials again.")] = False,
    max_trials: Annotated[Optional[int], typer.Option(help="Stop after this many trials (resume later).")] = None,
    report: Annotated[Optional[Path], typer.Option(help="Also write the HTML report into this directory.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate the spec and count trials; run nothing.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no table.")] = False,
) -> None:
    """Run (or resume) a sweep: every finished trial is committed to --db at once; done trials are skipped."""
    if workers < 1:
        raise ConfigError(f"expected --workers ≥ 1, got {workers}")
    if ray is not None and workers != 1:
        raise ConfigError("expected either --workers or --ray, got both (Ray sizes its own pool)")
    if (spec is None) == (preset is None):
        raise ConfigError("expected a sweep spec file or --preset NAME (one of them), e.g. "
                          "`leakbench evaluate examples/sweep-tiny.yaml` or `leakbench evaluate --preset demo`")
    if preset is not None:
        from ..evaluation.bundled import preset_path

        spec = preset_path(preset)
    sweep_spec = load_spec(spec)
    if dry_run:
        trials = plan(sweep_spec)
        kinds = {k: sum(1 for t in trials if t.kind == k) for k in ("attack", "utility", "bound")}
        console.print(f"{spec}: valid; {len(trials)} trial(s) ("
                      + ", ".join(f"{n} {k}" for k, n in kinds.items() if n) + ")", highlight=False)
        return
    sweep = Sweep(sweep_spec, db, workers=workers, ray=ray, retry_failed=retry_failed, max_trials=max_trials)
    try:
        summary = sweep.run(progress=not quiet)
        if not quiet:
            print_summary(summary)
            print_failures(sweep.store, sweep.by_key)
            for table in strongest_tables(strongest([r for r in sweep.store.rows(kind="attack")
                                                     if r["key"] in sweep.by_key])):
                console.print(table)
        if report is not None:
            files = write_report(sweep.store, report)
            console.print(f"report: {files.index}", highlight=False, soft_wrap=True)
    finally:
        sweep.store.close()


@app.command("report")
@reports_errors
def report_command(
    db: Annotated[Path, typer.Argument(help="Results store written by `leakbench evaluate`.")],
    out: Annotated[Path, typer.Option(help="Output directory of the report.")] = Path("report"),
) -> None:
    """Write a static HTML report (tables, plots, image grids) and CSV/Parquet exports of a results store."""
    files = write_report(db, out)
    extra = f", {files.parquet.name}" if files.parquet else " (Parquet: install pandas and pyarrow)"
    console.print(f"wrote {files.index}, {files.csv.name}, {files.strongest_csv.name}{extra}, "
                  f"{len(files.plots)} plot(s), {len(files.grids)} grid(s)", highlight=False, soft_wrap=True)
