"""``leakbench list``: the registered attacks, datasets, models, defenses, losses and metrics, and where each
comes from (leakbench, or a plug-in: its module and how it was loaded)."""
from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ..attacks import ATTACKS, attack_tags
from ..attacks.membership import MEMBERSHIP_ATTACKS
from ..data import DATASETS
from ..defenses import DEFENSES
from ..errors import ConfigError
from ..losses import LOSSES
from ..metrics import METRICS
from ..models import MODELS
from ..plugins import origin_text
from .common import app, console, reports_errors

#: kinds accepted by ``leakbench list`` and their registries.
REGISTRIES = {"attacks": ATTACKS, "membership": MEMBERSHIP_ATTACKS, "datasets": DATASETS, "models": MODELS,
              "defenses": DEFENSES, "losses": LOSSES, "metrics": METRICS}
#: singular spellings accepted by ``leakbench list``.
KIND_ALIASES = {"attack": "attacks", "dataset": "datasets", "model": "models", "defense": "defenses",
                "loss": "losses", "membership-attacks": "membership", "metric": "metrics"}



@app.command("list")
@reports_errors
def list_command(
    kind: Annotated[str, typer.Argument(help="One of: " + ", ".join(REGISTRIES) + ".")],
) -> None:
    """List the registered attacks, membership attacks, datasets, models, defenses, losses or metrics, and where
    each comes from (leakbench or a plug-in)."""
    registry = REGISTRIES.get(KIND_ALIASES.get(kind.lower(), kind.lower()))
    if registry is None:
        raise ConfigError(f"unknown kind {kind!r}; expected one of: {', '.join(REGISTRIES)}")
    is_attacks = registry is ATTACKS
    table = Table(title=f"{KIND_ALIASES.get(kind.lower(), kind.lower())} ({len(registry)})")
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("description")
    if is_attacks:
        table.add_column("presets")
        table.add_column("needs")  # the threat tags (leakbench.attacks.THREAT_TAGS)
    table.add_column("from")
    for name, description in registry.describe().items():
        row = [name, description]
        if is_attacks:
            row.append(", ".join(attack_presets(name)))
            row.append(", ".join(attack_tags(name)) or "—")
        row.append(origin_text(registry.origin(name)))
        table.add_row(*row)
    console.print(table)


def attack_presets(name: str) -> list[str]:
    """The presets of attack ``name``, "default" first."""
    presets = getattr(ATTACKS.get(name), "presets", {}) or {}
    return ["default", *sorted(p for p in presets if p != "default")]

