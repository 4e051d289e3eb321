"""``leakbench membership``: audit a training recipe (your model file included) for membership leakage.

One reference-model ``membership`` entry (:class:`~leakbench.evaluation.sweep_spec.weights.MembershipEntry`) built from the
options and run as a sweep into ``--out``: ``results.db`` (resumable: re-running trains nothing again) and
``report/index.html`` with the verdict, the table, the log–log ROC and, for DP-SGD, the audit::

    leakbench membership --data digits --model mlp:64 --model-file my_weights.pt --defense none \\
        --defense dpsgd:1,1 --epochs 20 --lr 0.2 --pool 600 --reference-models 2 --out audit
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from ..evaluation import Sweep, load_spec
from ..models.custom import add_code_paths
from ..report import write_report
from .common import app, clean, console, data_options, err_console, parse_assignments, reports_errors
from .evaluate import print_failures, print_summary, verdict_texts


@app.command("membership")
@reports_errors
def membership_command(
    data: Annotated[str, typer.Option(help="Dataset the pool is drawn from (see `leakbench list datasets`).")] = "digits",
    data_option: Annotated[list[str] | None, typer.Option(
        help="Dataset option KEY=VALUE (repeatable), e.g. size=32.")] = None,
    model: Annotated[str, typer.Option(help="Model spec, e.g. mlp:64, cnn:3-16-2-1, or your class pkg.mod:Net.")] = "mlp:64",
    model_file: Annotated[Path | None, typer.Option(
        help="State dict the target and every reference model start from (your model's weights).")] = None,
    act: Annotated[str | None, typer.Option(help="Activation (default: the family's).")] = None,
    defense: Annotated[list[str] | None, typer.Option(
        help="Defense applied in training (repeatable; default: none), e.g. dpsgd:1,1 or dropout:0.3.")] = None,
    epochs: Annotated[int, typer.Option(help="Training epochs of the recipe.")] = 5,
    batch_size: Annotated[int, typer.Option(help="Training batch size of the recipe.")] = 32,
    lr: Annotated[float, typer.Option(help="Learning rate of the recipe.")] = 0.05,
    pool: Annotated[int, typer.Option(help="Points drawn from the dataset; the target trains on half.")] = 2000,
    reference_models: Annotated[int, typer.Option(help="Reference models (LiRA/RMIA), trained like the target.")] = 4,
    attack: Annotated[list[str] | None, typer.Option(
        help="Membership attack (repeatable; default: loss, LiRA online and offline, RMIA).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the pool, the target's half and the reference models.")] = 0,
    out: Annotated[Path, typer.Option(help="Output directory (results.db, report/).")] = Path("membership-audit"),
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the report's path.")] = False,
    code_path: Annotated[list[Path] | None, typer.Option(
        "--code-path", help="Directory your model class (pkg.mod:Net) is imported from (repeatable); never the "
                            "current directory.")] = None,
) -> None:
    """Train the target and reference models with the recipe and each defense; report the membership verdict.

    Exit codes: 0 every trial finished and at least one is done, 1 some trials failed or none is done, 2 bad input.
    """
    add_code_paths(code_path or [])
    entry = {"dataset": {"name": data, "options": data_options(data, parse_assignments(data_option, "--data-option"))},
             "model": {"spec": model, **({"act": act} if act else {}),
                       **({"file": str(model_file)} if model_file is not None else {})},
             "training": {"epochs": epochs, "batch_size": batch_size, "lr": lr}, "pool": pool,
             "reference_models": reference_models, "defenses": list(defense or ["none"]), "seeds": [seed]}
    if attack:
        entry["attacks"] = list(attack)
    # the entry's dataset, options included, is the sweep's too (a file dataset needs its path option everywhere)
    spec = load_spec({"name": "membership", "datasets": [entry["dataset"]], "models": [model], "batch_sizes": [1],
                      "membership": [entry]})
    out.mkdir(parents=True, exist_ok=True)
    sweep = Sweep(spec, out / "results.db", workers=1)
    try:
        summary = sweep.run(progress=not quiet)
        files = write_report(sweep.store, out / "report")
        if quiet:
            console.print(clean(files.index), highlight=False, soft_wrap=True)
        else:
            print_summary(summary)
            print_failures(sweep.store, sweep.by_key)
            if summary.nothing is None:  # a run that measured nothing has no verdict
                for line in verdict_texts(sweep.store.rows()):
                    console.print(Text("• " + clean(line)), soft_wrap=True)
            console.print(clean(f"report: {files.index}"), highlight=False, soft_wrap=True)
    finally:
        sweep.store.close()
    if summary.nothing is not None or summary.failed:
        # exit 1: every trial failed (a diverged target, a recipe that cannot train), or some did
        err_console.print(Text(clean(summary.nothing or f"{summary.headline} (errors in {out / 'results.db'} and the "
                                     "report)"), style="red"), soft_wrap=True, highlight=False)
        raise typer.Exit(1)
