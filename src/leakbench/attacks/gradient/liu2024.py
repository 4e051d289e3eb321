"""The attack of Liu, Guo, Lei et al. (2024), "Data reconstruction attacks and defenses: a systematic
evaluation", Sec. 4.2 and App. F.

Objective (eq. 4), minimised over the parameters of an untrained CNN generator G (deep image
prior, Ulyanov et al. 2018; :class:`~leakbench.models.generator.UNetGenerator`) with x = G(ξ) for
a fixed noise ξ:

    L_grad(x) + α_TV R_TV(x) + α_BN R_BN(x) + α_f R_feature(x)

* L_grad — Inverting Gradients' cosine, one term per parameter tensor, reweighted by w_i = ‖θ_i‖₀
  (App. F, "Gradient Reweighting"; ``weights="equal"`` is the ablation without it);
* R_TV — total variation; R_BN — the batch-norm statistics prior (when the threat model grants the
  statistics: ``observe(..., train=True, bn_stats=True)``);
* R_feature — features ẑ_i of the penultimate block recovered first by the tensor method
  (:mod:`.tensor_features`, the server's partly random head of App. F,
  :func:`leakbench.models.malicious.random_head`), matched by 1 − cos²(f(x_i), ẑ_π(i)) (sign-free,
  ``feature_form="cosine"``, Sec. 4.2), or, for large batches, by ‖P⊥_span(ẑ) f(x_i)/‖f(x_i)‖‖²
  ("projection form", used for B ≥ 16 with ``feature_form="auto"``).  The slot-to-feature
  assignment π is re-solved at every step; App. F matches greedily by cosine, we solve the same
  assignment exactly (Hungarian method on the term's own score).  Departure (``"signed"``, what ``"auto"`` picks
  below B = 16 when the tensor step identified the signs from the first Hermite moment, ReLU
  blocks): 1 − cos(f(x_i), ẑ_π(i)).  The squared cosine exists only because the sign is unknown
  (App. F); once it is known, the signed cosine also excludes the mirrored feature μ − c·ẑ, which
  matters when the server centres the block's input (``random_head(center=...)``).
* ``block_weight`` — the random block's W₂ and A₂ have ‖θ‖₀ = width·(d + K) entries; with the
  paper's ℓ0 weights (``"l0"``, the default) they carry ~97 % of L_grad on a small CNN with a
  40 000-neuron head (in App. F's ResNet-18, under half).  ``"mean"`` gives them the mean weight of
  the other tensors, ``"exclude"`` leaves them to the tensor step (departures, measured: no
  consistent effect at 16 px).
* Adam, learning rate decayed ×0.1 at 3/8, 5/8 and 7/8 of the run; App. F: α_TV = 0.01,
  α_BN = 0.001, α_f = 0.1, 10 000 iterations at lr 1e-5 on a trained ResNet-18.  Our default
  budget (``default``: 2 000 iterations, lr 1e-2 for the generator) suits small nets on a CPU.

Clipping (Sec. 5.1 "GradClipping", Tables 7 vs 8).  L_grad is a sum of per-tensor cosines (App. F, the
reweighted sum over parameters θ_i), and the tensor step uses ∇A₂ only up to scale, so clipping the
whole gradient (``clip:C``, Sec. 3.2 / App. E.2) or each tensor (``clip:C,layer``) — both multiply
every tensor by a positive factor — changes neither, with or without R_feature.  What the attack can
feel is per-sample clipping (``dpsgd:C,0``; breaching's ``per_example_clipping``, on which the
paper's pipeline builds): the target becomes Σ_i c_i ∇ℓ(x_i), c_i = min(1, C/‖∇ℓ(x_i)‖), which
gradient matching (simulating Σ_i ∇ℓ(x̂_i)) cannot reproduce, while the tensor step still sees the
directions ẑ_i (weights r_i → c_i r_i).

``generator=False`` optimises the pixels directly (Inverting Gradients' signed Adam and box; ``step_unit``,
``init_std`` and ``schedule`` as in :mod:`.inverting`).  ``distance="cosine"`` (a departure) replaces the
per-tensor L_grad by IG's single cosine over all tensors: with ``feature=0``, pixels and IG's step this *is*
Inverting Gradients (tested), the baseline for ablating the feature term alone.
The feature term needs the random block; with ``feature=0`` the attack runs on any model.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ...errors import expect
from ...models.generator import UNetGenerator
from ...threat import Observation
from ..base import Attack, Reconstruction, register
from ..labels import recover_labels
from ..solvers.batched_matching import solve_observations
from ..solvers.matching_settings import SCHEDULES, STEP_UNITS, MatchingSettings, step_schedule
from ..solvers.gradient_matching import GradientMatcher
from ..solvers.objectives import layer_weights
from ..solvers.feature_blocks import block_requirements, find_block
from ..observed import shared_gradient
from ..solvers.tensor_moments import tensor_features

FEATURE_FORMS = ("auto", "cosine", "signed", "projection")
BLOCK_WEIGHTS = ("l0", "mean", "exclude")


def tensor_weights(obs: Observation, kind: str, block_kind: str) -> list[float] | str:
    """Per-tensor weights of L_grad: ``kind`` ("l0": w_i = ‖θ_i‖₀, App. F; "equal") for every tensor,
    except the random block's (W₂, A₂ of :class:`~leakbench.models.malicious.RandomFeatureHead`) with
    ``block_kind`` "mean" (the mean weight of the other tensors) or "exclude" (0)."""
    block = find_block(obs.model)
    if block_kind == "l0" or block is None:
        return kind
    params = obs.params()
    tensors = [params[n] for n in obs.param_names]
    base = layer_weights(kind, tensors)
    named = dict(obs.model.named_parameters())
    ids = {id(block.first), id(block.second)}
    inside = [id(named[n]) in ids if n in named else False for n in obs.param_names]
    others = [w for w, b in zip(base, inside) if not b]
    expect(any(w > 0 for w in others),
           f"block_weight={block_kind!r} needs parameters outside the random block with non-zero weight; this model "
           "has none (use block_weight='l0')")
    fill = 0.0 if block_kind == "exclude" else sum(others) / len(others)
    return [fill if b else w for w, b in zip(base, inside)]


@dataclass
class Liu2024Options:
    """Options of ``liu2024``."""

    iterations: int = 2000
    lr: float = 1e-2              # Adam on the generator (measured: 1e-3 is too slow at CPU budgets; pixels: 0.1)
    tv: float = 0.01
    bn: float = 0.001
    feature: float = 0.1
    feature_form: str = "auto"
    projection_from: int = 16     # "auto": projection form from this batch size on
    distance: str = "cosine-layer"  # L_grad: per-tensor cosines (App. F); "cosine" one global cosine (IG's)
    weights: str = "l0"           # per-tensor cosine weights: "l0" (App. F) or "equal"
    block_weight: str = "l0"      # weight of the random block's tensors in L_grad: "l0", "mean", "exclude"
    generator: bool = True
    schedule: str = "multistep"   # lr decay ×0.1 at 3/8, 5/8, 7/8 (App. F); "cosine", "none"
    step_unit: str = "data"       # pixels only (generator=False): "normalised" scales lr by a quarter of the box
    init_std: float = 1.0         # pixels only: start at grey + init_std·N(0, 1) in normalised units
    width: int = 32
    depth: int = 3
    noise_channels: int = 16
    restarts: int = 1
    tensor_trials: int = 16
    tensor_refine: int = 100
    trace_every: int = 50

    def check(self) -> None:
        expect(self.iterations >= 1 and self.restarts >= 1, "expected iterations ≥ 1 and restarts ≥ 1")
        expect(self.lr > 0, f"expected lr > 0, got {self.lr} (option lr)")
        for name in ("tv", "bn", "feature"):
            expect(getattr(self, name) >= 0, f"expected {name} ≥ 0, got {getattr(self, name)} (option {name})")
        expect(self.feature_form in FEATURE_FORMS,
               f"expected feature_form in {FEATURE_FORMS}, got {self.feature_form!r} (option feature_form)")
        expect(self.distance in ("cosine-layer", "cosine"),
               f"expected distance 'cosine-layer' or 'cosine', got {self.distance!r} (option distance)")
        expect(self.weights in ("l0", "equal"), f"expected weights 'l0' or 'equal', got {self.weights!r} (option weights)")
        expect(self.block_weight in BLOCK_WEIGHTS,
               f"expected block_weight in {BLOCK_WEIGHTS}, got {self.block_weight!r} (option block_weight)")
        expect(self.schedule in SCHEDULES, f"expected schedule in {SCHEDULES}, got {self.schedule!r} (option schedule)")
        expect(self.step_unit in STEP_UNITS,
               f"expected step_unit in {STEP_UNITS}, got {self.step_unit!r} (option step_unit)")
        expect(self.init_std > 0, f"expected init_std > 0, got {self.init_std} (option init_std)")
        expect(self.width >= 1 and self.depth >= 1 and self.noise_channels >= 1,
               "expected width, depth, noise_channels ≥ 1")


def feature_loss(feats: torch.Tensor, recovered: torch.Tensor, *, form: str) -> torch.Tensor:
    """R_feature for current features (B×d, one per slot) against recovered unit features (B×d)."""
    from scipy.optimize import linear_sum_assignment  # lazy: `import leakbench` skips scipy
    unit = feats / feats.norm(dim=1, keepdim=True).clamp_min(1e-12)
    if form == "projection":
        basis, _ = torch.linalg.qr(recovered.T)                     # d×B orthonormal
        resid = unit - (unit @ basis) @ basis.T
        return resid.pow(2).sum(1).mean()
    cos = unit @ recovered.T                                         # slots × features
    score = cos if form == "signed" else cos.pow(2)
    rows, cols = linear_sum_assignment(-score.detach().cpu().numpy())
    return (1 - score[torch.as_tensor(rows), torch.as_tensor(cols)]).mean()


class Liu2024Matcher(GradientMatcher):
    """Gradient matching with the feature term; optionally through a deep-image-prior generator."""

    def __init__(self, obs: Observation, settings: MatchingSettings, *, features: torch.Tensor | None,
                 feature_weight: float, form: str) -> None:
        super().__init__(obs, settings)
        self.features = None if features is None else features.detach().to(obs.device, obs.dtype)
        self.feature_weight, self.form = feature_weight, form
        self._seen: list[torch.Tensor] = []
        if self.features is not None and feature_weight > 0:
            self.extra_terms = ("the tensor-feature term re-solves its slot assignment (Hungarian, scipy) at every "
                                "step: this problem runs alone")
            block = find_block(self.model)
            block.feature_module.register_forward_pre_hook(lambda _m, inputs: self._seen.append(inputs[0]))

    def objective(self, x: torch.Tensor, target: torch.Tensor, *,
                  match: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._seen.clear()
        total, value = super().objective(x, target, match=match)
        if self._seen:
            feats = self._seen[0].reshape(x.shape[0], -1)  # the client's first forward pass
            total = total + self.feature_weight * feature_loss(feats, self.features, form=self.form)
        return total, value

    def run_generator(self, labels: torch.Tensor, generator_options: dict, *, seed: int, callback=None,
                      progress=None) -> tuple[torch.Tensor, dict]:
        """Optimise the generator's parameters (Adam, multistep decay); keep the restart that matches best."""
        s, obs = self.s, self.obs
        lo, hi = obs.data_range
        best: tuple[float, torch.Tensor | None] = (math.inf, None)
        finals, curves = [], []
        start = time.perf_counter()
        for r in range(s.restarts):
            gen = UNetGenerator(obs.input_shape, seed=seed * 1000 + r, **generator_options).to(obs.device, obs.dtype)
            noise = gen.noise(obs.batch_size, seed=seed * 1000 + r, device=obs.device, dtype=obs.dtype)
            params = list(gen.parameters())
            opt = torch.optim.Adam(params, lr=s.lr)
            sched = step_schedule(opt, s.schedule, s.iterations)
            curve = []
            for step in range(s.iterations):
                x = lo + (hi - lo) * gen(noise)
                total, match = self.objective(x, labels)
                grads = torch.autograd.grad(total, params)
                for p, g in zip(params, grads):
                    p.grad = g
                opt.step()
                sched.step()
                if step % s.trace_every == 0 or step == s.iterations - 1:
                    curve.append(float(match.detach()))
                    if callback is not None:
                        callback(r * s.iterations + step, x.detach())
                    if progress is not None:
                        progress(r * s.iterations + step + 1, s.iterations * s.restarts, curve[-1])
            with torch.no_grad():
                x = lo + (hi - lo) * gen(noise)
            with torch.enable_grad():
                _, match = self.objective(x, labels)
            finals.append(float(match.detach()))
            curves.append(curve)
            if r == 0 or finals[-1] < best[0]:
                best = (finals[-1], x.detach().clone())
        chosen = finals.index(best[0])
        trace = {"loss": curves[chosen], "restart_losses": finals, "iterations": s.iterations,
                 "restarts": s.restarts, "trace_every": s.trace_every, "final_match": best[0],
                 "seconds": time.perf_counter() - start}
        return best[1], trace


@register
class Liu2024(Attack):
    """Liu et al. 2024: IG + BN prior + TV + tensor-feature matching, images from an untrained U-Net (deep image prior)."""

    name = "liu2024"
    tags = ("gradient", "update", "labels", "bn-stats", "modified-model")
    matching = True
    Options = Liu2024Options
    presets = {
        "paper": {"iterations": 10000, "lr": 1e-5},
        "quick": {"iterations": 300, "width": 16, "depth": 2, "tensor_trials": 8, "tensor_refine": 50},
    }

    def requirements(self, obs: Observation) -> list[str]:
        if obs.kind == "weights":
            return ["liu2024 needs a shared gradient or update, not trained weights"]
        reasons = []
        if self.options.feature > 0:
            missing = block_requirements(obs, self.name)
            reasons.extend(f"{r} (or set feature=0 to run without the feature term)" for r in missing)
        if self.options.generator and len(obs.input_shape) != 3:
            reasons.append("the deep image prior generates images C×H×W; set generator=False for vector data")
        if self.options.tv > 0 and len(obs.input_shape) != 3:
            reasons.append("the TV prior needs image inputs C×H×W; set tv=0 for vector data")
        return reasons

    def _prepare(self, obs: Observation, seed: int) -> tuple[Liu2024Matcher, torch.Tensor, dict]:
        """The matcher of one observation, its labels and the trace entries of its set-up (tensor features)."""
        o = self.options
        labels = recover_labels(obs, seed=seed)
        trace: dict = {}
        features = None
        if o.feature > 0:
            block = find_block(obs.model)
            result = tensor_features(block.first, shared_gradient(obs, block.second), block.act, obs.batch_size,
                                     seed=seed, trials=o.tensor_trials, refine=o.tensor_refine)
            features = result.features
            trace.update(features=features, feature_orders=result.orders,
                         decomposition_residual=result.residual, feature_signs="first moment" if result.signed
                         else "positive sum")
        form = o.feature_form
        if form == "auto":
            # the paper's squared cosine is sign-free; when the tensor step identified the signs (first
            # Hermite moment, ReLU blocks) the signed cosine also rules out the mirrored feature μ − c·ẑ
            # that centred features (random_head(center=...)) would otherwise allow
            signed = features is not None and result.signed
            form = "projection" if obs.batch_size >= o.projection_from else ("signed" if signed else "cosine")
        bn = o.bn if obs.bn_stats is not None else 0.0
        if o.bn > 0 and obs.bn_stats is None:
            trace["bn_prior"] = "off: the observation grants no batch-norm statistics"
        settings = MatchingSettings(iterations=o.iterations, distance=o.distance,
                                    weights=tensor_weights(obs, o.weights, o.block_weight), tv=o.tv,
                                    bn=bn, optimizer="adam", lr=o.lr, signed=not o.generator, schedule=o.schedule,
                                    step_unit=o.step_unit, init_std=o.init_std, restarts=o.restarts,
                                    init="gaussian", box=True, trace_every=o.trace_every)
        matcher = Liu2024Matcher(obs, settings, features=features, feature_weight=o.feature, form=form)
        trace["feature_form"] = form if features is not None else None
        return matcher, labels, trace

    def run(self, obs, *, seed=0, callback=None, progress=None) -> Reconstruction:
        o = self.options
        matcher, labels, trace = self._prepare(obs, seed)
        if o.generator:
            images, run_trace = matcher.run_generator(
                labels, {"width": o.width, "depth": o.depth, "noise_channels": o.noise_channels},
                seed=seed, callback=callback, progress=progress)
        else:
            result = matcher.run(labels, seed=seed, callback=callback, progress=progress)
            images, run_trace = result.images, result.trace
        form = trace.pop("feature_form")
        trace.update(run_trace, feature_form=form)
        return Reconstruction(images=images, labels=labels, trace=trace)

    def run_batch(self, observations, seeds, *, progress=None) -> list[Reconstruction | Exception]:
        """On pixels (``generator=False``), independent problems in one stacked optimisation
        (:mod:`..batched_matching`; the tensor-feature term's per-step assignment keeps a problem alone);
        the deep image prior's generators one after the other."""
        if self.options.generator:
            return super().run_batch(observations, seeds, progress=progress)
        setups: dict[int, dict] = {}  # id(observation) → its set-up trace

        def prepare(obs, seed):
            matcher, labels, trace = self._prepare(obs, seed)
            setups[id(obs)] = trace
            return matcher, labels

        out: list[Reconstruction | Exception] = []
        for obs, r in zip(observations, solve_observations(observations, seeds, prepare, progress=progress)):
            if isinstance(r, Exception):
                out.append(r)
                continue
            trace = setups[id(obs)]
            form = trace.pop("feature_form")
            trace.update(r.trace, feature_form=form)
            out.append(Reconstruction(images=r.images, labels=r.labels, trace=trace))
        return out
