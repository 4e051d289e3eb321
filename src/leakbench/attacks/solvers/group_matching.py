"""Group consistency (GradInversion: Yin, Mallya, Vahdat, Alvarez, Kautz & Molchanov, "See through Gradients: Image
Batch Recovery via GradInversion", CVPR 2021, Sec. 3.3).

G optimisation runs of the same batch from different random starts ("groups") are run jointly.  Every so often
their consensus is formed, the pixel-wise mean E(x̂_g) of the G candidates (eq. 8), and each run is pulled
towards it:

    R_group(x̂_g) = α_group · ‖x̂_g − E(x̂_g)‖²                                                     (eq. 9)

added to each run's own objective (gradient match and fidelity priors: TV, BN statistics; eq. 6–7).  Where the
runs disagree (the ambiguous details a gradient leaves open) the pull averages them out; where they agree it
costs nothing.  Departures, said here: the paper registers the G candidates to each other (RANSAC-flow) before
averaging, for ImageNet photos that runs place at different shifts; small centred images (digits, 32 px CIFAR-10)
are averaged unregistered.  ‖·‖² is the mean over pixels rather than the sum, so α_group does not scale with the
image size (ours).  The consensus is refreshed every ``group_every`` steps from ``group_from`` of the run on (the
paper starts it after the first iterations; the schedule's numbers are ours).  The result is the candidate — one
of the G runs, or their consensus — whose gradient matches best.

Called by :meth:`~.gradient_matching.GradientMatcher.run` when ``group > 0`` (with ``restarts`` = G ≥ 2).
:func:`registered_mean` forms the consensus of independent whole runs (the generative attacks' ``consensus``): the
runs are registered by label — a batch's gradient is unchanged when two images of one label swap places, so runs
may return them in different slots — by the one-to-one assignment of least squared distance (SciPy's Hungarian
solver) to a reference run, then averaged.
"""
from __future__ import annotations

import math

import torch
from scipy.optimize import linear_sum_assignment

from ...progress import keep_here
from .matching_settings import MatchResult, step_schedule

__all__ = ["run_grouped", "registered_mean"]


def run_grouped(matcher, labels: torch.Tensor, gen: torch.Generator, shape: tuple, init, callback,
                progress) -> MatchResult:
    """The G = ``restarts`` runs of ``matcher`` optimised jointly with the group-consistency term."""
    s = matcher.s
    groups = s.restarts
    xs = torch.stack([matcher._start(gen, shape, init if g == 0 else None) for g in range(groups)]).requires_grad_(True)
    opt = (torch.optim.Adam([xs], lr=matcher.lr) if s.optimizer == "adam"
           else torch.optim.SGD([xs], lr=matcher.lr, momentum=0.9))
    sched = step_schedule(opt, s.schedule, s.iterations)
    phase_one = int(s.feature_phase * s.iterations) if matcher._feature_target is not None else 0
    group_start = max(phase_one, int(s.group_from * s.iterations))
    consensus, curve, group_curve, last, stopped, step = None, [], [], math.inf, None, 0
    try:
        for step in range(s.iterations):
            full = step >= phase_one
            if step >= group_start and (step - group_start) % s.group_every == 0:
                consensus = xs.detach().mean(0)
            total, matches = 0.0, []
            for g in range(groups):
                value, match = matcher.objective(xs[g], labels, match=full)
                total = total + value
                matches.append((match if full else matcher._feature_value).detach())
            if consensus is not None:
                spread = (xs - consensus).pow(2).flatten(1).mean(1)
                total = total + s.group * spread.sum()
            (grad,) = torch.autograd.grad(total, [xs])
            matcher.apply_step(xs, grad, opt, sched)
            if step % s.trace_every == 0 or step == s.iterations - 1:
                last = float(torch.stack(matches).min())
                if not math.isfinite(last):
                    break
                if full:
                    curve.append(last)
                if consensus is not None:
                    group_curve.append(float(spread.detach().mean()))
                if callback is not None:
                    callback(step, xs[int(torch.stack(matches).argmin())].detach())
            if progress is not None:
                progress(step + 1, s.iterations, last)
    except KeyboardInterrupt:
        stopped = f"interrupted at step {step + 1} of {s.iterations}"
        if not keep_here(stopped):
            raise
    finals = []
    with torch.enable_grad():
        for g in range(groups):
            finals.append(float(matcher.objective(xs[g].detach(), labels)[1].detach()))
        fused = xs.detach().mean(0)
        fused_match = float(matcher.objective(fused, labels)[1].detach())
    candidates = [*finals, fused_match]
    best = min(range(len(candidates)), key=lambda k: candidates[k] if math.isfinite(candidates[k]) else math.inf)
    images = fused if best == groups else xs[best].detach().clone()
    trace = {"loss": curve, "restart_losses": finals, "consensus_match": fused_match, "final_match": candidates[best],
             "chosen": "consensus" if best == groups else f"group {best + 1}", "groups": groups,
             "group": s.group, "group_spread": group_curve, "iterations": s.iterations, "restarts": groups,
             "tv": s.tv, "trace_every": s.trace_every}
    if phase_one:
        trace["feature_steps"] = phase_one
    if stopped is not None:
        trace["partial"] = stopped
    return MatchResult(images=images, labels=labels, trace=trace)


def registered_mean(runs: list[torch.Tensor], labels: torch.Tensor, *, reference: int = 0) -> torch.Tensor:
    """The pixel-wise mean of ``runs`` (each B × …, slot i carrying ``labels[i]``), every run's slots of one label
    first assigned one-to-one to ``runs[reference]``'s by least squared distance."""
    ref = runs[reference]
    labels = labels.reshape(-1).cpu()
    groups = [(labels == c).nonzero().flatten() for c in labels.unique()]
    groups = [g for g in groups if len(g) > 1]
    aligned = []
    for x in runs:
        order = torch.arange(len(x))
        for pos in groups:
            cost = torch.cdist(ref[pos].flatten(1).double().cpu(), x[pos].flatten(1).double().cpu()).pow(2)
            rows, cols = linear_sum_assignment(cost.numpy())
            order[pos[torch.as_tensor(rows)]] = pos[torch.as_tensor(cols)]
        aligned.append(x[order.to(x.device)])
    return torch.stack(aligned).mean(0)
