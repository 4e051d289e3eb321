"""The ``leakbench`` command line: one Typer app.

    leakbench attack --data photos --model convnet --attack inverting-gradients --batch-size 1 --out runs/x
    leakbench list attacks
    leakbench demo

Every :class:`~leakbench.errors.LeakbenchError` a command raises is printed as
one red line ``error: <message>`` on stderr and the command exits with code 2
(no traceback).  See ``docs/cli.md``.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import json
import time
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Callable, Mapping, NoReturn, Optional, Sequence

import numpy as np
import torch
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import __version__
from .attacks import ATTACKS, Reconstruction, attack as run_attack_api, create as create_attack
from .data import DATASETS, load
from .defenses import DEFENSES, parse as parse_defense
from .errors import ConfigError, LeakbenchError
from .losses import LOSSES
from .metrics import compare
from .models import MODELS, build, parse_spec
from .report import format_metric, metrics_table, save_grid
from .threat import observe

app = typer.Typer(
    name="leakbench",
    help="Measure how much training data leaks from what neural-network training shares.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

#: exit code of every user-input error (as for usage errors).
EXIT_USAGE = 2
#: kinds accepted by ``leakbench list`` and their registries.
REGISTRIES = {"attacks": ATTACKS, "datasets": DATASETS, "models": MODELS, "defenses": DEFENSES, "losses": LOSSES}
#: metrics shown by ``leakbench attack`` (keys of the compare dict, plus the attack's seconds).
TABLE_METRICS = ("mse", "rmse", "psnr", "ssim", "label_acc", "seconds")

#: the demo's fixed set-up (Inverting Gradients on bundled photo patches).
DEMO_DATA, DEMO_DATA_OPTIONS, DEMO_MODEL = "photos", {"size": 32}, "convnet-16"
DEMO_ATTACK, DEMO_PRESET, DEMO_BATCH_SIZES = "inverting-gradients", "default", (1, 2)
DEMO_ITERATIONS = 1200
DEMO_DESCRIPTION = ("Inverting Gradients (Geiping et al. 2020, paper settings) on 32×32 photo patches "
                    "bundled with scikit-image, ConvNet width 16, seed 0")
#: singular spellings accepted by ``leakbench list``.
KIND_ALIASES = {"attack": "attacks", "dataset": "datasets", "model": "models", "defense": "defenses",
                "loss": "losses"}


# --------------------------------------------------------------------------- errors


def fail(message: str) -> NoReturn:
    """Print ``error: message`` as one red line on stderr and exit with code 2."""
    line = " ".join(str(message).splitlines())
    err_console.print(Text(f"error: {line}", style="red"), soft_wrap=True, highlight=False)
    raise typer.Exit(EXIT_USAGE)


def reports_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn :class:`LeakbenchError` into one red line and exit code 2; Ctrl-C into exit code 130."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except LeakbenchError as err:
            fail(str(err))
        except KeyboardInterrupt:
            err_console.print(Text("interrupted", style="yellow"))
            raise typer.Exit(130) from None

    return wrapper


# --------------------------------------------------------------------------- parsing helpers


def parse_assignments(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    """``["a=1", "b=x"]`` → ``{"a": "1", "b": "x"}``; a clear error for an item without ``=``."""
    parsed: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"expected KEY=VALUE for {flag}, got {item!r} (e.g. {flag} iterations=100)")
        parsed[key.strip()] = value.strip()
    return parsed


def _guess(value: str) -> Any:
    """A CLI string as None, bool, int, float or itself."""
    lowered = value.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _coerce(value: str, annotation: Any, key: str, owner: str) -> Any:
    """Convert ``value`` to the declared ``annotation`` (Optional, bool, int, float, str, sequences)."""
    if _is_union(annotation):
        args = typing.get_args(annotation)
        if type(None) in args and value.lower() in ("none", "null"):
            return None
        rest = [a for a in args if a is not type(None)]
        if str in rest:
            return value
        if len(rest) != 1:
            return _guess(value)
        annotation = rest[0]
    if typing.get_origin(annotation) in (list, tuple, collections.abc.Sequence):
        return [part.strip() for part in value.split(",") if part.strip()]
    if annotation is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
    elif annotation in (int, float):
        try:
            return annotation(value)
        except ValueError:
            pass
    elif annotation is str:
        return value
    else:
        return _guess(value)
    raise ConfigError(f"expected {annotation.__name__} for option {key!r} of {owner}, got {value!r}")


def data_options(name: str, raw: Mapping[str, str]) -> dict[str, Any]:
    """Coerce ``--data-option`` strings to the types the loader of dataset ``name`` declares."""
    loader = DATASETS.get(name)
    try:
        hints = typing.get_type_hints(loader)
    except Exception:  # unresolvable annotations: fall back to guessing
        hints = {}
    return {k: _coerce(v, hints.get(k, Any), k, f"dataset {name!r}") for k, v in raw.items()}


def parse_indices(text: str | None) -> list[int] | None:
    """``"1,5,9"`` → ``[1, 5, 9]``."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"expected comma-separated sample indices like 1,5,9 for --indices, got {text!r}")
    return [int(p) for p in parts]


def parse_device(name: str) -> torch.device:
    """A torch device that exists on this machine."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"expected a torch device like cpu or cuda:0 for --device, got {name!r}") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(),
                 "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()}
    if not available.get(device.type, False):
        raise ConfigError(f"device {name!r} is not available on this machine; use --device cpu")
    return device


# --------------------------------------------------------------------------- one attack run


@dataclass
class RunSpec:
    """Everything that fixes one CLI attack run (written into metrics.json as ``spec``)."""

    data: str = "photos"
    data_options: dict[str, Any] = field(default_factory=dict)
    model: str = "convnet"
    act: Optional[str] = None
    init: str = "default"
    model_seed: int = 0
    attack: str = "inverting-gradients"
    preset: Optional[str] = None
    options: dict[str, Any] = field(default_factory=dict)
    batch_size: Optional[int] = 1
    seed: int = 0
    indices: Optional[list[int]] = None
    loss: str = "ce"
    local_steps: int = 0
    labels_known: bool = False
    defense: str = "none"
    device: str = "cpu"


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


def execute(spec: RunSpec, *, progress: bool) -> RunResult:
    """Load the data, build the model, observe one batch, attack it and score the reconstruction."""
    check_spec(spec)
    device = parse_device(spec.device)
    data = load(spec.data, **spec.data_options)
    model = build(spec.model, input_shape=data.shape, classes=data.num_classes, act=spec.act,
                  init=spec.init, seed=spec.model_seed, device=device)
    x, y = data.batch(spec.batch_size, seed=spec.seed, indices=spec.indices)
    x, y = x.to(device), y.to(device)
    obs = observe(model, x, y, loss=spec.loss, local_steps=spec.local_steps, labels_known=spec.labels_known,
                  defense=spec.defense, seed=spec.seed)
    start = time.perf_counter()
    rec = run_attack_api(spec.attack, obs, preset=spec.preset, seed=spec.seed, progress=progress, **spec.options)
    seconds = float(rec.trace.get("seconds", time.perf_counter() - start))
    rec = dataclasses.replace(
        rec, images=rec.images.detach().cpu(),
        labels=None if rec.labels is None else rec.labels.detach().cpu(),
    )
    x, y = x.cpu(), y.cpu()
    return RunResult(x=x, y=y, reconstruction=rec, scores=compare(rec, x, y), seconds=seconds,
                     classes=list(data.classes))


def _json_default(value: Any) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return value.tolist()
    return str(value)


def run_record(spec: RunSpec, result: RunResult) -> dict[str, Any]:
    """The metrics.json content of one run: the compare dict + attack, options, seconds and spec."""
    rec = result.reconstruction
    return {**result.scores, "attack": rec.attack or spec.attack, "options": rec.options,
            "seconds": result.seconds, "spec": dataclasses.asdict(spec), "leakbench_version": __version__}


def write_json(path: Path, content: Any) -> None:
    path.write_text(json.dumps(content, indent=2, default=_json_default) + "\n")


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
    table = Table(title=title, min_width=len(title) + 4)
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    for key in TABLE_METRICS:
        row = [format_metric(key, {**scores, "seconds": seconds}.get(key)) for scores, seconds in columns.values()]
        table.add_row(key, *row)
    return table


def default_out(attack: str, data: str) -> Path:
    return Path("runs") / f"{attack}-{data}-{datetime.now():%Y%m%d-%H%M%S}"


def _print_paths(paths: Sequence[Path]) -> None:
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------- commands


def _version(value: bool) -> None:
    if value:
        console.print(f"leakbench {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Measure how much training data leaks from what neural-network training shares."""


@app.command("attack")
@reports_errors
def attack_command(
    data: Annotated[str, typer.Option(help="Dataset name (see `leakbench list datasets`).")] = "photos",
    data_option: Annotated[Optional[list[str]], typer.Option(
        "--data-option", metavar="KEY=VALUE", help="Dataset option, repeatable (e.g. size=32).")] = None,
    model: Annotated[str, typer.Option(help="Model spec, e.g. convnet-16, cnn:3-6-1-0, mlp:100.")] = "convnet",
    act: Annotated[Optional[str], typer.Option(help="Activation (default: the family's).")] = None,
    init: Annotated[str, typer.Option(help="Weight initialisation scheme.")] = "default",
    model_seed: Annotated[int, typer.Option(help="Seed of the model's initialisation.")] = 0,
    attack: Annotated[str, typer.Option(help="Attack name (see `leakbench list attacks`).")] = "inverting-gradients",
    preset: Annotated[Optional[str], typer.Option(help="Attack preset (default: the attack's default).")] = None,
    option: Annotated[Optional[list[str]], typer.Option(
        "--option", metavar="KEY=VALUE", help="Attack option, repeatable (e.g. iterations=500).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        help="Batch size (default 1, or the number of --indices).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the batch choice, the defense and the attack.")] = 0,
    indices: Annotated[Optional[str], typer.Option(help="Exact sample indices, e.g. 1,5,9.")] = None,
    loss: Annotated[str, typer.Option(help="Client's training loss (see `leakbench list losses`).")] = "ce",
    local_steps: Annotated[int, typer.Option(help="0 shares the gradient; k ≥ 1 the update after k steps.")] = 0,
    labels_known: Annotated[bool, typer.Option("--labels-known/--no-labels-known",
                                               help="Grant the batch's labels to the attacker.")] = False,
    defense: Annotated[str, typer.Option(help="Defense spec, e.g. none or clip:4+noise:0.01.")] = "none",
    device: Annotated[str, typer.Option(help="Torch device for the model, the batch and the attack.")] = "cpu",
    out: Annotated[Optional[Path], typer.Option(
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
        defense=defense, device=device,
    )
    result = execute(spec, progress=not quiet)
    target = out if out is not None else default_out(attack, data)
    target.mkdir(parents=True, exist_ok=True)
    paths = [target / "grid.png", target / "metrics.json", target / "reconstruction.npz"]
    write_grid(paths[0], result)
    write_json(paths[1], run_record(spec, result))
    write_arrays(paths[2], result)
    if quiet:
        console.print(str(target), highlight=False, soft_wrap=True)
        return
    console.print(metrics_rich_table({"value": (result.scores, result.seconds)}, title=f"{attack} on {data}"))
    _print_paths(paths)


@app.command("list")
@reports_errors
def list_command(
    kind: Annotated[str, typer.Argument(help="One of: " + ", ".join(REGISTRIES) + ".")],
) -> None:
    """List the registered attacks, datasets, models, defenses or losses with a description."""
    registry = REGISTRIES.get(KIND_ALIASES.get(kind.lower(), kind.lower()))
    if registry is None:
        raise ConfigError(f"unknown kind {kind!r}; expected one of: {', '.join(REGISTRIES)}")
    is_attacks = registry is ATTACKS
    table = Table(title=f"{KIND_ALIASES.get(kind.lower(), kind.lower())} ({len(registry)})")
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("description")
    if is_attacks:
        table.add_column("presets")
    for name, description in registry.describe().items():
        row = [name, description]
        if is_attacks:
            row.append(", ".join(attack_presets(name)))
        table.add_row(*row)
    console.print(table)


def attack_presets(name: str) -> list[str]:
    """The presets of attack ``name``, "default" first."""
    presets = getattr(ATTACKS.get(name), "presets", {}) or {}
    return ["default", *sorted(p for p in presets if p != "default")]


@app.command("demo")
@reports_errors
def demo_command(
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("leakbench-demo"),
    iterations: Annotated[int, typer.Option(help="Attack iterations per run.")] = DEMO_ITERATIONS,
) -> None:
    """Inverting Gradients on bundled photo patches (batch sizes 1 and 2): grids, metrics.json, metrics.md."""
    if iterations < 1:
        raise ConfigError(f"expected --iterations ≥ 1, got {iterations}")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    columns: dict[str, tuple[Mapping[str, Any], float]] = {}
    sections: list[str] = []
    for size in DEMO_BATCH_SIZES:
        spec = demo_spec(size, iterations)
        console.print(f"[bold]Inverting Gradients[/] on a batch of {size} photo patch(es), {DEMO_MODEL}, "
                      f"{iterations} iterations", highlight=False)
        result = execute(spec, progress=True)
        grid = write_grid(out / f"grid-batch{size}.png", result)
        runs.append({"batch_size": size, "grid": grid.name, **run_record(spec, result)})
        columns[f"batch {size}"] = (result.scores, result.seconds)
        sections.append(f"## Batch size {size}\n\n{metrics_table({**result.scores, 'seconds': result.seconds})}"
                        f"\n![originals (top) and reconstructions (bottom)]({grid.name})\n")
    total = time.perf_counter() - start
    write_json(out / "metrics.json", {"demo": DEMO_DESCRIPTION, "iterations": iterations,
                                      "total_seconds": total, "runs": runs})
    (out / "metrics.md").write_text(f"# leakbench demo\n\n{DEMO_DESCRIPTION}, {iterations} iterations; "
                                    f"total {total:.1f} s.\n\n" + "\n".join(sections))
    console.print(metrics_rich_table(columns, title=f"leakbench demo ({total:.0f} s)"))
    _print_paths([out / "metrics.md", out / "metrics.json", *(out / r["grid"] for r in runs)])


def demo_spec(batch_size: int, iterations: int) -> RunSpec:
    """The run the demo makes for one batch size."""
    return RunSpec(data=DEMO_DATA, data_options=dict(DEMO_DATA_OPTIONS), model=DEMO_MODEL, model_seed=0,
                   attack=DEMO_ATTACK, preset=DEMO_PRESET, options={"iterations": iterations},
                   batch_size=batch_size, seed=0)
