"""The ``attack`` trial: observe the batch under the defense, run the attack within the trial's budget, and
score the reconstruction after Hungarian matching beside its chance level (images), or by tokens and ROUGE
(text)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import numpy as np
import torch

from ...errors import NothingRecovered
from .controls import constant_output, identification_pool, model_features
from .inputs import _dataset, apply_server, batch_for, dataset_for, model_for, observed_defense
from .trial import Clock, TrialResult, TrialSpec


def run_attack(spec: TrialSpec, obs, clock: Clock) -> Any:
    """The spec's attack run on ``obs`` under the trial's budget, or the ``n/a`` result saying why it cannot run."""
    from ...attacks import create

    attack = create(spec.attack, preset=spec.preset, **spec.options)
    reasons = attack.requirements(obs)
    if reasons:
        return TrialResult(key=spec.key, status="n/a", error="; ".join(reasons))
    if clock.prepared is not None:  # solved in a batched call with the trial's chunk-mates
        if isinstance(clock.prepared, BaseException):
            raise clock.prepared
        clock.lap("attack")
        return clock.prepared
    clock.start_budget()
    rec = attack(obs, seed=spec.seed, progress=clock.progress)
    clock.lap("attack")
    return rec


def attack_trial(spec: TrialSpec, clock: Clock, cache_dir) -> TrialResult:
    from ...threat import observe, requery
    from ..sweep_spec.modality import pair_refusal

    reason = pair_refusal(spec.dataset, spec.model, spec.attack)
    if reason is not None:  # an image attack on text (or back): skipped with the reason, nothing loaded
        return TrialResult(key=spec.key, status="n/a", error=reason)
    device = torch.device(spec.device)
    data = dataset_for(spec)
    clock.lap("load")
    model = honest = model_for(spec, data, device, cache_dir)
    if spec.server:
        model = apply_server(spec, model, data)
    clock.lap("model")
    x, y = batch_for(spec, data)
    x, y = x.to(device), y.to(device)
    # the dataset is the population other clients draw from (secure aggregation needs one)
    obs = observe(model, x, y, defense=observed_defense(spec), seed=spec.seed, population=data, **spec.threat)
    if spec.server:  # a malicious server may query the same client again, fresh randomness each round (fishing-rounds)
        obs.extras["query"] = requery(x, y, defense=observed_defense(spec), seed=spec.seed, population=data,
                                      **spec.threat)
    clock.lap("observe")
    result = _attacked(spec, obs, x, y, data, clock)
    if result.status == "done":  # an update too small to carry anything is said to be that (:mod:`.strongest`)
        result.metrics["update_norm"] = float(torch.sqrt(sum((s.double() ** 2).sum() for s in obs.shared)))
        if spec.server:
            result.metrics["client_check"] = client_check(honest, model, x, y, spec.threat.get("loss", "ce"))
    return result


def client_check(honest: torch.nn.Module, shipped: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 loss: str) -> float:
    """1.0 when the client's check (:func:`leakbench.analysis.inspect`: the shipped model against the honest one
    it replaces, with the attacked batch) would have refused the model before training, else 0.0."""
    from ...analysis import inspect

    if not x.is_floating_point():  # token ids: the data check runs on images only
        return float(inspect(honest, shipped).suspicious)
    return float(inspect(honest, shipped, x=x, y=y, loss=loss).suspicious)


def _attacked(spec: TrialSpec, obs, x: torch.Tensor, y: torch.Tensor, data, clock: Clock) -> TrialResult:
    """Run the spec's attack on ``obs`` and score it against the batch ``(x, y)``."""
    from ...metrics import compare
    from ...metrics.perceptual import user_weights
    from ...metrics.registered import plugin_info

    try:
        rec = run_attack(spec, obs, clock)
    except NothingRecovered as err:
        if not is_text(data):
            raise
        # a defense left the attack nothing to recover (DAGER: noise fills the span): its output is the empty
        # sequence, scored as such (token accuracy 0), with the reason — a measurement, not a failed trial
        clock.lap("attack")
        return text_result(spec, None, x.cpu(), y.cpu(), data, clock, nothing=str(err))
    if isinstance(rec, TrialResult):
        return rec
    if is_text(data):
        return text_result(spec, rec, x.cpu(), y.cpu(), data, clock)
    images = rec.images.detach().to("cpu", torch.float32)
    if constant_output(images):
        # a constant image carries nothing about the batch: scoring it would rank a defense by a grey image
        return TrialResult(key=spec.key, status="failed",
                           error=f"the attack returned one flat value ({float(images.flatten()[0]):.3g}) for every "
                                 "pixel: it determined nothing from this observation, so there is nothing to score",
                           timings={"attack_reported": float(rec.trace.get("seconds", 0.0))})
    labels = None if rec.labels is None else rec.labels.detach().cpu()
    if labels is not None and labels.ndim == 2:
        labels = labels.argmax(dim=1)
    x, y = x.cpu(), y.cpu()
    # the whole reconstruction, so attacks that flag exact samples are scored with their flags (confident-first)
    confidence = None if rec.confidence is None else rec.confidence.detach().cpu()
    # the chance level: a flat image at the data mean; labels nobody knows (an unlabelled folder) score no accuracy;
    # IIP against the batch plus a seeded draw of the dataset (iip_pixel beside chance_iip_pixel)
    scores = compare(dataclasses.replace(rec, images=images, labels=labels, confidence=confidence), x,
                     y if getattr(data, "labels_known", True) else None, chance_level=float(data.images.mean()),
                     pool=identification_pool(x, data, seed=spec.seed) if x.dim() == 4 else None,
                     feature_fn=model_features(obs.model, x) if x.dim() == 4 else None,
                     lpips=bool(user_weights()))  # LPIPS (and chance_lpips) when the user supplied its weights
    clock.lap("score")
    per_sample = scores.pop("per_sample")
    order = scores.pop("order")
    metrics = {k: v for k, v in scores.items() if v is None or isinstance(v, (int, float))}
    if rec.trace.get("targeted") and confidence is not None:
        batch = {"batch_rmse": metrics.get("rmse"), "batch_chance_rmse": metrics.get("chance_rmse")}
        metrics.update(targeted_scores(per_sample, order, confidence))
        if metrics["targets"]:
            metrics.update(batch)
    metrics["matching"] = str(scores.get("matching", "total-mse"))  # which pairing of Liu et al. eq. 1 scored it
    shown = {name: info for name, info in plugin_info().items() if name in metrics}
    if shown:  # how the report labels a plug-in's metric, without importing the plug-in
        metrics["metric_info"] = shown
    arrays = {}
    if spec.save_images:
        arrays = {"x": x.numpy(), "y": y.numpy(), "reconstruction": images.numpy(),
                  "order": np.asarray(order, dtype=np.int64),
                  "labels": (labels.numpy().astype(np.int64) if labels is not None
                             else np.full(images.shape[0], -1, dtype=np.int64))}
    return TrialResult(key=spec.key, status="done", metrics=metrics, per_sample=per_sample, arrays=arrays,
                       timings={"attack_reported": float(rec.trace.get("seconds", 0.0))},
                       attack_options=dict(rec.options or {}))


def targeted_scores(per_sample: dict, order: list[int], confidence: torch.Tensor) -> dict:
    """A targeted attack's headline scores (``rmse``, ``psnr`` and their chance levels) on the k originals matched to
    the slots it claims (confidence > 0), the batch's kept as ``batch_rmse`` / ``batch_chance_rmse``.

    The chance control goes through the same selection: the flat image is credited with the k originals it is
    nearest to (the smallest per-original chance RMSEs), as the matching credits the attack with the originals
    nearest its claimed slots.  No claimed slot: the batch's scores stand and ``targets`` is 0."""
    claimed = [i for i, slot in enumerate(order) if float(confidence[slot]) > 0]
    out: dict = {"targets": len(claimed)}
    if not claimed:
        return out
    rmse = [float(per_sample["rmse"][i]) for i in claimed]
    chance = sorted(float(c) for c in per_sample["chance_rmse"])[: len(claimed)]
    mse, chance_mse = sum(r * r for r in rmse) / len(rmse), sum(c * c for c in chance) / len(chance)
    out.update(rmse=math.sqrt(mse), chance_rmse=math.sqrt(chance_mse),
               psnr=10 * math.log10(1 / mse) if mse > 0 else math.inf,
               chance_psnr=10 * math.log10(1 / chance_mse) if chance_mse > 0 else math.inf,
               scored="targets: the slots the attack claims (chance: the flat image's nearest originals)")
    return out


def is_text(data) -> bool:
    """True for a dataset of token sequences (:class:`~leakbench.data.TextDataset`)."""
    from ...data import TextDataset

    return isinstance(data, TextDataset)


#: the text scores a text trial stores (:func:`~leakbench.metrics.text_scores`), each beside its chance level
TEXT_METRICS = ("token_acc", "rouge1", "rouge2", "rougeL", "exact")


def text_result(spec: TrialSpec, rec, x: torch.Tensor, y: torch.Tensor, data, clock: Clock, *,
                nothing: str | None = None) -> TrialResult:
    """Score a text reconstruction: token accuracy after Hungarian matching, ROUGE-1/2/L and the exact rate
    (:func:`~leakbench.metrics.text_scores`), beside the same scores of unigram draws
    (:func:`~leakbench.metrics.unigram_chance`, ``chance_*``).

    The verdict logic (:mod:`.strongest`) ranks by ``token_error`` = 1 − token accuracy (lower = more leakage,
    as RMSE) against ``chance_token_error``; per sequence (original order) the same, for the per-sample
    strongest attack.  Arrays: the original and recovered ids, their pairing and the decoded sentences are
    left to the report (``x``, ``reconstruction``, ``order``).  ``nothing``: the attack recovered nothing (its
    reason; ``rec`` None): the empty output is scored, and the reason kept as ``metrics["nothing_recovered"]``.
    """
    from ...metrics.text_metrics import content, match_sequences, text_scores, token_accuracy_matrix, unigram_chance

    ids = torch.full_like(x, data.pad_id) if rec is None else rec.images.detach().cpu()
    if ids.is_floating_point():
        ids = ids.round().long()
    tok = data.tokenizer
    kw = dict(decode=tok.decode, pad_id=data.pad_id, eos_id=tok.eos_id)
    scores = text_scores(ids, x, **kw)
    chance = unigram_chance(x, _unigram(spec, data), seed=spec.seed, **kw)
    orig, found = content(x, (data.pad_id, tok.eos_id)), content(ids, (data.pad_id, tok.eos_id))
    partner = match_sequences(found, orig)
    acc = token_accuracy_matrix(found, orig)
    per_acc = [float(acc[i, j]) if j is not None else 0.0 for i, j in enumerate(partner)]
    clock.lap("score")
    metrics: dict[str, Any] = {k: float(v) for k, v in scores.items()}
    metrics.update({f"chance_{k}": float(v) for k, v in chance.items()})
    metrics.update(token_error=1.0 - metrics["token_acc"], chance_token_error=1.0 - metrics["chance_token_acc"],
                   modality="text", sequences=len(orig), matching="hungarian-token-accuracy")
    if nothing is not None:
        metrics["nothing_recovered"] = nothing
    flags = None if rec is None else rec.trace.get("exact")
    if isinstance(flags, list) and flags and all(isinstance(f, bool) for f in flags):
        metrics["flagged_exact"] = int(sum(flags))
    per_sample = {"token_acc": per_acc, "token_error": [1.0 - a for a in per_acc],
                  "chance_token_error": [1.0 - metrics["chance_token_acc"]] * len(per_acc),
                  "partner": [-1 if j is None else int(j) for j in partner]}
    arrays = {}
    if spec.save_images:
        arrays = {"x": x.numpy().astype(np.int64), "y": y.numpy().astype(np.int64),
                  "reconstruction": ids.numpy().astype(np.int64),
                  "order": np.asarray(per_sample["partner"], dtype=np.int64)}
    return TrialResult(key=spec.key, status="done", metrics=metrics, per_sample=per_sample, arrays=arrays,
                       timings={"attack_reported": 0.0 if rec is None else float(rec.trace.get("seconds", 0.0))},
                       attack_options={} if rec is None else dict(rec.options or {}))


@functools.lru_cache(maxsize=4)
def _unigram_of(name: str, options_json: str) -> torch.Tensor:
    return _dataset(name, options_json).unigram()


def _unigram(spec: TrialSpec, data) -> torch.Tensor:
    """The chance draws' unigram distribution: the dataset's (computed once per process)."""
    return _unigram_of(spec.dataset, json.dumps(spec.data_options, sort_keys=True))


__all__ = ["attack_trial", "client_check", "is_text", "text_result", "TEXT_METRICS"]
