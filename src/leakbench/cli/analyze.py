"""``leakbench analyze``: predict leakage from the architecture before any attack.

    leakbench analyze security --model cnn:3-6-1-0,4-3-2-0 --input-shape 3,32,32
    leakbench analyze exclusivity --model mlp:1000 --data digits --data-option size=28 --batch-size 8

``security`` prints Chen & Campbell's per-conv-layer rank deficiency and the
eq. (12) metric (with R-GAP's structural count); ``exclusivity`` prints Pan et
al.'s ExAN counts per sample, the reconstructable samples and Theorem 2's
gradient-invariant dimension.  ``--json`` prints the report as JSON instead.
"""
from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from ..analysis.exclusivity import exclusivity
from ..analysis.security import security_metric
from ..data import load
from ..errors import ConfigError
from ..models import build
from .common import _json_default, app, console, data_options, parse_assignments, reports_errors

analyze_app = typer.Typer(name="analyze", help="Predict leakage from the architecture (rank deficiency, "
                          "neuron exclusivity).", no_args_is_help=True)
app.add_typer(analyze_app, name="analyze")


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,32,32"`` → ``(3, 32, 32)``; a one-line error otherwise."""
    parts = [p.strip() for p in text.replace("x", ",").split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"expected --input-shape as positive sizes like 3,32,32, got {text!r}")
    return tuple(int(p) for p in parts)


def _print_json(report) -> None:
    console.print_json(json.dumps(report.to_dict(), default=_json_default))


@analyze_app.command("security")
@reports_errors
def security_command(
    model: Annotated[str, typer.Option(help="Model spec, e.g. cnn:3-6-1-0,4-3-2-0.")],
    input_shape: Annotated[str, typer.Option(help="Per-sample input shape C,H,W.")] = "3,32,32",
    classes: Annotated[int, typer.Option(help="Number of outputs of the final layer.")] = 10,
    act: Annotated[str, typer.Option(help="Activation (the paper: tanh).")] = "tanh",
    seed: Annotated[int, typer.Option(help="Seed of the weights and of the random upstream gradients.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Rank deficiency per conv layer and the security metric of Chen & Campbell (2022), eq. (12)."""
    report = security_metric(model, parse_shape(input_shape), classes=classes, act=act, seed=seed)
    if as_json:
        _print_json(report)
        return
    table = Table(title=f"security of {report.model} on {'×'.join(map(str, report.input_shape))} "
                  f"(metric {report.metric:.1f}, rounded {round(report.metric)})")
    for col in ("layer", "k-c-s-p", "dim(x)", "rows W", "rows K", "rank", "rank deficiency", "RA-i (R-GAP)"):
        table.add_column(col, justify="right" if col != "layer" else "left")
    for layer in report.layers:
        table.add_row(f"{layer.index} {layer.name}", f"{layer.kernel}-{layer.channels}-{layer.stride}-{layer.padding}",
                      str(layer.input_dim), str(layer.weight_rows), str(layer.gradient_rows), str(layer.rank),
                      str(layer.rank_deficiency), str(layer.ra_i))
    console.print(table)
    for note in report.notes:
        console.print(note, highlight=False)
    verdict = ("every conv layer's system is full rank: R-GAP/hybrid can rebuild the input exactly"
               if report.full_rank else "rank-deficient: the gradient leaves part of the input undetermined")
    console.print(f"{verdict} (fully connected input {report.fc_input_dim}; {report.seconds:.1f} s)",
                  highlight=False)


@analyze_app.command("exclusivity")
@reports_errors
def exclusivity_command(
    model: Annotated[str, typer.Option(help="ReLU MLP spec, e.g. mlp:1000 or mlp:1000-1000.")],
    data: Annotated[str, typer.Option(help="Dataset name (see `leakbench list datasets`).")] = "digits",
    data_option: Annotated[list[str] | None, typer.Option(
        help="Dataset option KEY=VALUE (repeatable), e.g. size=28.")] = None,
    batch_size: Annotated[int, typer.Option(help="Batch size M.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the batch and of the perturbation search.")] = 0,
    model_seed: Annotated[int, typer.Option(help="Seed of the model's initialisation.")] = 0,
    init: Annotated[str, typer.Option(help="Weight initialisation scheme.")] = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """ExAN counts, reconstructable samples and Theorem 2's invariant dimension (Pan et al. 2022)."""
    if batch_size < 1:
        raise ConfigError(f"expected --batch-size ≥ 1, got {batch_size}")
    ds = load(data, **data_options(data, parse_assignments(data_option, "--data-option")))
    x, y = ds.batch(batch_size, seed=seed)
    net = build(model, input_shape=ds.shape, classes=ds.num_classes, act="relu", init=init, seed=model_seed)
    report = exclusivity(net, x, y, seed=seed)
    if as_json:
        _print_json(report)
        return
    hidden = len(report.widths) - 1
    table = Table(title=f"neuron exclusivity of {model} on {data} (batch {report.batch_size}; widths "
                  f"{'-'.join(map(str, report.widths))})")
    table.add_column("sample", justify="right")
    table.add_column("label", justify="right")
    for k in range(1, hidden + 1):
        table.add_column(f"ExANs layer {k}", justify="right")
    table.add_column("reconstructable")
    table.add_column("moves in Thm 2 space")
    for m, counts in enumerate(report.exans):
        table.add_row(str(m), str(int(y[m])), *map(str, counts), "yes" if report.reconstructable[m] else "no",
                      "yes" if report.free_samples[m] else "no")
    console.print(table)
    console.print(f"{report.reconstructable_count}/{report.batch_size} samples in the reconstructable regime "
                  "(≥ 2 ExANs in the last hidden layer, ≥ 1 in every other)", highlight=False)
    if report.theorem2_applies:
        console.print(f"Theorem 2: gradient-invariant perturbations form a space of dimension {report.theorem2_dim} "
                      f"= (d0 − rank W0)·(M − rank A) = ({report.widths[0]} − {report.rank_w0})·"
                      f"({report.batch_size} − {report.rank_a}); the paper states M·(d0 − d1) = {report.paper_dim}; "
                      f"largest found in the box: ‖Δ‖ = {report.max_perturbation:.3g}", highlight=False)
    else:
        console.print("Theorem 2 does not apply: the first hidden layer is at least as wide as the input",
                      highlight=False)
    for note in report.notes:
        console.print(note, highlight=False)
