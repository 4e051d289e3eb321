"""Membership inference with reference models: LiRA (Carlini et al. 2022), RMIA (Zarifzadeh et al. 2024), loss.

All three score a queried point (x, y) from one statistic of the target's output, the *logit-scaled confidence*

    φ = log(p_y / (1 − p_y))                                   (Carlini et al. 2022, Sec. IV-C, eq. 4)

computed stably from the logits z as φ = z_y − logsumexp_{j≠y} z_j (a one-output binary net: φ = ±f(x)).
Everything else follows from φ: p_y = sigmoid(φ) and the cross-entropy loss is softplus(−φ).

- **Loss threshold** (Yeom et al. 2018, "Privacy risk in machine learning", Sec. 3.2 / Algorithm 1 adversary):
  score = −loss(x, y) = −softplus(−φ); no reference model.
- **LiRA** (Carlini et al. 2022, "Membership inference attacks from first principles", Sec. IV, Algorithm 1).
  From K reference models trained on random halves of a population pool, fit per example a Gaussian to φ over
  the models that trained on it (IN: μ_in, σ_in) and over those that did not (OUT: μ_out, σ_out).
  *Online*: the log of the likelihood ratio  Λ = N(φ; μ_in, σ_in²) / N(φ; μ_out, σ_out²)  (Sec. IV-B, eq. 3 with
  the Gaussian model).  *Offline* (OUT models only, Sec. IV-C "offline"): the one-sided test
  Λ = 1 − Pr[Z > φ], Z ~ N(μ_out, σ_out²); we return −log Pr[Z > φ] (``scipy.stats.norm.logsf``), a monotone
  function of Λ (Λ = 1 − e^(−score)) that does not saturate at Λ = 1 for φ many σ above μ_out — where the
  low-FPR operating points are (Λ rounds to 1.0 in float64 beyond about 8 σ, log Λ beyond about 37 σ).  *Global variance*
  (Sec. VI-A: with few reference models, below 64 in the paper, one σ_in and one σ_out shared by all examples
  beat per-example estimates): the pooled standard deviation of φ − μ over every (model, example) pair.
- **RMIA** (Zarifzadeh et al. 2024, "Low-cost high-power membership inference attacks", ICML, Sec. 3).
  Pr(x|θ) = p_y (the target's probability of the true label); Pr(x) = the mean of Pr(x|θ') over reference
  models θ' (Sec. 3, eq. 5 — all K models online; offline, with OUT models only, the paper's linear
  approximation Pr(x) = ½((1 + a)·Pr_OUT(x) + (1 − a)), App. B.2, a tuned on a reference model in the paper,
  default 0.3 here).  The pairwise likelihood ratio against a population point z,
  LR_θ(x, z) = (Pr(x|θ)/Pr(x)) / (Pr(z|θ)/Pr(z))  (eq. 3), gives the score
  Score_MIA(x; θ) = Pr_z[LR_θ(x, z) ≥ γ]  (eq. 4), γ = 1 by default: the fraction of population points that x
  dominates.  Pr(z) is computed like Pr(x), from each z's own IN/OUT masks.

The equation numbers follow the arXiv versions (2112.03570 and 2312.03262); the papers are not in
``papers/``, so the numbering was checked against the text as recalled, not a local copy.

These are not reconstructions (no :class:`~leakbench.attacks.base.Attack`): each class takes the
observation of the target (:func:`~leakbench.threat.observe_weights`), the queried points and
:class:`ReferenceOutputs` (φ of every reference model on the points, and which models trained on which
point) and returns a :class:`~.membership.MembershipResult`.  Training the reference models with the target's
recipe is :mod:`leakbench.evaluation.membership.reference` (attacks never train).  The pure cores :func:`lira_scores`,
:func:`rmia_scores` and :func:`loss_scores` take φ arrays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import ConfigError, UnsupportedThreatModel, expect
from ...threat import Observation
from .base import MEMBERSHIP_ATTACKS, MembershipResult

__all__ = ["ReferenceOutputs", "logit_confidence", "loss_scores", "lira_scores", "rmia_scores", "rmia_marginal",
           "LossMembership", "LiRAMembership", "RMIAMembership", "target_confidence", "MIN_STD"]

#: the smallest standard deviation a Gaussian fit may take (φ of a memorised point can be constant).
MIN_STD = 1e-3


def logit_confidence(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """φ = log(p_y / (1 − p_y)) per row of ``logits`` (N×C), stably: z_y − logsumexp_{j≠y} z_j.

    A one-output binary network (N×1) gives φ = f(x) for label 1 and −f(x) for label 0 (or ±1 labels).
    Computed in float64."""
    expect(isinstance(logits, torch.Tensor) and logits.dim() == 2,
           f"expected logits N×C, got {tuple(getattr(logits, 'shape', ()))} (argument logits)")
    z = logits.detach().double()
    y = torch.as_tensor(labels).to(z.device).reshape(-1)
    expect(y.numel() == z.shape[0], f"expected one label per row, got {y.numel()} labels for {z.shape[0]} rows")
    if z.shape[1] == 1:
        sign = torch.where(y.double() > 0, 1.0, -1.0).to(z.dtype)
        return sign * z[:, 0]
    y = y.long()
    expect(bool(((y >= 0) & (y < z.shape[1])).all()), f"expected labels in [0, {z.shape[1]}) (argument labels)")
    zy = z.gather(1, y[:, None])[:, 0]
    others = z.scatter(1, y[:, None], -math.inf)
    return zy - torch.logsumexp(others, dim=1)


def target_confidence(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, *, chunk: int = 2048) -> torch.Tensor:
    """φ of ``model`` (in evaluation mode, no gradient) on the points ``x`` with ``labels``; float64, on the CPU."""
    ref = next(iter(model.parameters()), None)
    was = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, int(x.shape[0]), chunk):
            xb = x[i:i + chunk]
            if ref is not None:
                xb = xb.to(ref.device, ref.dtype)
            out.append(logit_confidence(model(xb).reshape(xb.shape[0], -1), labels[i:i + chunk]).cpu())
    model.train(was)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


@dataclass
class ReferenceOutputs:
    """φ of K reference models on N points (``phi``, K×N) and which model trained on which point (``in_mask``)."""

    phi: torch.Tensor
    in_mask: torch.Tensor

    def __post_init__(self) -> None:
        self.phi = torch.as_tensor(self.phi, dtype=torch.float64).cpu()
        self.in_mask = torch.as_tensor(self.in_mask).bool().cpu()
        expect(self.phi.dim() == 2 and self.phi.shape == self.in_mask.shape,
               f"expected phi and in_mask both K×N, got {tuple(self.phi.shape)} and {tuple(self.in_mask.shape)}")
        expect(bool(torch.isfinite(self.phi).all()), "expected finite reference confidences (field phi)")

    @property
    def models(self) -> int:
        return int(self.phi.shape[0])

    def subset(self, models: int) -> ReferenceOutputs:
        """The first ``models`` reference models (a smaller budget of the same run)."""
        return ReferenceOutputs(self.phi[:models], self.in_mask[:models])


def _np(v: object) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().numpy()
    return np.asarray(v, dtype=np.float64)


def loss_scores(target_phi: object) -> np.ndarray:
    """Yeom et al.'s score: −cross-entropy = −softplus(−φ) (higher = more likely a member)."""
    phi = _np(target_phi)
    return -np.logaddexp(0.0, -phi)


def _fit(phi: np.ndarray, mask: np.ndarray, global_variance: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-example mean and std of φ over the models in ``mask`` (K×N); the count per example.

    Maximum-likelihood fits (ddof 0, as ``scipy.stats.norm.fit`` and Carlini et al.'s ``np.std``) around the mean
    (their code takes the median); the global std pools every model's deviation from its example's mean.  A
    per-example std needs two models (NaN otherwise)."""
    count = mask.sum(0)
    mean = np.where(count > 0, (phi * mask).sum(0) / np.maximum(count, 1), np.nan)
    dev = np.where(mask, phi - np.nan_to_num(mean)[None, :], 0.0)
    if global_variance:
        std = np.full(phi.shape[1], math.sqrt(float((dev ** 2).sum()) / max(int(count.sum()), 1)))
    else:
        std = np.sqrt((dev ** 2).sum(0) / np.maximum(count, 1))
        std = np.where(count > 1, std, np.nan)
    return mean, np.maximum(std, MIN_STD), count


def lira_scores(target_phi: object, reference_phi: object, in_mask: object, *, online: bool = True,
                global_variance: bool = False) -> np.ndarray:
    """LiRA's per-example score (log Λ): online log N(φ; μ_in, σ_in²) − log N(φ; μ_out, σ_out²), offline
    −log Pr[N(μ_out, σ_out²) > φ].  ``reference_phi`` and ``in_mask`` are K×N (fits: :func:`_fit`).

    An example with no OUT model (or, online, no IN model) gets NaN: it cannot be scored."""
    from scipy import stats as _sp  # here, not at import: it costs every CLI and worker start ~0.5 s
    phi = _np(target_phi).reshape(-1)
    ref = _np(reference_phi)
    mask = np.asarray(in_mask.detach().cpu().numpy() if isinstance(in_mask, torch.Tensor) else in_mask).astype(bool)
    if ref.ndim != 2 or ref.shape != mask.shape or ref.shape[1] != phi.size:
        raise ConfigError(f"expected reference φ and in_mask K×{phi.size}, got {ref.shape} and {mask.shape}")
    mu_out, sd_out, n_out = _fit(ref, ~mask, global_variance)
    if not online:
        out = -_sp.norm.logsf(phi, loc=mu_out, scale=sd_out)
        return np.where(n_out > 0, out, np.nan)
    mu_in, sd_in, n_in = _fit(ref, mask, global_variance)
    out = _sp.norm.logpdf(phi, loc=mu_in, scale=sd_in) - _sp.norm.logpdf(phi, loc=mu_out, scale=sd_out)
    return np.where((n_out > 0) & (n_in > 0), out, np.nan)


def rmia_marginal(reference_phi: object, in_mask: object, *, online: bool = True, a: float = 0.3) -> np.ndarray:
    """Pr(x) per example: the mean of p_y = sigmoid(φ) over all reference models (online, eq. 5), or offline
    ½((1 + a)·mean over OUT models + (1 − a)) (App. B.2).  NaN where no model qualifies."""
    from scipy import special as _special
    ref = _np(reference_phi)
    mask = np.asarray(in_mask.detach().cpu().numpy() if isinstance(in_mask, torch.Tensor) else in_mask).astype(bool)
    p = _special.expit(ref)
    if online:
        return p.mean(0)
    out = ~mask
    n = out.sum(0)
    mean_out = np.where(n > 0, (p * out).sum(0) / np.maximum(n, 1), np.nan)
    return 0.5 * ((1 + a) * mean_out + (1 - a))


def rmia_scores(target_phi: object, reference_phi: object, in_mask: object, population_target_phi: object,
                population_reference_phi: object, population_in_mask: object, *, online: bool = True,
                a: float = 0.3, gamma: float = 1.0) -> np.ndarray:
    """RMIA's Score_MIA(x) = fraction of population points z with LR(x, z) ≥ γ (eqs. 3–4).

    Ratios are taken in log space: log LR = (log p_y(x) − log Pr(x)) − (log p_y(z) − log Pr(z))."""
    if not (isinstance(gamma, (int, float)) and gamma > 0):
        raise ConfigError(f"expected gamma > 0, got {gamma!r} (option gamma)")
    if not (isinstance(a, (int, float)) and 0 <= a <= 1):
        raise ConfigError(f"expected a in [0, 1], got {a!r} (option a)")
    phi_x = _np(target_phi).reshape(-1)
    phi_z = _np(population_target_phi).reshape(-1)
    px = rmia_marginal(reference_phi, in_mask, online=online, a=a)
    pz = rmia_marginal(population_reference_phi, population_in_mask, online=online, a=a)
    if px.size != phi_x.size or pz.size != phi_z.size:
        raise ConfigError(f"expected reference φ for {phi_x.size} points and {phi_z.size} population points, "
                          f"got {px.size} and {pz.size}")
    ratio_x = -np.logaddexp(0.0, -phi_x) - np.log(px)      # log(Pr(x|θ) / Pr(x)), log sigmoid(φ) = −softplus(−φ)
    ratio_z = -np.logaddexp(0.0, -phi_z) - np.log(pz)
    ratio_z = np.sort(ratio_z[np.isfinite(ratio_z)])
    if ratio_z.size == 0:
        raise ConfigError("expected population points with reference models to score against (RMIA's z)")
    # LR(x, z) ≥ γ  ⇔  ratio_z ≤ ratio_x − log γ ; counted by a sorted search (N log Z, not N×Z)
    counts = np.searchsorted(ratio_z, ratio_x - math.log(gamma), side="right")
    return np.where(np.isfinite(ratio_x), counts / ratio_z.size, np.nan)


# --------------------------------------------------------------------------- registered attacks


def _refuse(obs: Observation, name: str) -> None:
    """Raise :class:`UnsupportedThreatModel` with every reason attack ``name`` cannot run on ``obs``."""
    reasons = _check_obs(obs, name)
    if reasons:
        raise UnsupportedThreatModel(f"attack {name!r} cannot run on this observation: " + "; ".join(reasons))


def _check_obs(obs: object, name: str) -> list[str]:
    if not isinstance(obs, Observation):
        return [f"expected an Observation from observe_weights, got {type(obs).__name__}"]
    if obs.kind != "weights":
        return [f"{name} queries the trained model; got a {obs.kind!r} observation "
                "(use leakbench.threat.observe_weights on the trained network)"]
    return []


def _phi(obs: Observation, x: torch.Tensor, labels: torch.Tensor | None, field: str) -> torch.Tensor:
    expect(labels is not None, f"expected labels for the queried points (argument {field}_labels or labels): "
           "these attacks score the true label's confidence")
    expect(isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[1:]) == tuple(obs.input_shape),
           f"expected points of shape N×{'×'.join(map(str, obs.input_shape))}, got "
           f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__} (argument {field})")
    return target_confidence(obs.model, x, torch.as_tensor(labels))


def _result(scores: np.ndarray, mode: str, threshold: float | None, **info) -> MembershipResult:
    s = torch.as_tensor(scores, dtype=torch.float64)
    thr = math.inf if threshold is None else float(threshold)
    return MembershipResult(scores=s, threshold=thr, members=s >= thr, margin=None, mode=mode, signed=True,
                            info={"unscored": int(torch.isnan(s).sum()), **info})


def _check_reference(reference: object, n: int, name: str) -> ReferenceOutputs:
    if not isinstance(reference, ReferenceOutputs):
        raise ConfigError(f"{name} needs reference=ReferenceOutputs(…) (leakbench.evaluation.membership.reference), got "
                          f"{type(reference).__name__} (argument reference)")
    if reference.phi.shape[1] != n:
        raise ConfigError(f"expected reference outputs on the {n} queried points, got {reference.phi.shape[1]} "
                          "(argument reference)")
    return reference


@MEMBERSHIP_ATTACKS.register("membership-loss", help="member iff the loss is low (Yeom et al. 2018): the floor "
                                                     "any audit should beat")
class LossMembership:
    """The loss-threshold attack (Yeom et al. 2018): score −loss(x, y); threshold optional (default: none)."""

    name = "membership-loss"

    def __init__(self, *, threshold: float | None = None) -> None:
        expect(threshold is None or isinstance(threshold, (int, float)),
               f"expected a number or None, got {threshold!r} (option threshold)")
        self.threshold = threshold

    def requirements(self, obs: Observation) -> list[str]:
        return _check_obs(obs, self.name)

    def __call__(self, obs: Observation, x: torch.Tensor, *, labels: torch.Tensor | None = None,
                 reference: ReferenceOutputs | None = None, **_: object) -> MembershipResult:
        _refuse(obs, self.name)
        thr = None if self.threshold is None else -float(self.threshold)
        return _result(loss_scores(_phi(obs, x, labels, "x")), "loss", thr)


@MEMBERSHIP_ATTACKS.register("membership-lira", help="LiRA (Carlini et al. 2022): Gaussian likelihood ratio of the "
                                                     "logit-scaled confidence over reference models (online/offline)")
class LiRAMembership:
    """LiRA online (IN and OUT fits) or offline (OUT only, one-sided); ``global_variance`` None: global below
    64 reference models (Carlini et al. Sec. VI-A)."""

    name = "membership-lira"

    def __init__(self, *, online: bool = True, global_variance: bool | None = None,
                 threshold: float | None = None) -> None:
        expect(isinstance(online, bool), f"expected online True or False, got {online!r} (option online)")
        expect(global_variance is None or isinstance(global_variance, bool),
               f"expected global_variance True, False or None (auto), got {global_variance!r}")
        self.online, self.global_variance, self.threshold = online, global_variance, threshold

    def requirements(self, obs: Observation) -> list[str]:
        return _check_obs(obs, self.name)

    def __call__(self, obs: Observation, x: torch.Tensor, *, labels: torch.Tensor | None = None,
                 reference: ReferenceOutputs | None = None, **_: object) -> MembershipResult:
        _refuse(obs, self.name)
        phi = _phi(obs, x, labels, "x")
        ref = _check_reference(reference, int(phi.numel()), self.name)
        pooled = self.global_variance if self.global_variance is not None else ref.models < 64
        scores = lira_scores(phi, ref.phi, ref.in_mask, online=self.online, global_variance=pooled)
        return _result(scores, "online" if self.online else "offline", self.threshold, global_variance=pooled,
                       reference_models=ref.models)


@MEMBERSHIP_ATTACKS.register("membership-rmia", help="RMIA (Zarifzadeh et al. 2024): pairwise likelihood ratio "
                                                     "against population points, works with 1-2 reference models")
class RMIAMembership:
    """RMIA: the fraction of population points z with LR(x, z) ≥ ``gamma``; offline with the linear
    approximation ``a`` for the missing IN models."""

    name = "membership-rmia"

    def __init__(self, *, online: bool = False, a: float = 0.3, gamma: float = 1.0,
                 threshold: float | None = None) -> None:
        expect(isinstance(online, bool), f"expected online True or False, got {online!r} (option online)")
        expect(isinstance(a, (int, float)) and 0 <= a <= 1, f"expected a in [0, 1], got {a!r} (option a)")
        expect(isinstance(gamma, (int, float)) and gamma > 0, f"expected gamma > 0, got {gamma!r} (option gamma)")
        self.online, self.a, self.gamma, self.threshold = online, float(a), float(gamma), threshold

    def requirements(self, obs: Observation) -> list[str]:
        return _check_obs(obs, self.name)

    def __call__(self, obs: Observation, x: torch.Tensor, *, labels: torch.Tensor | None = None,
                 reference: ReferenceOutputs | None = None, population: torch.Tensor | None = None,
                 population_labels: torch.Tensor | None = None,
                 population_reference: ReferenceOutputs | None = None, **_: object) -> MembershipResult:
        _refuse(obs, self.name)
        phi = _phi(obs, x, labels, "x")
        ref = _check_reference(reference, int(phi.numel()), self.name)
        expect(population is not None, f"{self.name} needs population=… (points z, with population_labels and "
               "population_reference)")
        phi_z = _phi(obs, population, population_labels, "population")
        ref_z = _check_reference(population_reference, int(phi_z.numel()), self.name)
        scores = rmia_scores(phi, ref.phi, ref.in_mask, phi_z, ref_z.phi, ref_z.in_mask, online=self.online,
                             a=self.a, gamma=self.gamma)
        return _result(scores, "online" if self.online else "offline", self.threshold, reference_models=ref.models,
                       population=int(phi_z.numel()))
