"""``leakbench evaluate`` (run or resume a sweep into a SQLite store) and ``leakbench report`` (HTML + CSV).

    leakbench evaluate examples/sweep-tiny.yaml --db results.db --workers 2
    leakbench evaluate sweep.yaml --db results.db --ray auto      # Ray tasks (pip install 'leakbench[ray]')
    leakbench report results.db --out report/                     # report/index.html, results.csv

``evaluate`` checks everything before the first trial (:func:`~leakbench.evaluation.running.preflight.preflight`:
size, every dataset loaded, every model built, one client round), refuses a store that holds another
sweep (``--force`` adds to it), exits 1 when trials failed and, on Ctrl-C, prints how many trials are
kept and the command that resumes.  ``report`` opens the store read-only.
"""
from __future__ import annotations

import contextlib
import html
import math
import re
import shlex
from pathlib import Path
from typing import Annotated, Any
from collections.abc import Mapping, Sequence

import typer
from rich.table import Table
from rich.text import Text

from ..errors import ConfigError
from ..models.custom import add_code_paths, deferred_imports
from ..evaluation import Store, Sweep, SweepSummary, load_spec, strongest
from ..evaluation.running.preflight import check_size, preflight
from ..evaluation.sweep_spec.entries import MAX_STACK
from ..evaluation.sweep_spec.check import MAX_TRIALS
from ..evaluation.verdicts.strongest import Strongest
from ..plugins import loaded
from ..report import write_report
from ..report.pdf import chromium_problem, find_chromium, write_pdf
from .common import app, check_out_dir, clean, console, err_console, reports_errors


def strongest_tables(best: Sequence[Strongest]) -> list[Table]:
    """Rich tables of S_D, one per (dataset, model): per defense and B the strongest attack, its scores and
    how many of the attacks ran (the others were not applicable or failed)."""
    def num(v: Any, digits: int = 3) -> str:
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"

    tables: dict[tuple, Table] = {}
    from ..evaluation.sweep_spec.modality import is_mismatch

    for s in best:
        if s.scores and all(a.not_applicable and is_mismatch(a.not_applicable) for a in s.scores):
            continue  # an image model or attack on text (or back): every trial n/a
        where = (s.threat_model, s.dataset, s.model)
        table = tables.get(where)
        if table is None:
            table = tables[where] = Table(title=Text(clean(f"Strongest attack S_D — {s.threat_model}: {s.dataset} · "
                                                           f"{s.model}")))
            metric = "token error = 1 − token acc." if s.metric == "token_error" else "RMSE"
            for name in ("defense", "B", "strongest attack", f"S_D ({metric}) ± 95 % CI", "n", "chance", "PSNR",
                         "SSIM", "ran"):
                table.add_column(name, justify="left" if name in ("defense", "strongest attack") else "right",
                                 no_wrap=True)
        ran = sum(1 for a in s.scores if a.trials)
        late = sum(a.timed_out for a in s.scores)
        sd = num(s.sd.mean if s.sd.n else s.rmse) + (f" ± {s.sd.half_width:.3f}" if s.sd.known else "")
        if s.stops:
            sd += " (stops every attack)"
        table.add_row(Text(clean(s.defense)), str(s.batch_size),
                      Text(clean(s.attack)) if s.attack else Text("none ran", style="dim"),
                      sd, str(s.sd.n), num(s.chance_rmse), num(s.psnr, 2), num(s.ssim),
                      f"{ran}/{len(s.scores)}" + (f" ({late} timed out)" if late else ""))
    return list(tables.values())


def verdict_texts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's summary verdict per gradient threat model, dataset and model, as plain text."""
    from ..evaluation.verdicts.rules import privacy_utility
    from ..evaluation.verdicts.utility import utility_table
    from ..report.verdict_text import summaries

    out = []
    for (threat, dataset, model), (text, _) in summaries(privacy_utility(strongest(rows), utility_table(rows))).items():
        plain = html.unescape(re.sub(r"<[^>]+>", "", text.replace("<sub>D</sub>", "_D")))
        out.append(f"{threat} · {dataset} · {model}: {plain}")
    from ..evaluation.membership.verdict import membership_defenses
    from ..report.membership_section import reference_summary

    for text in reference_summary(membership_defenses(rows)):  # reference-model membership, AUC with n points
        out.append("membership · " + html.unescape(re.sub(r"<[^>]+>", "", text)))
    return out


def print_verdicts(store: Store) -> None:
    """Print :func:`verdict_texts` of the store (user strings escaped)."""
    lines = verdict_texts(store.rows())
    if lines:
        console.print(Text.assemble(("Verdicts", "bold"),
                                    " (mean ± 95 % interval, n = batches, or points for membership; details in the report):"))
    for line in lines:
        console.print(Text("• " + clean(line)), soft_wrap=True)


def print_rounds(store: Store) -> None:
    """A federated sweep's rounds, one line each: the attack's power beside the clients' leakage (nothing else)."""
    from ..evaluation.verdicts.rounds import round_table, sentence

    found = round_table(store.rows())
    if found:
        console.print(Text.assemble(("Leakage along training", "bold"),
                                    " (S_D as RMSE, mean over n batches; power = the same attacks on public images):"))
    for row in found:
        console.print(Text("• " + clean(f"{row.dataset} · {row.model}: {sentence(row)}")), soft_wrap=True)


def print_summary(summary: SweepSummary) -> None:
    counts = ", ".join(f"{v} {k}" for k, v in sorted(summary.counts.items()))
    stopped = f" (stopped: {summary.stopped})" if summary.stopped else ""
    console.print(clean(f"{summary.ran} trial(s) run in {summary.seconds:.1f} s, {summary.skipped} already finished; "
                        f"store {summary.db}: {counts}{stopped}"), highlight=False, soft_wrap=True)


def print_failures(store: Store, keys: Mapping[str, Any], limit: int = 5) -> None:
    failed = [r for r in store.rows() if r["status"] in ("failed", "timed out") and r["key"] in keys]
    for r in failed[:limit]:
        first = ((r.get("error") or "").splitlines() or [""])[0][:200]
        console.print(Text.assemble((clean(r["status"]), "yellow"), " ", clean(f"{keys[r['key']].label}: {first}")),
                      highlight=False, soft_wrap=True)
    if len(failed) > limit:
        console.print(f"… and {len(failed) - limit} more failed trial(s); see the report", highlight=False)


def plugin_line() -> str:
    """The plug-ins a run imports (in this process, every worker and every Ray actor), and where each comes from."""
    found = loaded()
    if not found:
        return "plug-ins: none"
    return "plug-ins: " + "; ".join(f"{p.name} ({p.source}{': ' + p.path if p.path else ''})" for p in found.values())


def resume_command(spec: Path, db: Path, *, workers: int, ray: str | None, retry_failed: bool, yes: bool,
                   report: Path | None, stack: int | None = None, plugins: Sequence[str] = (),
                   defenses: Sequence[str] = ()) -> str:
    """The exact ``leakbench evaluate`` command line that resumes this sweep."""
    parts = ["leakbench", "evaluate", str(spec), "--db", str(db)]
    parts += ["--workers", str(workers)] if workers != 1 else []
    parts += ["--ray", ray] if ray is not None else []
    parts += ["--retry-failed"] if retry_failed else []
    parts += ["--stack", str(stack)] if stack is not None else []
    parts += ["--yes"] if yes else []
    parts += [arg for p in plugins for arg in ("--plugin", p)]
    parts += [arg for d in defenses for arg in ("--defense", d)]
    parts += ["--report", str(report)] if report is not None else []
    return " ".join(shlex.quote(p) for p in parts)


def _checked(spec: Path, *, stack: int | None, yes: bool, defenses: Sequence[str] = ()):
    """The spec read, with --defense, --stack and --yes applied, and its preflight."""
    sweep_spec = load_spec(spec)
    if defenses:
        from ..evaluation.sweep_spec.entries import DefenseEntry

        sweep_spec = load_spec(sweep_spec.model_copy(update={
            "defenses": [*sweep_spec.defenses, *(DefenseEntry(spec=d) for d in defenses)]}))
    if stack is not None:
        if not 1 <= stack <= MAX_STACK:
            raise ConfigError(f"expected --stack between 1 and {MAX_STACK}, got {stack} (1 runs every trial alone)")
        sweep_spec = sweep_spec.model_copy(update={"stack": stack})
    if yes:
        total = check_size(sweep_spec, yes=True)
        sweep_spec = sweep_spec.model_copy(update={"max_trials": max(total, sweep_spec.max_trials or 1)})
    return sweep_spec, preflight(sweep_spec)


@app.command("evaluate")
@reports_errors
def evaluate_command(
    spec: Annotated[Path | None, typer.Argument(help="Sweep spec (YAML), see docs/evaluation.md.")] = None,
    preset: Annotated[str | None, typer.Option(
        help="Run a bundled spec instead: demo, liu2024 (Liu et al. 2024's setting, for a GPU or Ray).")] = None,
    db: Annotated[Path, typer.Option(help="SQLite results store (created or resumed).")] = Path("results.db"),
    workers: Annotated[int, typer.Option(help="Local processes running trials (1 = in this process).")] = 1,
    ray: Annotated[str | None, typer.Option(
        help="Run trials as Ray tasks: auto (a running cluster, else a local one), local, or an ADDRESS.")] = None,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Run failed trials again.")] = False,
    max_trials: Annotated[int | None, typer.Option(help="Stop after this many trials (resume later).")] = None,
    report: Annotated[Path | None, typer.Option(help="Also write the HTML report into this directory.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate the spec and count trials; run nothing.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no table.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Allow a sweep larger than the spec's max_trials "
                                      f"(default {MAX_TRIALS:,} trials).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Add this sweep to a store that holds another one "
                                        "(its trials stay and are reported too).")] = False,
    stack: Annotated[int | None, typer.Option(
        help="Most trials of one shape solved as one batched call, overriding the spec's stack (default: the "
             "device's measured best; 1: every trial alone).")] = None,
    code_path: Annotated[list[Path] | None, typer.Option(
        "--code-path", help="Directory your model classes (module:Class in the spec) are imported from "
                            "(repeatable); besides installed packages and PYTHONPATH, the only place searched: "
                            "never the current directory.")] = None,
    defense: Annotated[list[str] | None, typer.Option(
        "--defense", metavar="SPEC", help="Add this defense setting to the spec's defenses (e.g. a plug-in's, "
                                          "benchmarked against every attack of the spec). Repeatable.")] = None,
) -> None:
    """Run (or resume) a sweep: every finished trial is committed to --db at once; done trials are skipped.

    Exit codes: 0 every trial finished (done or n/a) and at least one is done, 1 some trials failed or nothing was
    measured (no trial done, or budget.sweep_minutes ended the sweep before any trial ran), 2 bad input,
    130 interrupted.
    """
    if workers < 1:
        raise ConfigError(f"expected --workers ≥ 1, got {workers}")
    if ray is not None and workers != 1:
        raise ConfigError("expected either --workers or --ray, got both (Ray sizes its own pool)")
    if (spec is None) == (preset is None):
        raise ConfigError("expected a sweep spec file or --preset NAME (one of them), e.g. "
                          "`leakbench evaluate examples/sweep-tiny.yaml` or `leakbench evaluate --preset demo`")
    if preset is not None:
        from ..evaluation.sweep_spec.bundled import preset_path

        spec = preset_path(preset)
    add_code_paths(code_path or [])
    # a dry run imports no user code: it lists the modules a run would import (their code runs then)
    with (deferred_imports() if dry_run else contextlib.nullcontext({})) as modules:
        sweep_spec, checked = _checked(spec, stack=stack, yes=yes, defenses=defense or ())
    if dry_run:
        if not force and db.exists():  # "valid" only if the run would also accept this store
            from ..evaluation import plan

            with Store(db, readonly=True) as store:
                problem = store.binding_problem(t.key for t in plan(sweep_spec))
            if problem is not None:
                raise ConfigError(problem)
        console.print(clean(f"{spec}: valid; {checked.summary()}"), highlight=False, soft_wrap=True, markup=False)
        for name, fields in modules.items():
            console.print(clean(f"a run would import {name} ({', '.join(fields)}), running its code"),
                          highlight=False, soft_wrap=True, markup=False)
        console.print(clean(plugin_line()), highlight=False, soft_wrap=True, markup=False)
        return
    if report is not None:
        check_out_dir(report, "--report")  # before any trial runs
    sweep = Sweep(sweep_spec, db, workers=workers, ray=ray, retry_failed=retry_failed, max_trials=max_trials,
                  force=force, check=False)
    again = resume_command(spec, db, workers=workers, ray=ray, retry_failed=retry_failed, yes=yes, report=report,
                           stack=stack, plugins=[p.path or p.name for p in loaded().values() if p.source == "--plugin"],
                           defenses=defense or ())
    for note in sweep.notes:
        err_console.print(Text(clean(note), style="yellow"), soft_wrap=True, highlight=False)
    try:
        try:
            summary = sweep.run(progress=not quiet)
        except KeyboardInterrupt:
            counts = sweep.store.counts(sweep.by_key)
            kept = sum(counts.get(s, 0) for s in ("done", "failed", "timed out", "n/a"))
            err_console.print(Text(clean(f"interrupted: {kept} of {len(sweep.trials)} trial(s) are kept in {db} "
                                         f"({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}); resume "
                                         f"with: {again}"), style="yellow"), soft_wrap=True, highlight=False)
            raise typer.Exit(130) from None
        if not quiet:
            print_summary(summary)
            print_failures(sweep.store, sweep.by_key)
            for table in strongest_tables(strongest([r for r in sweep.store.rows(kind="attack")
                                                     if r["key"] in sweep.by_key])):
                console.print(table)
            if summary.nothing is None:  # no verdict from a run that measured nothing ("no defense fits")
                print_verdicts(sweep.store)
                print_rounds(sweep.store)
        if report is not None:
            files = write_report(sweep.store, report)
            console.print(clean(f"report: {files.index}"), highlight=False, soft_wrap=True)
        late = summary.counts.get("timed out", 0)
        failed = summary.counts.get("failed", 0) + late
        if summary.nothing is not None:  # failed and timed-out trials run again only with --retry-failed
            rerun = again + " --retry-failed" if failed and not retry_failed else again
            err_console.print(Text(clean(summary.nothing + f"; run it again with: {rerun}"), style="red"),
                              soft_wrap=True, highlight=False)
            raise typer.Exit(1)
        if failed:
            why = f" ({late} timed out: the attack ran past budget.trial_seconds)" if late else ""
            err_console.print(Text(clean(f"{failed} of {summary.planned} trial(s) failed{why} (errors in the store"
                                         f"{' and the report' if report is not None else ''}); run them again with: "
                                         f"{again if retry_failed else again + ' --retry-failed'}"), style="red"),
                              soft_wrap=True, highlight=False)
            raise typer.Exit(1)
    finally:
        sweep.store.close()


@app.command("report")
@reports_errors
def report_command(
    db: Annotated[Path, typer.Argument(help="Results store written by `leakbench evaluate`.")],
    out: Annotated[Path, typer.Option(help="Output directory of the report.")] = Path("report"),
    pdf: Annotated[bool, typer.Option("--pdf", help="Also print the report to OUT/report.pdf with headless "
                                                    "Chromium (found on PATH or $LEAKBENCH_CHROMIUM).")] = False,
) -> None:
    """Write a static HTML report (tables, plots, image grids) and CSV/Parquet exports of a results store.

    The store is opened read-only (it may sit on read-only media or belong to another user).
    """
    if pdf and find_chromium() is None:  # before any work: the fix is one install away
        raise ConfigError(chromium_problem())
    store = Store(db, readonly=True)
    try:
        check_out_dir(out, "--out")
        files = write_report(store, out)
    finally:
        store.close()
    if pdf:
        console.print(clean(f"wrote {write_pdf(files.index)}"), highlight=False, soft_wrap=True)
    extra = f", {files.parquet.name}" if files.parquet else " (Parquet: install pandas and pyarrow)"
    console.print(clean(f"wrote {files.index}, {files.csv.name}, {files.strongest_csv.name}{extra}, "
                        f"{len(files.plots)} plot(s), {len(files.grids)} grid(s)"), highlight=False, soft_wrap=True)
