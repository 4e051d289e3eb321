"""Membership inference and published-weights attacks on the checkpoints of a federated run: does round t's
global model tell who trained it, or give their samples back?

A sweep's ``membership`` entry with ``run: <model label>`` (:class:`~..sweep_spec.weights.MembershipEntry`) plans
one trial per dataset × round × defense × seed × attack.  A trial loads the run's global model θ_t — the
checkpoint the reconstruction trials of round t attack, from the same content-addressed run (same key, same
cache), trained under the defense from round 1 — and scores

- **members**: a seeded draw of at most ``pool``/2 of the clients' samples (every client's, or client
  ``client``'s), the same points at every round and under every defense of a seed;
- **non-members**: as many of the seed's test split, which no client ever held;

with a membership attack that needs no reference models (by default the loss attack of Yeom et al. 2018,
CSF, Sec. 3.2: score −ℓ(θ_t; x, y)).  The trial stores what a reference-model trial stores (:mod:`.reference_trial`):
AUC with its stratified bootstrap interval, TPR at 1 % and 0.1 % FPR where the non-members measure it, TPR with no
false positive, the per-point scores (so the membership verdict pairs defenses point by point), and the run's
utility at the round (training loss, test accuracy).  Round 0 is the untrained model, which no sample has
touched: its AUC is the run's own chance control (members and non-members are exchangeable there).

A ``weights`` entry with ``run:`` runs its attacks (kkt, model-inversion, univariate) on the same checkpoints and
scores the candidates as a published target's (:mod:`.published`): members recovered as nearest neighbours beside
the non-members picked the same way (the chance level), and SSIM-voted members beside test images standing in
for the candidates.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..trials.inputs import built, dataset_for, federated_checkpoint
from ..trials.trial import TrialResult, TrialSpec
from ..verdicts.stats import auc_interval, measurable_fpr
from .reference_trial import FPRS

__all__ = ["run_points", "round_membership_trial", "round_weights_trial"]


def _draw(data, spec: TrialSpec, client: int | None, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(members, the seeded order of the test split): at most ``count`` of the clients' samples (or client
    ``client``'s), drawn with the trial's seed only (the same points at every round and defense)."""
    from ..training.federated import layout

    seed = int(spec.training["seed"])
    lay = layout(data, spec.training["federated"], seed)
    owners = lay.clients[int(client)] if client is not None else np.concatenate(lay.clients)
    rng = np.random.default_rng([seed % 2**63, 7, 0 if client is None else int(client) + 1])
    members = rng.choice(owners, size=min(count, len(owners)), replace=False)
    return members, rng.permutation(lay.test)


def run_points(data, spec: TrialSpec) -> tuple[np.ndarray, np.ndarray]:
    """(indices, is-member flags) of a membership trial's points: at most ``pool``/2 members from the clients'
    samples and as many non-members from the test split."""
    members, outside = _draw(data, spec, spec.membership.get("client"), int(spec.membership["pool"]) // 2)
    n = min(len(members), len(outside))
    return np.concatenate([members[:n], outside[:n]]), np.repeat([True, False], n)


def _checkpoint(spec: TrialSpec, cache_dir) -> tuple[Any, torch.nn.Module, dict, str | None]:
    """(data, the run's global model at the trial's round in eval mode, its round metrics, why it diverged)."""
    from ..training.federated import diverged

    data = dataset_for(spec)
    model = built(spec, data, torch.device(spec.device))
    state, info = federated_checkpoint(spec, data, model, cache_dir)
    model.load_state_dict(state)
    model.eval()
    return data, model, info, diverged(info)


def round_membership_trial(spec: TrialSpec, clock, cache_dir) -> TrialResult:
    """Load (or train) the run's checkpoint at the trial's round, run the attack on members and non-members, score."""
    from ...attacks.membership import MEMBERSHIP_ATTACKS
    from ...errors import LeakbenchError
    from ...metrics.membership import tpr_at_fpr
    from ...threat import observe_weights

    device = torch.device(spec.device)
    data, model, info, why = _checkpoint(spec, cache_dir)
    clock.lap("train")
    if why is not None and why.startswith("non-finite"):  # a diverged model is no target: never "no leakage"
        return TrialResult(key=spec.key, status="failed", error=f"the run diverged by round "
                                                                 f"{spec.training['round']}: {why}")
    index, member = run_points(data, spec)
    if len(index) < 4:
        return TrialResult(key=spec.key, status="n/a", error=f"only {len(index) // 2} member(s) and as many "
                           "non-members to score (raise membership.pool or the dataset's size)")
    x, y = data.images[torch.as_tensor(index)].to(device), data.labels[torch.as_tensor(index)].to(device)
    attack = MEMBERSHIP_ATTACKS.create(spec.attack, **dict(spec.options))
    obs = observe_weights(model, input_shape=tuple(data.shape), num_classes=data.num_classes)
    reasons = attack.requirements(obs)
    if reasons:
        return TrialResult(key=spec.key, status="n/a", error="; ".join(reasons))
    clock.start_budget()
    try:
        scores = attack(obs, x, labels=y).scores.detach().cpu().double().numpy()
    except LeakbenchError as err:  # e.g. an attack that needs reference models, which a run's rounds lack
        return TrialResult(key=spec.key, status="n/a", error=str(err).splitlines()[0])
    clock.lap("attack")
    bad = ~np.isfinite(scores)
    ranked = np.where(bad, (scores[~bad].min() - 1.0) if (~bad).any() else 0.0, scores)  # unscored: never members
    n = int(member.sum())
    auc = auc_interval(ranked, member)
    metrics: dict[str, Any] = {
        "auc": auc.mean, "auc_low": auc.low, "auc_high": auc.high,
        **{f"tpr_at_fpr_{f:g}": (tpr_at_fpr(ranked, member, f) if measurable_fpr(f, n) else None) for f in FPRS},
        "tpr_at_fpr_0": tpr_at_fpr(ranked, member, 0.0),
        "members": n, "nonmembers": n, "unscored": int(bad.sum()), "reference_models": 0, "pool": 2 * n,
        "round": int(spec.training["round"]), "client": spec.membership.get("client"),
        "train_loss": info.get("train_loss"), "train_accuracy": info.get("train_accuracy"),
        "test_loss": info.get("test_loss"), "test_accuracy": info.get("test_accuracy"),
        "update_norm": info.get("update_norm"),
        # utility, paired across the defenses of the same seed: the run's training loss at this round
        "train_losses": [info.get("train_loss")],
    }
    if why is not None:
        metrics["diverged"] = why
    clock.lap("score")
    per_sample = {"score": [float(v) for v in ranked], "member": [int(v) for v in member]}
    arrays = {"scores": ranked, "is_member": member.astype(np.int64)} if spec.save_images else {}
    return TrialResult(key=spec.key, status="done", metrics=metrics, per_sample=per_sample, arrays=arrays)


def round_weights_trial(spec: TrialSpec, clock, cache_dir) -> TrialResult:
    """A ``weights`` attack (kkt, model-inversion, univariate) on a run's global model at the trial's round, its
    candidates scored as a published target's (:func:`~.published.weights_scores`): against at most ``members`` of
    the clients' samples, beside as many of the test split (the nearest-neighbour chance) and as many further
    test images standing in for the candidates (the SSIM control)."""
    from ...threat import observe_weights
    from ..trials.attack import run_attack
    from .published import finite_candidates, weights_scores

    data, model, info, why = _checkpoint(spec, cache_dir)
    clock.lap("train")
    if why is not None and why.startswith("non-finite"):
        return TrialResult(key=spec.key, status="failed", error=f"the run diverged by round "
                                                                 f"{spec.training['round']}: {why}")
    rec = run_attack(spec, observe_weights(model, input_shape=tuple(data.shape), num_classes=data.num_classes),
                     clock)
    if isinstance(rec, TrialResult):
        return rec
    candidates, dropped = finite_candidates(rec.images.detach().to("cpu", torch.float64))
    members, outside = _draw(data, spec, spec.target.get("client"), int(spec.target["members"]))
    n = min(len(members), len(outside))
    control = outside[n:n + int(candidates.shape[0])]
    images = data.images.detach().cpu().double()
    metrics: dict[str, Any] = weights_scores(candidates, images[torch.as_tensor(members)],
                                             images[torch.as_tensor(outside[:n])], images[torch.as_tensor(control)])
    metrics.update(diverged=dropped + int((rec.trace or {}).get("diverged", 0)), round=int(spec.training["round"]),
                   train_loss=info.get("train_loss"), test_accuracy=info.get("test_accuracy"))
    clock.lap("score")
    return TrialResult(key=spec.key, status="done", metrics=metrics,
                       timings={"attack_reported": float((rec.trace or {}).get("seconds", 0.0))})
