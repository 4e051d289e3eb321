"""Trials on published weights: reconstruction from a trained model and membership inference.

A ``weights`` trial trains a target (:func:`~leakbench.models.targets.train_target`, cached on
disk like other trained models), runs an attack on its weights (``kkt`` — Haim et al. 2022 and
Buzaglo et al. 2023 —, ``model-inversion``, ``univariate``) and scores the candidates against a
control, because at small image sizes an SSIM threshold alone passes random non-members:

- ``members_nn`` — training points that are the nearest neighbour (NCC, Haim et al. App. B.3)
  of some candidate, among the training points and as many held-out non-members of the same
  classes; ``nonmembers_nn`` is the same count for the non-members (the chance level: random
  candidates pick members and non-members alike);
- ``members_ssim_t`` — training points whose voted reconstruction (App. B.3) reaches SSIM ≥ t
  (NCC for vector data); ``control_ssim_t`` — the same count when non-member images stand in
  for the candidates (as many as there were candidates, where the data holds that many);
- ``diverged`` — candidates dropped as non-finite or exploding (never scored);
  ``kkt_residual`` — how far the target is from a KKT point of the max-margin problem.

A ``membership`` trial trains a binary target and runs a membership attack (the margin attack
of the provable-attacks paper, Sec. 4) on its training points and as many non-members, with
the margin known (Cor. 4.3), leaked by a set holding one member (Cor. 4.4) or bounded
(Cor. 4.5); it stores ROC AUC and TPR at 1 % and 0.1 % FPR and the scores for the ROC curve.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError
from ..verdicts.weights import SSIM_THRESHOLDS

__all__ = ["target_for", "nonmembers_for", "finite_candidates", "weights_scores", "weights_trial", "membership_trial", "EXPLODED"]

#: a candidate further than this many data boxes from the box has exploded.
EXPLODED = 100.0

_TARGETS: dict[str, Any] = {}


def _kept(data, classes: list | None):
    """``data`` restricted to ``classes`` (names or indices), relabelled 0..k−1 in that order."""
    from ...data import ImageDataset

    if not classes:
        return data
    index = []
    for c in classes:
        if isinstance(c, str):
            if c not in data.classes:
                raise ConfigError(f"unknown class {c!r} of dataset {data.name!r}; classes: {', '.join(data.classes)} "
                                  "(field target.classes)")
            index.append(data.classes.index(c))
        elif isinstance(c, int) and 0 <= c < data.num_classes:
            index.append(c)
        else:
            raise ConfigError(f"expected class names or indices below {data.num_classes}, got {c!r} "
                              "(field target.classes)")
    labels = data.labels.cpu()
    keep = torch.cat([torch.nonzero(labels == c).reshape(-1) for c in index]).sort().values
    relabel = torch.full((data.num_classes,), -1, dtype=torch.long)
    relabel[torch.as_tensor(index)] = torch.arange(len(index))
    return ImageDataset(images=data.images[keep], labels=relabel[labels[keep]].to(data.labels.device),
                        classes=[data.classes[i] for i in index], name=data.name)


def _target_key(target: dict, seed: int) -> str:
    text = json.dumps([target.get("dataset"), target.get("classes"), target.get("per_class"),
                       target.get("options"), seed], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def target_for(spec, cache_dir: str | Path | None = None):
    """(trained target, the data it was drawn from) for a weights/membership trial, cached per process and on disk."""
    from ...data import load
    from ...models.targets import TrainedTarget, train_target

    t = spec.target
    dataset = t["dataset"]
    data = _kept(load(dataset["name"], **dict(dataset.get("options") or {})), t.get("classes"))
    key = _target_key(t, spec.seed)
    target = _TARGETS.get(key)
    path = Path(cache_dir) / "targets" / f"{key}.pt" if cache_dir is not None else None
    if target is None and path is not None and path.is_file():
        target = TrainedTarget.load(path)
    if target is None:
        target = train_target(data, per_class=int(t.get("per_class", 10)), data_seed=spec.seed,
                              **dict(t.get("options") or {}))
        if path is not None:
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.pt")
            target.save(tmp)
            os.replace(tmp, path)  # atomic: concurrent workers never read a half-written file
    _TARGETS[key] = target
    return target, data


def nonmembers_for(target, data, count: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` samples of ``data`` (its kept classes) that are not training points of ``target``, seeded."""
    from ..trials.controls import draw_excluding

    idx = draw_excluding(data.images, target.x, count, seed=int(seed) + 31337)
    return data.images[idx.to(data.images.device)], data.labels[idx.to(data.labels.device)]


def finite_candidates(images: torch.Tensor) -> tuple[torch.Tensor, int]:
    flat = images.reshape(images.shape[0], -1)
    ok = torch.isfinite(flat).all(1)
    ok &= torch.where(ok, flat.abs().amax(1), torch.zeros_like(ok, dtype=flat.dtype)) <= EXPLODED
    return images[ok], int((~ok).sum())


def weights_scores(candidates: torch.Tensor, members: torch.Tensor, nonmembers: torch.Tensor,
                   control: torch.Tensor) -> dict[str, float]:
    """The counts of a published-weights trial (see the module docstring), candidates already finite."""
    from ...metrics.voting import ncc_matrix, vote

    n = int(members.shape[0])
    out: dict[str, float] = {"n_train": n, "n_nonmembers": int(nonmembers.shape[0]),
                             "candidates": int(candidates.shape[0]), "control_candidates": int(control.shape[0])}
    if candidates.shape[0] == 0:
        out.update({"members_nn": 0, "nonmembers_nn": 0})
        out.update({f"members_ssim_{t}": 0 for t in SSIM_THRESHOLDS})
    else:
        pool = torch.cat([members.double(), nonmembers.double().to(members.device)])
        nearest = ncc_matrix(candidates.double(), pool).argmax(1)
        out["members_nn"] = int(torch.unique(nearest[nearest < n]).numel())
        out["nonmembers_nn"] = int(torch.unique(nearest[nearest >= n]).numel())
        voted = vote(candidates, members)
        out.update({f"members_ssim_{t}": voted.count(t) for t in SSIM_THRESHOLDS})
    if control.shape[0]:
        voted = vote(control, members)
        out.update({f"control_ssim_{t}": voted.count(t) for t in SSIM_THRESHOLDS})
    return out


def target_refusal(target) -> str | None:
    """Why a trained published target is no trained model (non-finite or diverged training), or None."""
    from .reference import divergence

    loss = target.final_loss if target.history else 0.0  # no history recorded: the weights alone are checked
    return divergence(target.model, target.inputs, target.y, loss, loss=target.config.loss)


def weights_trial(spec, clock, cache_dir) -> Any:
    """Train (or load) the target, attack its weights, score the candidates with their control."""
    from ...threat import observe_weights
    from ..trials.trial import TrialResult
    from ..trials.attack import run_attack

    target, data = target_for(spec, cache_dir)
    clock.lap("target")
    why = target_refusal(target)
    if why is not None:  # a diverged target is no result: failed with the reason, never scored
        return TrialResult(key=spec.key, status="failed", error=why)
    n = int(target.x.shape[0])
    rec = run_attack(spec, observe_weights(target), clock)
    if isinstance(rec, TrialResult):
        return rec
    images = rec.images.detach().to("cpu", torch.float64)
    reported = int((rec.trace or {}).get("diverged", 0))
    candidates, dropped = finite_candidates(images)
    wanted = int(spec.target.get("nonmembers") or n)
    nonmembers, _ = nonmembers_for(target, data, wanted + max(1, candidates.shape[0]), seed=spec.seed)
    pool_nonmembers, control = nonmembers[:wanted], nonmembers[wanted:]
    members = target.x.detach().cpu().double()
    if pool_nonmembers.shape[0] == 0:
        raise ConfigError(f"dataset {data.name!r} holds no sample outside the target's training set, so the "
                          "reconstruction has no control; use a larger dataset or a smaller per_class")
    metrics = weights_scores(candidates, members, pool_nonmembers.cpu(), control.cpu())
    metrics["diverged"] = dropped + reported
    metrics["kkt_residual"] = _residual(target)
    metrics["final_loss"] = float(target.final_loss)
    clock.lap("score")
    arrays = {}
    if spec.save_images and candidates.shape[0]:
        from ...metrics.voting import vote

        voted = vote(candidates, members)
        top = voted.order[: min(16, n)]
        arrays = {"x": members[top].float().numpy(), "reconstruction": voted.images[top].float().numpy(),
                  "score": voted.score[top].float().numpy()}
    return TrialResult(key=spec.key, status="done", metrics=metrics, arrays=arrays,
                       timings={"attack_reported": float((rec.trace or {}).get("seconds", 0.0))})


def _residual(target) -> float | None:
    from ...analysis.stationarity import kkt_residual

    try:
        return float(kkt_residual(target.model, target.inputs, target.y).residual)
    except (ConfigError, ValueError, RuntimeError):  # the residual is defined for linear + ReLU stacks only
        return None


def membership_trial(spec, clock, cache_dir) -> Any:
    """Membership inference against a binary target in one margin-knowledge setting."""
    from ...attacks.membership import MEMBERSHIP_ATTACKS
    from ...metrics.membership import membership_scores
    from ...threat import observe_weights
    from ..trials.trial import TrialResult

    target, data = target_for(spec, cache_dir)
    clock.lap("target")
    why = target_refusal(target)
    if why is not None:  # a diverged target is no result: failed with the reason, never scored
        return TrialResult(key=spec.key, status="failed", error=why)
    m = dict(spec.membership)
    setting = m.get("setting", "known")
    n = int(target.x.shape[0])
    outside, out_labels = nonmembers_for(target, data, int(spec.target.get("nonmembers") or n), seed=spec.seed)
    if outside.shape[0] == 0:
        raise ConfigError(f"dataset {data.name!r} holds no sample outside the target's training set: no non-members "
                          "to score; use a larger dataset or a smaller per_class")
    margin = float(target.margins().min())
    obs = observe_weights(target, margin=margin)
    options = dict(spec.options)
    if setting == "bounded":
        width = float(m.get("bound_width", 0.2))
        options["bounds"] = (margin * (1 - width), margin * (1 + width))
    attack = MEMBERSHIP_ATTACKS.create(spec.attack, margin=setting, **options)
    reasons = attack.requirements(obs)
    if reasons:
        return TrialResult(key=spec.key, status="n/a", error="; ".join(reasons))
    mean = 0.0 if target.mean is None else target.mean.cpu()
    x = torch.cat([target.x.cpu(), outside.cpu().to(target.x.dtype)]) - mean
    member_labels = ((target.y.cpu() + 1) / 2).long() if target.y.dtype.is_floating_point else target.y.cpu()
    labels = torch.cat([member_labels, out_labels.cpu().long()])
    is_member = torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(outside.shape[0], dtype=torch.bool)])
    leaked = leaked_labels = None
    if setting == "leaked":
        gen = torch.Generator().manual_seed(int(spec.seed) + 77)
        others = (n + torch.randperm(outside.shape[0], generator=gen))[: int(m.get("leaked_size", 10)) - 1]
        pick = torch.cat([torch.randint(n, (1,), generator=gen), others])
        leaked, leaked_labels = x[pick], labels[pick]
    clock.start_budget()
    result = attack(obs, x, labels=labels, leaked=leaked, leaked_labels=leaked_labels)
    clock.lap("attack")
    scores = membership_scores(result.scores.cpu(), is_member, threshold=result.threshold)
    metrics = {"auc": scores.auc, "tpr_at_fpr_0.01": scores.tpr_at_1, "tpr_at_fpr_0.001": scores.tpr_at_01,
               "accuracy": scores.accuracy, "tpr": scores.tpr, "fpr": scores.fpr, "threshold": scores.threshold,
               "members": n, "nonmembers": int(outside.shape[0]), "margin": margin,
               "kkt_residual": _residual(target)}
    arrays = {"scores": result.scores.cpu().double().numpy(), "is_member": is_member.numpy().astype(np.int64)}
    return TrialResult(key=spec.key, status="done", metrics=metrics, arrays=arrays if spec.save_images else {})
