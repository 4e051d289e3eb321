"""Replaying a client's local training on a candidate batch: the certificate of an update of several steps.

FedAvg's client (McMahan et al. 2017, Algorithm 1) shares θ_k − θ_0 after k SGD steps
θ_{t+1} = θ_t − η ∇θ L(θ_t; X, y) on its batch (``Observation.local_steps`` and ``local_lr``).  The server knows
θ_0, η and k, so it can replay the steps on a candidate batch (X̂, ŷ): the replay reproduces the shared update to
the round-off of the client's arithmetic when (X̂, ŷ) is the batch (up to its order, for full-batch steps), and a
wrong sample changes it by about its share of the update.  ``spear`` uses this as its joint certificate when the
first-layer update is the sum of several steps' gradients (FedAvg; the derivation is in ``spear``'s docstring),
where the one-step tests — a sample's gradient δ(x̂, ŷ) at θ_0 against its row — no longer hold.

A defense applied after the local steps that only rescales the update (clipping the whole update) keeps the
certificate: the replay is compared after the one positive factor that fits it best (reported).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from ...losses import get_loss
from ...threat import Observation
from ..observed import attacker_model

__all__ = ["REPLAY_TOL", "ReplayCertificate", "replay_certificate", "replay_misfit", "replay_update"]

#: the replay of several local steps tells a right batch from one with a wrong sample or label below this relative
#: misfit (over every shared tensor).  Measured on digits-like batches of B = 32 at 5 steps: the true batch 2.5e-6
#: (float32 round-off), SPEAR's estimates (1e-5 off) 1.6e-4 to 3.5e-4 — one ReLU that flips between x̂ and x at
#: some step carries it —, one wrong sample or label 0.22–0.29 (about ∝ 1/√B).  The misfit is no precision bound
#: (a sample 1e-3 off moves it by ~2e-4): each sample's precision comes from the attack's own estimate.
REPLAY_TOL = 1e-2


def replay_update(obs: Observation, x: torch.Tensor, labels: torch.Tensor, *,
                  dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """θ_k − θ_0 of ``obs.local_steps`` full-batch SGD steps of size ``obs.local_lr`` on (``x``, ``labels``), per
    shared parameter (``obs.param_names``), in ``dtype``.  Minibatch epochs (``obs.local_batches``) are replayed
    in their slot order, so ``x`` must then be in the client's order."""
    model = attacker_model(obs).to(dtype)
    names = set(obs.param_names)
    current = {n: p.detach().to(dtype) for n, p in model.named_parameters() if n in names}
    start = dict(current)
    loss_fn = get_loss(obs.loss)
    x = x.reshape(x.shape[0], *obs.input_shape).to(device=obs.device, dtype=dtype)
    labels = labels.to(obs.device)
    for part in obs.local_batches or [None] * obs.local_steps:
        xb, yb = (x, labels) if part is None else (x[part], labels[part])
        with torch.enable_grad():
            params = {n: p.detach().requires_grad_(True) for n, p in current.items()}
            loss = loss_fn(functional_call(model, params, (xb,), strict=False), yb)
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        current = {n: (p - obs.local_lr * g if g is not None else p).detach()
                   for (n, p), g in zip(params.items(), grads)}
    return [current[n] - start[n] for n in obs.param_names]


def replay_misfit(obs: Observation, x: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(relative misfit, factor): ‖c·replay − shared‖ / ‖shared‖ over every shared tensor, at the positive factor c
    that fits best (1 for an undefended update, the clipping factor of a clipped one); misfit 1 for a zero
    replay."""
    sim = torch.cat([t.reshape(-1) for t in replay_update(obs, x, labels)])
    shared = torch.cat([t.reshape(-1).to(sim) for t in obs.shared])
    norm = float(shared.norm())
    denom = float(sim.pow(2).sum())
    if norm == 0.0 or denom == 0.0:
        return 1.0, 0.0
    factor = float((sim * shared).sum()) / denom
    if not factor > 0:
        return 1.0, factor
    return float((factor * sim - shared).norm()) / norm, factor


@dataclass
class ReplayCertificate:
    """Which slots the replay certifies (``certified``), and what the trace records of it (misfit, factor, labels
    changed, or ``uncertified``: why not)."""

    certified: torch.Tensor
    trace: dict = field(default_factory=dict)


def replay_certificate(obs: Observation, images: torch.Tensor, labels: torch.Tensor, errors: torch.Tensor | None,
                       precise: torch.Tensor, *, found: int, deadline: float = float("inf"),
                       precision: float = 1e-4) -> ReplayCertificate:
    """Certify a recovered batch (``images`` B×n, ``labels`` updated in place) by replaying the client's steps.

    ``errors`` (B×C) ranks each sample's classes (the labels' repair tries second-best classes, at most B
    replays, each kept when it lowers the misfit); ``precise`` flags the samples whose own precision estimate is
    within ``precision`` of the data range.  Every slot is certified only when all ``found`` = B samples are
    there, the steps are full-batch (minibatch slots are unknown), and the replay's misfit is ≤ ``REPLAY_TOL``;
    then exactly the precise ones."""
    certified = torch.zeros(obs.batch_size, dtype=torch.bool, device=images.device)
    why = _unreplayable(obs, found, errors is not None)
    if why is not None:
        return ReplayCertificate(certified, {"uncertified": why})
    misfit, factor, repaired = _repair_labels(obs, images, labels, errors, deadline)
    trace = {"replay_misfit": misfit, "replay_factor": factor, "labels_repaired": repaired, "replay_tol": REPLAY_TOL}
    if misfit > REPLAY_TOL:
        trace["uncertified"] = (f"the replay of {obs.local_steps} local steps on the recovered batch misfits the "
                                f"update by {misfit:.1e} (> {REPLAY_TOL:.0e}): some sample or label is off")
        return ReplayCertificate(certified, trace)
    certified[:] = precise
    trace["certificate"] = (f"replay of {obs.local_steps} local steps (misfit {misfit:.1e} ≤ {REPLAY_TOL:.0e}) and "
                            "each sample's precision estimate")
    if not bool(precise.all()):
        trace["uncertified"] = (f"{int((~precise).sum())} of {obs.batch_size} samples are less precise than "
                                f"{precision:g} of the data range (the attack's own estimate)")
    return ReplayCertificate(certified, trace)


def _unreplayable(obs: Observation, found: int, labelled: bool) -> str | None:
    """Why the local steps cannot be replayed on what was found (None: they can)."""
    if found < obs.batch_size:
        return f"the factorisation gave {found} of {obs.batch_size} samples (rank of the update): no replay"
    if not labelled:
        return f"labels are not read for loss {obs.loss!r}, so the client's steps cannot be replayed"
    if obs.local_batches:
        return ("minibatch epochs: which recovered sample sat in which minibatch is unknown, so the client's "
                "steps cannot be replayed; the estimates are not certified")
    return None


def _repair_labels(obs: Observation, images: torch.Tensor, labels: torch.Tensor, errors: torch.Tensor,
                   deadline: float) -> tuple[float, float, int]:
    """The replay's (misfit, factor) at ``labels``; while it misfits, the samples whose best two classes are closest
    try their second-best class, each change kept when it lowers the misfit (``labels`` updated in place)."""
    misfit, factor = replay_misfit(obs, images, labels)
    if errors.shape[1] < 2:
        return misfit, factor, 0
    best2 = errors.topk(2, dim=1, largest=False)
    repaired = 0
    for i in (best2.values[:, 1] - best2.values[:, 0]).argsort().tolist():
        if misfit <= REPLAY_TOL or time.perf_counter() > deadline:
            break
        trial = labels.clone()
        trial[i] = best2.indices[i, 1]
        m, f = replay_misfit(obs, images, trial)
        if m < misfit:
            labels[i], misfit, factor, repaired = trial[i], m, f, repaired + 1
    return misfit, factor, repaired
