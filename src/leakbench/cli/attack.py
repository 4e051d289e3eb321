"""``leakbench attack``: observe one batch, attack it, score and save the reconstruction."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from collections.abc import Mapping

import numpy as np
import torch
import typer
from rich.table import Table
from rich.text import Text

from .. import __version__
from ..attacks import Reconstruction, create as create_attack, preset_revision
from ..data import DATASETS
from ..defenses import parse as parse_defense
from ..errors import ConfigError, LeakbenchError, UnsupportedThreatModel
from ..evaluation.run import run_trial
from ..evaluation.trial import TrialSpec, dataset_for
from ..losses import LOSSES
from ..metrics import score_columns
from ..models import parse_spec
from ..models.files import file_digest, read_state
from ..progress import rich_progress
from ..report import format_metric, save_grid
from .common import (_print_paths, app, check_out_dir, clean, console, data_options, parse_assignments, parse_device,
                     parse_indices, reports_errors, write_json)

#: metrics shown by ``leakbench attack``: the stored scores of the metric registry, plus the attack's seconds.
TABLE_METRICS = (*score_columns(), "seconds")



@dataclass
class RunSpec:
    """Everything that fixes one CLI attack run (written into metrics.json as ``spec``)."""

    data: str = "photos"
    data_options: dict[str, Any] = field(default_factory=dict)
    model: str = "convnet"
    act: str | None = None
    init: str = "default"
    model_seed: int = 0
    attack: str = "inverting-gradients"
    preset: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    batch_size: int | None = 1
    seed: int = 0
    indices: list[int] | None = None
    loss: str = "ce"
    local_steps: int = 0
    labels_known: bool = False
    defense: str = "none"
    device: str = "cpu"
    model_file: str | None = None


@dataclass
class RunResult:
    """The batch, what the attack rebuilt (on the CPU), the scores and the attack's time."""

    x: torch.Tensor
    y: torch.Tensor
    reconstruction: Reconstruction
    scores: dict[str, Any]
    seconds: float
    classes: list[str]


def check_spec(spec: RunSpec) -> None:
    """Reject bad values before any work is done (one-line errors naming the flag)."""
    if spec.batch_size is not None and spec.batch_size < 1:
        raise ConfigError(f"expected --batch-size ≥ 1, got {spec.batch_size}")
    if spec.local_steps < 0:
        raise ConfigError(f"expected --local-steps ≥ 0 (0 shares the gradient), got {spec.local_steps}")
    if spec.seed < 0 or spec.model_seed < 0:
        raise ConfigError(f"expected non-negative seeds, got --seed {spec.seed} --model-seed {spec.model_seed}")
    DATASETS.get(spec.data)
    parse_spec(spec.model)
    LOSSES.get(spec.loss)
    parse_defense(spec.defense)
    parse_device(spec.device)
    create_attack(spec.attack, preset=spec.preset, **spec.options)  # unknown attack, preset or option
    if spec.model_file is not None:
        read_state(spec.model_file, field="--model-file")  # readable as tensors, before any work


def trial_spec(spec: RunSpec) -> TrialSpec:
    """The sweep trial that ``spec`` is: the CLI runs the same trial core as ``leakbench evaluate``."""
    model_options: dict[str, Any] = {"act": spec.act, "init": spec.init, "seed": spec.model_seed, "options": {}}
    if spec.model_file is not None:
        model_options.update(file=str(spec.model_file), file_digest=file_digest(spec.model_file))
    size = len(spec.indices) if spec.indices else int(spec.batch_size or 1)
    return TrialSpec(kind="attack", dataset=spec.data, data_options=dict(spec.data_options), model=spec.model,
                     model_options=model_options, defense=spec.defense, batch_size=size, images=size, batch=0,
                     seed=spec.seed, attack=spec.attack, preset=spec.preset,
                     preset_revision=preset_revision(spec.attack, spec.preset), options=dict(spec.options),
                     threat={"loss": spec.loss, "local_steps": spec.local_steps, "labels_known": spec.labels_known},
                     indices=list(spec.indices or []), device=str(parse_device(spec.device)),
                     threads=torch.get_num_threads(), save_images=True)


def execute(spec: RunSpec, *, progress: bool) -> RunResult:
    """Load the data, build the model, observe one batch, attack it and score the reconstruction (the trial core)."""
    check_spec(spec)
    trial = trial_spec(spec)
    with (rich_progress(spec.attack) if progress else contextlib.nullcontext(None)) as report:
        result = run_trial(trial, progress=report, strict=True)
    if result.status == "n/a":
        raise UnsupportedThreatModel(f"attack {spec.attack!r} cannot run on this observation: {result.error}")
    if result.status != "done" or not all(k in result.arrays for k in ("x", "y", "reconstruction", "labels", "order")):
        why = " ".join(str(result.error or "no reconstruction was returned").split())[:300]
        fix = ("raise --option iterations or use a faster attack" if result.status == "timed out"
               else "use another attack, preset or batch")
        raise LeakbenchError(f"attack {spec.attack!r} gave no usable result ({result.status}: {why}); {fix}")
    a = result.arrays
    labels = torch.from_numpy(a["labels"])
    rec = Reconstruction(images=torch.from_numpy(a["reconstruction"]),
                         labels=None if bool((labels < 0).all()) else labels,
                         attack=spec.attack, options=result.attack_options)
    scores = {**result.metrics, "per_sample": result.per_sample, "order": a["order"].tolist()}
    return RunResult(x=torch.from_numpy(a["x"]), y=torch.from_numpy(a["y"]), reconstruction=rec, scores=scores,
                     seconds=float(result.timings.get("attack_reported") or result.timings.get("attack", 0.0)),
                     classes=list(dataset_for(trial).classes))



def run_record(spec: RunSpec, result: RunResult) -> dict[str, Any]:
    """The metrics.json content of one run: the compare dict + attack, options, seconds and spec."""
    rec = result.reconstruction
    return {**result.scores, "attack": rec.attack or spec.attack, "options": rec.options,
            "seconds": result.seconds, "spec": dataclasses.asdict(spec), "leakbench_version": __version__}



def write_arrays(path: Path, result: RunResult) -> None:
    """reconstruction.npz: x, y, reconstruction and the recovered labels (−1 where none were recovered)."""
    rec = result.reconstruction
    labels = rec.labels.numpy() if rec.labels is not None else np.full(rec.batch_size, -1, dtype=np.int64)
    np.savez_compressed(path, x=result.x.numpy(), y=result.y.numpy(),
                        reconstruction=rec.images.float().numpy(), labels=labels)


def write_grid(path: Path, result: RunResult) -> Path:
    """Originals over reconstructions (matched), titled with the class names."""
    titles = [result.classes[int(c)] for c in result.y]
    return save_grid(path, result.x, result.reconstruction.images, titles=titles, scores=result.scores)


def metrics_rich_table(columns: Mapping[str, tuple[Mapping[str, Any], float]], title: str) -> Table:
    """A rich table of the mean metrics and the attack's seconds, one value column per run."""
    table = Table(title=Text(clean(title)), min_width=len(title) + 4)
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    for key in TABLE_METRICS:
        row = [format_metric(key, {**scores, "seconds": seconds}.get(key)) for scores, seconds in columns.values()]
        table.add_row(key, *row)
    return table


def default_out(attack: str, data: str) -> Path:
    return Path("runs") / f"{attack}-{data}-{datetime.now():%Y%m%d-%H%M%S}"



@app.command("attack")
@reports_errors
def attack_command(
    data: Annotated[str, typer.Option(help="Dataset name (see `leakbench list datasets`).")] = "photos",
    data_option: Annotated[list[str] | None, typer.Option(
        "--data-option", metavar="KEY=VALUE", help="Dataset option, repeatable (e.g. size=32).")] = None,
    model: Annotated[str, typer.Option(help="Model spec, e.g. convnet-16, cnn:3-6-1-0, mlp:100.")] = "convnet",
    act: Annotated[str | None, typer.Option(help="Activation (default: the family's).")] = None,
    init: Annotated[str, typer.Option(help="Weight initialisation scheme.")] = "default",
    model_seed: Annotated[int, typer.Option(help="Seed of the model's initialisation.")] = 0,
    attack: Annotated[str, typer.Option(help="Attack name (see `leakbench list attacks`).")] = "inverting-gradients",
    preset: Annotated[str | None, typer.Option(help="Attack preset (default: the attack's default).")] = None,
    option: Annotated[list[str] | None, typer.Option(
        "--option", metavar="KEY=VALUE", help="Attack option, repeatable (e.g. iterations=500).")] = None,
    batch_size: Annotated[int | None, typer.Option(
        help="Batch size (default 1, or the number of --indices).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the batch choice, the defense and the attack.")] = 0,
    indices: Annotated[str | None, typer.Option(help="Exact sample indices, e.g. 1,5,9.")] = None,
    loss: Annotated[str, typer.Option(help="Client's training loss (see `leakbench list losses`).")] = "ce",
    local_steps: Annotated[int, typer.Option(help="0 shares the gradient; k ≥ 1 the update after k steps.")] = 0,
    labels_known: Annotated[bool, typer.Option("--labels-known/--no-labels-known",
                                               help="Grant the batch's labels to the attacker.")] = False,
    defense: Annotated[str, typer.Option(help="Defense spec, e.g. none or clip:4+noise:0.01.")] = "none",
    device: Annotated[str, typer.Option(help="Torch device for the model, the batch and the attack.")] = "cpu",
    model_file: Annotated[Path | None, typer.Option(
        help="Weights for --model: a state dict saved with torch.save(model.state_dict(), path) "
             "(read as tensors only).")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Output directory (default runs/<attack>-<data>-<timestamp>).")] = None,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="No progress bar and no table; print only the output directory.")] = False,
) -> None:
    """Attack one batch; write grid.png, metrics.json and reconstruction.npz into --out."""
    chosen = parse_indices(indices)
    spec = RunSpec(
        data=data, data_options=data_options(data, parse_assignments(data_option, "--data-option")),
        model=model, act=act, init=init, model_seed=model_seed, attack=attack, preset=preset,
        options=parse_assignments(option, "--option"),
        batch_size=batch_size if batch_size is not None or chosen else 1,
        seed=seed, indices=chosen, loss=loss, local_steps=local_steps, labels_known=labels_known,
        defense=defense, device=device, model_file=None if model_file is None else str(model_file),
    )
    check_spec(spec)
    target = out if out is not None else default_out(attack, data)
    created = not target.exists()
    check_out_dir(target, "--out")  # before the work, so a bad --out never costs an attack
    try:
        result = execute(spec, progress=not quiet)
    except BaseException:
        if created and target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        raise
    paths = [target / "grid.png", target / "metrics.json", target / "reconstruction.npz"]
    write_grid(paths[0], result)
    write_json(paths[1], run_record(spec, result))
    write_arrays(paths[2], result)
    if quiet:
        console.print(clean(target), highlight=False, soft_wrap=True)
        return
    console.print(metrics_rich_table({"value": (result.scores, result.seconds)}, title=f"{attack} on {data}"))
    _print_paths(paths)

