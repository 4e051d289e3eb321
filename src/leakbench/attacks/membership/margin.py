"""Membership inference against the margin (provable-attacks paper, Sec. 4: Thm. 4.2, Cor. 4.3–4.5).

Smorodinsky, Vardi & Safran, "Provable privacy attacks on trained shallow neural
networks".  A two-layer network at a KKT point of the max-margin problem (Assumption
2.1) trained on nearly orthogonal data (Assumption 4.1, e.g. uniform on the sphere with
d ≫ n) puts every training point on the margin γ, while a fresh point from the same
distribution gets |f(x)| far below γ (Thm. 4.2).  The attack scores a point by |f(x)|
(or y·f(x) when its label is known, as in the paper's Sec. 5 experiment) and calls it a
member iff the score reaches the threshold, set from what the attacker knows of γ:

- ``"known"`` — γ is given (Cor. 4.3): threshold γ·(1 − slack);
- ``"leaked"`` — a set known to hold at least one member is given (Cor. 4.4): γ is
  estimated as the largest score in that set;
- ``"bounded"`` — only bounds γ ∈ [γ_low, γ_high] are known (Cor. 4.5): threshold γ_low.

It is not a reconstruction, so it is not an :class:`~leakbench.attacks.base.Attack`
(those return images): :func:`membership_margin` takes the observation and the queried
points and returns a :class:`MembershipResult` of scores and decisions.  It is listed in
:data:`MEMBERSHIP_ATTACKS` under ``"membership-margin"`` so the CLI and sweep specs use
the same name; :class:`MarginMembership` carries the ``requirements`` check.
"""
from __future__ import annotations


import torch

from ...errors import ConfigError, UnsupportedThreatModel, expect
from ...threat import Observation
from .base import MEMBERSHIP_ATTACKS, MembershipResult

__all__ = ["MarginMembership", "membership_margin", "MARGIN_MODES"]

MARGIN_MODES = ("known", "leaked", "bounded")


@MEMBERSHIP_ATTACKS.register("membership-margin",
                             help="membership iff |f(x)| (or y f(x)) reaches the margin (provable attacks, Sec. 4)")
class MarginMembership:
    """Membership inference by the output's distance to the margin (Thm. 4.2, Cor. 4.3–4.5)."""

    name = "membership-margin"

    def __init__(self, *, margin: str = "known", margin_value: float | None = None,
                 bounds: tuple[float, float] | None = None, slack: float = 0.0) -> None:
        expect(margin in MARGIN_MODES, f"expected margin one of {', '.join(MARGIN_MODES)}, got {margin!r} "
               "(option margin)")
        expect(0 <= slack < 1, f"expected slack in [0, 1), got {slack!r} (option slack)")
        if margin == "bounded":
            expect(bounds is not None and len(bounds) == 2 and 0 < float(bounds[0]) <= float(bounds[1]),
                   f"expected bounds (low, high) with 0 < low ≤ high for margin='bounded', got {bounds!r} (option bounds)")
        expect(margin_value is None or float(margin_value) > 0,
               f"expected a positive margin_value, got {margin_value!r} (option margin_value)")
        self.margin, self.margin_value, self.bounds, self.slack = margin, margin_value, bounds, float(slack)

    def requirements(self, obs: Observation) -> list[str]:
        reasons = []
        if not isinstance(obs, Observation):
            return [f"expected an Observation from observe_weights, got {type(obs).__name__}"]
        if obs.kind != "weights":
            reasons.append(f"membership-margin queries the trained model; got a {obs.kind!r} observation "
                           "(use leakbench.threat.observe_weights on the trained network)")
        if obs.num_classes != 1:
            reasons.append(f"membership-margin needs a binary network with one output, got {obs.num_classes} outputs")
        if self.margin == "known" and self.margin_value is None and "margin" not in obs.extras:
            reasons.append("margin='known' needs margin_value=… or an observation granting the margin "
                           "(observe_weights(..., margin=γ))")
        return reasons

    def __call__(self, obs: Observation, x: torch.Tensor, *, labels: torch.Tensor | None = None,
                 leaked: torch.Tensor | None = None, leaked_labels: torch.Tensor | None = None) -> MembershipResult:
        reasons = self.requirements(obs)
        if reasons:
            raise UnsupportedThreatModel("attack 'membership-margin' cannot run on this observation: " + "; ".join(reasons))
        scores = _scores(obs, x, labels, "x")
        signed = labels is not None
        if self.margin == "known":
            margin = float(self.margin_value if self.margin_value is not None else obs.extras["margin"])
            threshold = margin * (1 - self.slack)
        elif self.margin == "leaked":
            expect(leaked is not None, "margin='leaked' needs leaked=… (a set known to hold at least one member)")
            expect(signed == (leaked_labels is not None),
                   "give labels for both the queries and the leaked set, or for neither (arguments labels, leaked_labels)")
            margin = float(_scores(obs, leaked, leaked_labels, "leaked").max())
            expect(margin > 0, "expected the leaked set to hold a point with a positive score (a member)")
            threshold = margin * (1 - self.slack)
        else:
            margin = None
            threshold = float(self.bounds[0]) * (1 - self.slack)
        return MembershipResult(scores=scores, threshold=threshold, members=scores >= threshold * (1 - 1e-9),
                                margin=margin, mode=self.margin, signed=signed)


def _scores(obs: Observation, x: torch.Tensor, labels: torch.Tensor | None, field: str) -> torch.Tensor:
    expect(isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[1:]) == tuple(obs.input_shape),
           f"expected points of shape N×{'×'.join(map(str, obs.input_shape))}, got "
           f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__} (argument {field})")
    ref = obs.shared[0]
    with torch.no_grad():
        out = obs.model(x.to(ref.device, ref.dtype)).reshape(-1)
    if labels is None:
        return out.abs().detach()
    labels = labels.to(out.device)
    if not labels.dtype.is_floating_point:
        labels = labels.to(out.dtype) * 2 - 1
    expect(labels.shape == out.shape and set(torch.unique(labels).tolist()) <= {-1.0, 1.0},
           f"expected one ±1 (or 0/1) label per point, got shape {tuple(labels.shape)} (labels for {field})")
    return (out * labels.to(out.dtype)).detach()


def membership_margin(obs: Observation, x: torch.Tensor, *, labels: torch.Tensor | None = None,
                      margin: str = "known", margin_value: float | None = None,
                      bounds: tuple[float, float] | None = None, leaked: torch.Tensor | None = None,
                      leaked_labels: torch.Tensor | None = None, slack: float = 0.0) -> MembershipResult:
    """Score points ``x`` (network-input space) for membership; see the module docstring for the modes."""
    if not isinstance(obs, Observation):
        raise ConfigError(f"expected an Observation (from observe_weights), got {type(obs).__name__}")
    attack = MarginMembership(margin=margin, margin_value=margin_value, bounds=bounds, slack=slack)
    return attack(obs, x, labels=labels, leaked=leaked, leaked_labels=leaked_labels)
