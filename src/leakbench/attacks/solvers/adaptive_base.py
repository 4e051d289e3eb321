"""What every adaptive attack shares (:mod:`leakbench.attacks.gradient.adaptive` and its siblings): Inverting
Gradients' presets without the output-layer feature term, the defense families an observation names, and the base
class that refuses an observation made under a defense the attack does not adapt to (threat tag ``adaptive``)."""
from __future__ import annotations

from ...defenses import parse, parts_of
from ...threat import Observation
from ..base import Attack
from .matching_settings import INVERTING_PRESETS

__all__ = ["MATCH_PRESETS", "defense_families", "AdaptiveAttack"]

#: Inverting Gradients' presets without the output-layer feature term (the defenses change that layer's gradient)
MATCH_PRESETS = {name: {**values, "features": 0.0, "factorise": "off"}
                 for name, values in INVERTING_PRESETS.items() if name in ("default", "fast", "quick")}


def defense_families(obs: Observation) -> list[str]:
    """The registry names of the defenses the observation was made under (what the server is told)."""
    try:
        return [p.name for p in parts_of(parse(obs.defense))]
    except Exception:  # noqa: BLE001 (a spec this process cannot parse names no defense it knows)
        return []


class AdaptiveAttack(Attack):
    """An attack that adapts to the defense families in ``adapts_to`` (threat tag ``adaptive``)."""

    adapts_to: tuple[str, ...] = ()
    matching = True

    def requirements(self, obs: Observation) -> list[str]:
        reasons = []
        if obs.kind != "gradient":
            reasons.append(f"{self.name} simulates one step's gradient: it needs a gradient observation, "
                           f"not {obs.kind!r}")
        if not set(self.adapts_to) & set(defense_families(obs)):
            reasons.append(f"{self.name} adapts to {', '.join(self.adapts_to)}: the observation was made under "
                           f"{obs.defense!r}")
        if len(obs.input_shape) != 3 and self.options.tv > 0:
            reasons.append("the TV prior needs image inputs C×H×W; set tv=0 for vector data")
        return reasons
