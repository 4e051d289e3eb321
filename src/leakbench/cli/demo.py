"""``leakbench demo``: the main job on bundled data (what ``make demo`` runs)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Mapping

import typer

from ..errors import ConfigError
from ..report import metrics_table
from .attack import RunSpec, execute, metrics_rich_table, run_record, write_grid
from .common import _print_paths, app, console, reports_errors, write_json

#: the demo's fixed set-up (Inverting Gradients on bundled photo patches).
DEMO_DATA, DEMO_DATA_OPTIONS, DEMO_MODEL = "photos", {"size": 32}, "convnet-16"
DEMO_ATTACK, DEMO_PRESET, DEMO_BATCH_SIZES = "inverting-gradients", "default", (1, 2)
DEMO_ITERATIONS = 1200
DEMO_DESCRIPTION = ("Inverting Gradients (Geiping et al. 2020, paper settings) on 32×32 photo patches "
                    "bundled with scikit-image, ConvNet width 16, seed 0")


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
