"""A sweep's reference-model membership trial: one attack against one defense on one trained target.

The ``membership`` entries of a sweep spec with ``model:`` and ``dataset:`` (see :class:`~.spec.MembershipEntry`)
plan one trial per seed × attack × defense.  A trial

1. draws a seeded ``pool`` of points from the dataset (:func:`pool_for`);
2. trains (or loads from the store's cache) the target with the recipe and the defense on a seeded half of the
   pool (:func:`~.reference.cached_target`; its members) and ``reference_models`` models the same way on
   complementary halves (:func:`~.reference.train_reference_models`, Carlini et al. 2022, Sec. IV) — cached and
   locked, so the attacks of one setting train them once, and resumed sweeps train nothing again;
3. scores every pool point with the attack (RMIA's population z: the whole pool) and stores AUC with its
   stratified-bootstrap interval, TPR at 1 % and 0.1 % FPR where the non-members measure it (≥ 10/FPR,
   :func:`~.stats.measurable_fpr`; else None), TPR with no false positive among the n non-members, the per-point
   scores (``per_sample``: the membership verdict pairs defenses point by point), the training numbers of the
   target and every reference model (the utility cost, paired by model across defenses), and for DP-SGD the
   accountant's ε beside the empirical lower bound of Jagielski et al. 2020 (:func:`~.audit.audit_scores`) and,
   with ``canaries``, the one-run bound of Steinke et al. 2023 (:func:`~.reference.canary_audit`).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError
from ..verdicts.stats import auc_interval, measurable_fpr
from ..trials.trial import TrialResult, TrialSpec
from ..trials.inputs import dataset_for

__all__ = ["pool_for", "recipe_for", "reference_trial", "FPRS"]

#: the false-positive rates whose TPR a trial stores (where measurable); 0: no false positive at all.
FPRS = (0.01, 0.001)


def pool_for(data, size: int, *, seed: int):
    """A seeded draw of ``size`` points of ``data`` (the population pool of a membership trial)."""
    n = len(data)
    if size > n:
        raise ConfigError(f"expected a pool of at most {n} points (dataset {data.name!r} holds {n}), got {size} "
                          "(field membership.pool); lower pool or use a larger dataset (e.g. photos with scale: 1)")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) + 4_242))[:size]
    return data.subset(order.sort().values)


def recipe_for(spec: TrialSpec):
    """The :class:`~.reference.Recipe` of a trial: its model with build options, defense and training recipe."""
    from .reference import Recipe

    opts = dict(spec.model_options)
    model_options: dict[str, Any] = {k: opts[k] for k in ("act", "init") if opts.get(k)}
    if opts.get("normalize"):
        model_options["normalize"] = opts["normalize"]
    model_options.update(dict(opts.get("options") or {}))
    r = dict(spec.membership.get("recipe") or {})
    return Recipe(model=spec.model, model_options=model_options, defense=spec.defense, epochs=int(r["epochs"]),
                  batch_size=int(r["batch_size"]), lr=float(r["lr"]), loss=str(r.get("loss", "ce")),
                  model_file=opts.get("file") or None)


def _cache(cache_dir) -> Any:
    from pathlib import Path

    return False if cache_dir is None else Path(cache_dir) / "reference"


def _scores(spec: TrialSpec, target, pool, refs) -> tuple[np.ndarray | None, str | None]:
    """The attack's per-point scores on the pool, or (None, why it does not apply)."""
    from ...attacks.membership import MEMBERSHIP_ATTACKS
    from ...threat import observe_weights

    obs = observe_weights(target.model, input_shape=tuple(pool.shape), num_classes=pool.num_classes)
    x, y = pool.images, pool.labels
    if spec.attack == "membership-margin":
        options = dict(spec.options)
        attack = MEMBERSHIP_ATTACKS.create(spec.attack, **{"margin": "bounded", "bounds": (1.0, 1.0), **options})
        reasons = attack.requirements(obs)
        if reasons:
            return None, "; ".join(reasons)
        return attack(obs, x, labels=y).scores.cpu().double().numpy(), None
    attack = MEMBERSHIP_ATTACKS.create(spec.attack, **dict(spec.options))
    reasons = attack.requirements(obs)
    if reasons:
        return None, "; ".join(reasons)
    k = refs.count
    result = attack(obs, x, labels=y, reference=refs.outputs(None, models=k), population=x, population_labels=y,
                    population_reference=refs.outputs(None, models=k))
    return result.scores.cpu().double().numpy(), None


def reference_trial(spec: TrialSpec, clock, cache_dir) -> TrialResult:
    """Train (or load) the target and its reference models under the defense, run the attack, score it."""
    from ...defenses import DPSGD, parse, parts_of
    from ...metrics.membership import tpr_at_fpr
    from .audit import audit_scores
    from .reference import cached_target, canary_audit, divergence, train_reference_models
    from ..training.utility import loss_and_accuracy

    m = dict(spec.membership)
    data = dataset_for(spec)
    pool = pool_for(data, int(m["pool"]), seed=spec.seed)
    clock.lap("load")
    recipe = recipe_for(spec)
    cache = _cache(cache_dir)
    target = cached_target(recipe, pool, seed=spec.seed, device=spec.device, cache_dir=cache)
    refs = train_reference_models(recipe, pool, count=int(m["reference_models"]), seed=spec.seed,
                                  device=spec.device, cache_dir=cache)
    clock.lap("train")
    members = pool.subset(torch.nonzero(target.in_mask).reshape(-1))
    why = divergence(target.model, members.images, members.labels, target.train_loss, loss=recipe.loss)
    bad_refs = [i for i, v in enumerate(refs.train_loss) if not math.isfinite(float(v))]
    if why is None and bad_refs:
        why = f"non-finite/diverged reference model(s) {bad_refs[:5]}: their training ended on a NaN/inf loss"
    if why is not None:  # a diverged model is no target: failed with the reason, never scored as "no leakage"
        return TrialResult(key=spec.key, status="failed", error=why)
    clock.start_budget()
    scores, why = _scores(spec, target, pool, refs)
    if scores is None:
        return TrialResult(key=spec.key, status="n/a", error=why)
    clock.lap("attack")
    member = target.in_mask.numpy().astype(bool)
    bad = ~np.isfinite(scores)
    ranked = np.where(bad, (scores[~bad].min() - 1.0) if (~bad).any() else 0.0, scores)  # unscored: never members
    nonmembers, members = int((~member).sum()), int(member.sum())
    auc = auc_interval(ranked, member)
    outside = pool.subset(torch.nonzero(~target.in_mask).reshape(-1))
    dev = next(target.model.parameters()).device
    test_loss, test_accuracy = loss_and_accuracy(target.model, outside.images.to(dev), outside.labels.to(dev),
                                                 loss=recipe.loss)
    metrics: dict[str, Any] = {
        "auc": auc.mean, "auc_low": auc.low, "auc_high": auc.high,
        **{f"tpr_at_fpr_{f:g}": (tpr_at_fpr(ranked, member, f) if measurable_fpr(f, nonmembers) else None)
           for f in FPRS},
        "tpr_at_fpr_0": tpr_at_fpr(ranked, member, 0.0),
        "members": members, "nonmembers": nonmembers, "unscored": int(bad.sum()),
        "reference_models": refs.count, "pool": len(pool),
        "train_loss": target.train_loss, "train_accuracy": target.train_accuracy,
        "test_loss": test_loss, "test_accuracy": test_accuracy, "epsilon": target.epsilon,
        # utility, paired by model across the defenses of this entry: the target, then each reference model
        "train_losses": [target.train_loss, *map(float, refs.train_loss)],
    }
    dp = next((p for p in parts_of(parse(spec.defense)) if isinstance(p, DPSGD)), None)
    if dp is not None and target.epsilon is not None and math.isfinite(target.epsilon):
        audit = audit_scores(ranked, member, delta=float(dp.delta), claimed=float(target.epsilon), seed=spec.seed)
        metrics.update(audit_epsilon=audit.epsilon, audit_tp=audit.true_positives, audit_members=audit.members,
                       audit_fp=audit.false_positives, audit_nonmembers=audit.nonmembers, audit_delta=audit.delta,
                       audit_violated=audit.violated)
        if int(m.get("canaries") or 0) > 0:  # the one-run audit: one more run with canaries (cached per setting)
            one = canary_audit(recipe, pool, canaries=int(m["canaries"]), seed=spec.seed, device=spec.device,
                               cache_dir=cache)
            metrics.update({f"one_run_{k}": v for k, v in one.items()})
            metrics["one_run_violated"] = one["claimed"] is not None and one["epsilon"] > one["claimed"]
    clock.lap("score")
    per_sample = {"score": [float(v) for v in ranked], "member": [int(v) for v in member]}
    arrays = {"scores": ranked, "is_member": member.astype(np.int64)} if spec.save_images else {}
    return TrialResult(key=spec.key, status="done", metrics=metrics, per_sample=per_sample, arrays=arrays)
