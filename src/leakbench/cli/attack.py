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
import yaml
from rich.table import Table
from rich.text import Text

from .. import __version__
from ..attacks import ATTACKS, Reconstruction, create as create_attack, preset_revision
from ..data import DATASETS
from ..defenses import parse as parse_defense
from ..errors import ConfigError, LeakbenchError, UnsupportedThreatModel
from ..evaluation.running.preflight import MAX_ATTACK_WORK, attack_work
from ..evaluation.running.run import run_trial
from ..evaluation.trials.trial import TrialSpec
from ..evaluation.trials.inputs import dataset_for
from ..losses import LOSSES
from ..metrics import score_columns
from ..models import MODELS, parse_spec
from ..models.custom import add_code_paths, class_digest, is_class_spec
from ..models.files import file_digest, read_state
from ..progress import keep_partial, rich_progress
from ..report import format_metric, save_grid
from .common import (EXIT_INTERRUPTED, _print_paths, app, check_out_dir, clean, console, data_options, err_console,
                     parse_assignments, parse_device, parse_indices, reports_errors, write_json)

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
    model_options: dict[str, Any] = field(default_factory=dict)
    normalize: list[list[float]] | None = None


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


def model_options(raw: Mapping[str, str]) -> dict[str, Any]:
    """``--model-option`` values read as YAML scalars (``32`` → 32, ``true`` → True, ``[1, 2]`` → a list)."""
    out: dict[str, Any] = {}
    for key, text in raw.items():
        try:
            out[key] = yaml.safe_load(text) if text else text
        except yaml.YAMLError:
            out[key] = text
    return out


def parse_normalize(text: str | None) -> list[list[float]] | None:
    """``"0.5,0.5,0.5/0.25,0.25,0.25"`` → ``[[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]]`` (``--normalize``)."""
    if text is None:
        return None
    parts = text.split("/")
    try:
        mean, std = ([float(v) for v in part.split(",")] for part in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        mean, std = None, None
    if not mean or not std or len(mean) != len(std) or not all(v > 0 for v in std):
        raise ConfigError(f"expected --normalize MEAN/STD with one value per channel and std > 0, e.g. "
                          f"0.49,0.48,0.45/0.25,0.24,0.26, got {text!r}")
    return [mean, std]


def trial_spec(spec: RunSpec) -> TrialSpec:
    """The sweep trial that ``spec`` is: the CLI runs the same trial core as ``leakbench evaluate``."""
    model_options: dict[str, Any] = {"act": spec.act, "init": spec.init, "seed": spec.model_seed,
                                     "options": dict(spec.model_options)}
    if spec.normalize is not None:
        model_options["normalize"] = [list(spec.normalize[0]), list(spec.normalize[1])]
    if is_class_spec(spec.model, MODELS.names()):  # your own class: keyed on its source, as in a sweep
        model_options["source_digest"] = class_digest(spec.model, field="--model")
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
    work = attack_work(spec.attack, spec.preset, dict(spec.options), "--option")
    if work > MAX_ATTACK_WORK:
        raise ConfigError(f"--option: about {work:,} optimisation steps (iterations × restarts × … of the preset "
                          f"with your options), more than {MAX_ATTACK_WORK:,}; lower them")
    trial = trial_spec(spec)
    if spec.labels_known and not dataset_for(trial).labels_known:
        raise ConfigError(f"the labels of --data {spec.data} are unknown (an unlabelled folder: every image carries label 0, which means nothing); "
                          "drop --labels-known")
    advice = (f"for a quick look use --preset {' or '.join(p for p in ('quick', 'fast') if p in presets)}"
              if (presets := getattr(ATTACKS.get(spec.attack), "presets", {})) else "")
    advice += ("; " if advice else "") + ("a GPU is far faster (--device cuda)" if spec.device == "cpu" else "")
    with (rich_progress(spec.attack, advice=advice) if progress else contextlib.nullcontext(None)) as report:
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


#: the chance level shown beside a score (a flat image at the data mean, :func:`leakbench.metrics.flat_chance`).
CHANCE_OF = {"rmse": "chance_rmse", "psnr": "chance_psnr"}


def metrics_rich_table(columns: Mapping[str, tuple[Mapping[str, Any], float]], title: str) -> Table:
    """A rich table of the mean metrics and the attack's seconds, one value column per run, each with the chance
    level beside its RMSE and PSNR (a flat image at the data mean)."""
    table = Table(title=Text(clean(title)), min_width=len(title) + 4)
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
        table.add_column("chance" if len(columns) == 1 else f"{name} chance", justify="right", style="dim")
    for key in TABLE_METRICS:
        row = []
        for scores, seconds in columns.values():
            row.append(format_metric(key, {**scores, "seconds": seconds}.get(key)))
            row.append(format_metric(key, scores.get(CHANCE_OF[key])) if key in CHANCE_OF else "")
        table.add_row(key, *row)
    return table


def chance_advice(spec: RunSpec, scores: Mapping[str, Any]) -> str | None:
    """Lines saying a result is at or below chance and what would make the attack stronger (None above chance)."""
    rmse, chance = scores.get("rmse"), scores.get("chance_rmse")
    if not (isinstance(rmse, (int, float)) and isinstance(chance, (int, float))) or rmse < chance:
        return None
    psnr, chance_psnr = scores.get("psnr"), scores.get("chance_psnr")
    presets = [p for p in sorted(getattr(ATTACKS.get(spec.attack), "presets", {})) if p != (spec.preset or "default")]
    ways = ["a bigger budget (" + (f"a longer preset: --preset {' / '.join(presets)}, or " if presets else "")
            + f"--option iterations=N above {spec.options.get('iterations', 'the preset')})"]
    if not spec.labels_known:
        ways.append("known labels (--labels-known)")
    ways += ["BatchNorm statistics for a model with BatchNorm (a sweep's threat: {bn_stats: true})",
             "train mode for a client that trained in train mode (Observation.from_gradients(..., train=True); "
             "a sweep's threat: {train: true})",
             "a malicious-server threat model (a sweep model's server: {imprint: {bins: 64}}, {trap_weights: {}}, "
             "{loki: {bins: 256}} or {random_head: ...})"]
    return (f"At or below chance: RMSE {format_metric('rmse', rmse)} ≥ {format_metric('rmse', chance)} (PSNR "
            f"{format_metric('psnr', psnr)} vs {format_metric('psnr', chance_psnr)} dB) of a flat image at the data "
            "mean: this attack learnt nothing about the batch that a grey image does not show. That says the attack "
            "is too weak here, not that the data is safe. Stronger: " + "; ".join(ways) + ".")


def default_out(attack: str, data: str) -> Path:
    return Path("runs") / f"{attack}-{data}-{datetime.now():%Y%m%d-%H%M%S}"



@app.command("attack")
@reports_errors
def attack_command(
    data: Annotated[str, typer.Option(help="Dataset name (see `leakbench list datasets`).")] = "photos",
    data_option: Annotated[list[str] | None, typer.Option(
        "--data-option", metavar="KEY=VALUE", help="Dataset option, repeatable (e.g. size=32).")] = None,
    model: Annotated[str, typer.Option(help="Model spec, e.g. convnet-16, cnn:3-6-1-0, mlp:100, or your own class "
                                            "as module.path:ClassName (imported: runs that module's code).")
                     ] = "convnet",
    model_option: Annotated[list[str] | None, typer.Option(
        "--model-option", metavar="KEY=VALUE",
        help="Model option, repeatable: a family's (width=32) or your class's constructor argument.")] = None,
    normalize: Annotated[str | None, typer.Option(
        metavar="MEAN/STD", help="Input normalisation the model expects, per channel, e.g. "
                                 "0.49,0.48,0.45/0.25,0.24,0.26 (attacks still work on pixels in [0, 1]).")] = None,
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
    code_path: Annotated[list[Path] | None, typer.Option(
        "--code-path", help="Directory your model class (pkg.mod:Net) is imported from (repeatable); never the "
                            "current directory.")] = None,
) -> None:
    """Attack one batch; write grid.png, metrics.json and reconstruction.npz into --out."""
    add_code_paths(code_path or [])
    chosen = parse_indices(indices)
    spec = RunSpec(
        data=data, data_options=data_options(data, parse_assignments(data_option, "--data-option")),
        model=model, act=act, init=init, model_seed=model_seed, attack=attack, preset=preset,
        options=parse_assignments(option, "--option"),
        batch_size=batch_size if batch_size is not None or chosen else 1,
        seed=seed, indices=chosen, loss=loss, local_steps=local_steps, labels_known=labels_known,
        defense=defense, device=device, model_file=None if model_file is None else str(model_file),
        model_options=model_options(parse_assignments(model_option, "--model-option")), normalize=parse_normalize(normalize),
    )
    check_spec(spec)
    target = out if out is not None else default_out(attack, data)
    created = not target.exists()
    check_out_dir(target, "--out")  # before the work, so a bad --out never costs an attack
    try:
        with keep_partial() as stopped:  # Ctrl-C during the optimisation keeps its best so far
            result = execute(spec, progress=not quiet)
    except BaseException:
        if created and target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        raise
    paths = [target / "grid.png", target / "metrics.json", target / "reconstruction.npz"]
    write_grid(paths[0], result)
    partial = stopped.get("stopped")
    write_json(paths[1], {**run_record(spec, result), **({"partial": partial} if partial else {})})
    write_arrays(paths[2], result)
    if partial:
        err_console.print(clean(f"interrupted ({partial}): the best reconstruction so far is saved in {target}, "
                                "labelled partial (metrics.json \"partial\")"), highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    if quiet:
        console.print(clean(target), highlight=False, soft_wrap=True)
        return
    console.print(metrics_rich_table({"value": (result.scores, result.seconds)}, title=f"{attack} on {data}"))
    advice = chance_advice(spec, result.scores)
    if advice is not None:
        console.print(clean(advice), highlight=False, soft_wrap=True)
    _print_paths(paths)

