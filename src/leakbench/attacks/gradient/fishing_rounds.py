"""Multi-round feature fishing (Wen, Geiping, Fowl, Goldblum & Goldstein, "Fishing for User Data in Large-Batch
Federated Learning via Gradient Magnification", ICML 2022, Sec. 3.2): the server queries the same client again
and again with feature-fishing heads at thresholds τ it chooses, and reads single samples from the difference of
two rounds.

The client's first round is the shipped model's (:func:`leakbench.models.active.feature_fishing`,
p_target = σ(m·(φ_j − τ)) for every sample).  Each further round ships :func:`~leakbench.models.active.refished`
at a new τ with m = ``sharpness``/σ_j (σ_j: the public spread of φ_j the shipped head recorded), so that only
samples within ~10/m of τ are neither in nor out.  :func:`~leakbench.attacks.solvers.fishing_search.isolate`
counts the samples below each τ from the bias gradient, n(τ) = −B·∂L/∂b_t = N(φ_j < τ) − n_other, and splits the
feature axis until intervals hold one sample; below the head, the difference of those two rounds' gradients is
that sample's −(m/B)·∇φ_j alone, of whatever class.  Read-outs, as ``fishing``'s:

- ``rows`` (a first FC layer with bias and a ReLU): x = ∇W_k/∇b_k on every row k the sample activates; the slot
  has confidence 1 when the rows holding ≥ 10 % of the largest bias gradient agree to 1e-4 of the data range,
  0.5 when they do not (the difference then holds a share of another sample);
- ``matching``: the difference inverted at B = 1 as a target-class sample with p_target pinned at ≈ 0
  (:func:`~leakbench.attacks.solvers.fishing_base.invert_fished`: m·(p_t − 1)·∇φ_j = −m·∇φ_j is then what the candidate sends).

Threat model (the paper's cross-silo setting): the client holds the same batch in every round, and the server may
ship a new head each round; ``Observation.extras["query"]`` is that client — a callable taking the shipped model
and returning the next round's observation (sweeps attach it for malicious-server trials, fresh noise each round;
:func:`leakbench.threat.requery` builds one).  Under secure aggregation the other clients' batches change from
round to round, so differences do not isolate a sample: refused, with the reason (LOKI is the attack there); so are
updates (FedAvg), whose float32 parameters hold the sharp head's large bias too coarsely for an integral count.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ...errors import NothingRecovered, expect
from ...models.active import head_inputs, refished
from ...threat import Observation
from ..base import Reconstruction, register
from ..solvers.fishing_base import FishedAttack, FishingOptions, fished_count, invert_fished, per_client
from ..solvers.fishing_search import Round, isolate

__all__ = ["FishingRounds", "FishingRoundsOptions", "read_single"]

#: the most rounds one trial may query (each keeps the shared tensors below the head)
MAX_ROUNDS = 256
#: samples within SOFT/m of τ have p_target neither 0 nor 1 (e^(−SOFT) ≈ 2e-9): intervals narrower are not split
SOFT = 20.0
#: the most numbers the kept rounds may hold (rounds × shared tensors below the head; 1 GiB of float32)
MAX_KEPT = 2 ** 28
#: a certified slot: rows agree to this fraction of the data range
EXACT = 1e-4


@dataclass
class FishingRoundsOptions(FishingOptions):
    """Options of ``fishing-rounds``: ``fishing``'s read-outs, the round budget and the later heads' sharpness."""

    #: rounds the server may query the client (the shipped model's included), at most 256
    rounds: int = 96
    #: m·σ_j of the later rounds' heads: samples closer than ~20·σ_j/sharpness along φ_j are not split
    sharpness: float = 1e5
    #: samples to isolate before stopping (None: all of the batch)
    want: int | None = None
    #: features searched one after the other (the shipped one first, then the server's candidates: a sample at a
    #: ReLU feature's zero sends no gradient through it); the matching read-out searches the shipped one only
    features: int = 4

    def check(self) -> None:
        super().check()
        expect(isinstance(self.rounds, int) and not isinstance(self.rounds, bool) and 3 <= self.rounds <= MAX_ROUNDS,
               f"expected rounds an integer in 3..{MAX_ROUNDS}, got {self.rounds!r} (option rounds)")
        expect(isinstance(self.sharpness, (int, float)) and not isinstance(self.sharpness, bool)
               and math.isfinite(self.sharpness) and self.sharpness > 0,
               f"expected sharpness > 0, got {self.sharpness!r} (option sharpness)")
        expect(isinstance(self.features, int) and not isinstance(self.features, bool) and self.features >= 1,
               f"expected features an integer ≥ 1, got {self.features!r} (option features)")
        expect(self.want is None or (isinstance(self.want, int) and not isinstance(self.want, bool) and self.want >= 1),
               f"expected want an integer ≥ 1 or None (all), got {self.want!r} (option want)")


def read_single(grad_w: torch.Tensor, grad_b: torch.Tensor, data_range: tuple[float, float], *,
                threshold: float = 0.1) -> tuple[torch.Tensor, bool, float]:
    """One sample from one sample's gradient of a first ReLU FC layer: (x̂, consistent, spread of the rows' reads).
    x = ∇W_k/∇b_k on each row k it activates; consistent when the rows holding ≥ ``threshold`` of the largest
    |∇b| agree to ``EXACT`` of the data range (a single such row — the feature is a first-layer neuron — is
    consistent by itself: the evidence is then the two rounds' integral counts alone)."""
    size = grad_b.abs()
    top = float(size.max()) if size.numel() else 0.0
    if not top > 0:
        raise NothingRecovered("the difference of the two rounds is zero on the first layer: no sample activates it")
    rows = (size >= threshold * top).nonzero().reshape(-1)
    reads = grad_w[rows] / grad_b[rows, None]
    best = reads[size[rows].argmax()]
    spread = float((reads - best).abs().max())
    lo, hi = data_range
    return best, spread <= EXACT * (hi - lo), spread


@register
class FishingRounds(FishedAttack):
    """Wen et al.'s multi-round feature fishing: single samples from differences of rounds at chosen thresholds."""

    name = "fishing-rounds"
    tags = ("gradient", "modified-model", "rounds")
    Options = FishingRoundsOptions
    preset_revisions = {"default": 0, "quick": 0}
    presets = {"quick": {"engine": "quick", "rounds": 24}}

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["fishing-rounds needs a shared gradient or update, not trained weights"]
        if getattr(obs.model, "fishing_feature", None) is None:
            return ["fishing-rounds needs the server's feature-fishing head: ship leakbench.models.active.fishing("
                    "model, target=c, quantile=q, calibration=public) (a sweep's server: {fishing: {target: c, "
                    "quantile: q}})"]
        if not callable(obs.extras.get("query")):
            return ["fishing-rounds queries the client again: it needs obs.extras['query'] (the client as a "
                    "callable, model → observation of the same batch; leakbench.threat.requery builds one, and "
                    "sweeps attach it for malicious-server trials)"]
        if (obs.extras.get("defense") or {}).get("secagg") is not None:
            return ["fishing-rounds reads differences of rounds; under secure aggregation the other clients' "
                    "batches change from round to round, so no difference isolates one sample (loki is the "
                    "malicious-server attack for secure aggregation)"]
        if obs.kind == "update":
            steps = len(obs.local_batches) if obs.local_batches else obs.local_steps
            return ["fishing-rounds counts samples from the head's bias gradient to 1e-4; an update holds that bias "
                    "(−m·τ, ~1e5 for a sharp head) in float32 to ~1e-2 of a step, so no count is an integer"
                    + (f", and {steps} local steps are not the sum of the samples' updates" if steps > 1 else "")
                    + " (it reads FedSGD gradients)"]
        return super().requirements(obs)

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        o = self.options
        model, query = obs.model, obs.extras["query"]
        target, head = int(model.fishing_target), str(model.fishing_head)
        readout, found = self._readout(obs)
        layer = found[1] if readout == "rows" else None
        # by name: every round's model is a copy; the row read-out needs the first layer only
        keep = ([obs.param_names.index(f"{found[0]}.{p}") for p in ("weight", "bias")] if layer is not None else
                [i for i, n in enumerate(obs.param_names) if n not in (f"{head}.weight", f"{head}.bias")])
        spread = float(getattr(model, "fishing_spread", 1.0))
        shipped = (int(model.fishing_feature), float(model.fishing_threshold), spread)
        # the row read-out knows each sample it read, so later features skip them; matching keeps the shipped one
        features = (list(getattr(model, "fishing_candidates", None) or [shipped])[: o.features] if layer is not None
                    else [shipped])
        total = per_client(obs)
        want = total if o.want is None else min(o.want, total)
        used = [1]   # the shipped round

        kept = sum(obs.shared[i].numel() for i in keep)
        expect(kept * o.rounds <= MAX_KEPT,
               f"fishing-rounds keeps every round's {kept} shared numbers below the head: {o.rounds} rounds would "
               f"hold {kept * o.rounds}, above {MAX_KEPT} (option rounds; the rows read-out keeps the first layer only)")

        def body(observed: Observation) -> list[torch.Tensor]:
            grads = observed.gradients
            return [grads[i] for i in keep]

        reads: list[tuple[torch.Tensor, bool]] = []
        singles, searches = [], []
        for j, centre, width in features:
            left = o.rounds - used[0]
            if left < 3 or len(singles) >= want:
                break
            scale = o.sharpness / width

            def ask(tau: float, j=j, scale=scale):
                observed = query(refished(model, tau, scale, feature=j))
                expect(isinstance(observed, Observation) and observed.param_names == obs.param_names,
                       "expected obs.extras['query'] to return the observation of the same client under the shipped "
                       f"model, got {type(observed).__name__} (leakbench.threat.requery builds one)")
                used[0] += 1
                if progress is not None:
                    progress(used[0], o.rounds, 0.0)
                return fished_count(observed, head, target), body(observed)

            # the shipped round joins the search only when its head is as sharp as the search's (a soft head's
            # shares of two samples can sum to an integer: a mixture, not one sample)
            first = (Round(centre, fished_count(obs, head, target), body(obs))
                     if j == shipped[0] and float(getattr(model, "fishing_scale", 0.0)) * width >= o.sharpness
                     else None)
            # where the samples already read sit along this feature (the server knows its model)
            positions = (head_inputs(model, head, torch.stack([x for x, _ in reads]).reshape(-1, *obs.input_shape))[:, j]
                         if reads else None)
            inside = None if positions is None else (
                lambda a, b, pos=positions: int(((pos >= a) & (pos < b)).sum()))
            search = isolate(ask, start=centre, spread=width, total=total, budget=left, want=want - len(singles),
                             known=first, finest=SOFT * width / o.sharpness, inside=inside)
            searches.append({"feature": j, "rounds": len(search.rounds), "isolated": len(search.isolated),
                             "bracket": search.bracket, "notes": search.notes})
            for single in search.isolated:
                if layer is not None:
                    try:
                        x, consistent, _ = read_single(single.shared[0].double(), single.shared[1].double(),
                                                       obs.data_range)
                    except NothingRecovered:   # alone, but at the feature's ReLU zero: it sends nothing to read
                        continue
                    if any(float((x - y).abs().max()) <= 1e-3 * (obs.data_range[1] - obs.data_range[0])
                           for y, _ in reads):
                        continue   # read on an earlier feature already
                    reads.append((x, consistent))
                singles.append(single)
        if not singles:
            notes = "; ".join(n for s in searches for n in s["notes"]) or "no interval held exactly one sample"
            raise NothingRecovered(f"fishing-rounds isolated no sample in {used[0]} rounds: {notes}")
        lo, hi = obs.data_range
        batch = obs.batch_size
        images = torch.full((batch, *obs.input_shape), (lo + hi) / 2, dtype=obs.dtype, device=obs.device)
        confidence = torch.zeros(batch, dtype=obs.dtype, device=obs.device)
        notes: list[str] = []
        for slot, single in enumerate(singles[:batch]):
            if layer is not None:
                x, consistent = reads[slot]
                images[slot] = x.reshape(obs.input_shape).to(images)
                confidence[slot] = 1.0 if consistent else 0.5
                continue
            shared = [torch.zeros_like(t) for t in obs.shared]
            for i, t in zip(keep, single.shared):
                shared[i] = t.to(obs.shared[i])
            diff = dataclasses.replace(obs, kind="gradient", shared=shared, local_steps=1, local_lr=0.0,
                                       local_batches=None)
            result, note = invert_fished(diff, target=target, head=head, settings=o.matching(obs.input_shape),
                                         seed=seed + slot, callback=callback)
            images[slot] = result.images[0].to(images)
            confidence[slot] = 1.0
            notes.append(note)
        trace = {"readout": readout, "rounds_used": used[0], "isolated": len(singles), "features": searches,
                 "intervals": [(s.low, s.high) for s in singles], "sharpness": o.sharpness,
                 "fished_feature": shipped[0],
                 "targeted": "the isolated samples (the claimed slots), not the batch",
                 "confidence": "slots 0…k−1: one sample each, from a difference of two rounds (rows: 1 when its "
                               "rows agree to 1e-4 of the range, else 0.5); the others are not claimed (grey, 0)"}
        if layer is not None:
            trace["consistent"] = sum(c for _, c in reads)
        else:
            trace["match"] = notes[0] if notes else ""
        return Reconstruction(images=images.detach(), confidence=confidence, trace=trace)

