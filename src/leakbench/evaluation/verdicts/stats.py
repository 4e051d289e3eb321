"""Intervals and decisions for the evaluation: every number with its n and spread, every comparison decided or tied.

The unit of replication of an attack score is the *batch* (one trial: one seeded draw of B images): the images
of a batch are attacked together, so they are not independent.  A cell's mean score gets a **percentile bootstrap
over batches** (a cluster bootstrap for B > 1, the plain bootstrap over images at B = 1; Efron & Tibshirani 1993,
ch. 13), and two cells attacked on the same batches are compared by the bootstrap interval of their **paired
differences** (batch by batch).  Utility, with a handful of training seeds, gets a **Student-t** interval (paired by
seed against the undefended run): a bootstrap over three values cannot cover.  Counts (KKT matches, members
found) get exact **Clopper–Pearson** binomial intervals (scipy's ``binomtest``).

A comparison is *decided* when its interval excludes zero; otherwise it is a *tie* at this n — never broken by a
name.  Fewer than :data:`MIN_N` units decide nothing.  Every resampling takes a seed, so a report is a pure
function of its store.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

#: confidence level of every interval in the report.
CONFIDENCE = 0.95
#: bootstrap resamples (percentile intervals; seeded).
RESAMPLES = 4000
#: the fewest units (batches, seeds) a decision may rest on.
MIN_N = 3
#: the seed of every resampling in the report.
SEED = 0


@dataclass(frozen=True)
class Interval:
    """A mean with its two-sided interval at :data:`CONFIDENCE` and the number of units it rests on.

    ``low``/``high`` are NaN when n < 2 (no spread can be estimated).
    """

    mean: float
    low: float
    high: float
    n: int
    method: str = "bootstrap"

    @property
    def known(self) -> bool:
        """True when the interval exists (n ≥ 2 and finite bounds)."""
        return self.n >= 2 and math.isfinite(self.low) and math.isfinite(self.high)

    def above(self, value: float = 0.0) -> bool:
        """The whole interval lies above ``value`` (decided: the mean is significantly larger)."""
        return self.known and self.n >= MIN_N and self.low > value

    def below(self, value: float = 0.0) -> bool:
        """The whole interval lies below ``value``."""
        return self.known and self.n >= MIN_N and self.high < value

    def excludes(self, value: float = 0.0) -> bool:
        return self.above(value) or self.below(value)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2 if self.known else math.nan

    def text(self, digits: int = 3) -> str:
        """``0.123 ± 0.010 (n = 12)``; ``0.123 (n = 1)`` without an interval."""
        if not math.isfinite(self.mean):
            return "–"
        body = f"{self.mean:.{digits}f}"
        if self.known:
            body += f" ± {self.half_width:.{digits}f}"
        return f"{body} (n = {self.n})"


EMPTY = Interval(math.nan, math.nan, math.nan, 0)


def _finite(values: Iterable[float]) -> np.ndarray:
    v = np.asarray([float(x) for x in values], dtype=np.float64)
    return v[np.isfinite(v)]


def _start(values: Iterable[float], method: str) -> tuple[np.ndarray, Interval | None]:
    """The finite values, and the interval to return at once when fewer than two give no spread."""
    v = _finite(values)
    if v.size == 0:
        return v, EMPTY
    if v.size < 2:
        return v, Interval(float(v.mean()), math.nan, math.nan, 1, method)
    return v, None


def bootstrap_mean(values: Iterable[float], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                   seed: int = SEED) -> Interval:
    """The mean of the finite ``values`` and its percentile-bootstrap interval (units resampled with replacement).

    Constant values give a zero-width interval at the value (an exact tie stays exact).
    """
    v, early = _start(values, "bootstrap")
    if early is not None:
        return early
    n, mean = v.size, float(v.mean())
    if float(v.max() - v.min()) == 0.0:
        return Interval(mean, mean, mean, n)
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Interval(mean, float(low), float(high), n)


def t_mean(values: Iterable[float], *, confidence: float = CONFIDENCE) -> Interval:
    """The mean of the finite ``values`` and its Student-t interval (for a few seeds)."""
    v, early = _start(values, "t")
    if early is not None:
        return early
    n, mean = v.size, float(v.mean())
    sd = float(v.std(ddof=1))
    from scipy import stats as _sp

    half = float(_sp.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "t")


def paired(a: Mapping[object, float], b: Mapping[object, float]) -> dict[object, float]:
    """a[k] − b[k] for the units both hold with finite values (the pairing of a paired comparison)."""
    out = {}
    for k, va in a.items():
        vb = b.get(k)
        if vb is not None and math.isfinite(va) and math.isfinite(vb):
            out[k] = float(va) - float(vb)
    return out


def paired_bootstrap(a: Mapping[object, float], b: Mapping[object, float], **options) -> Interval:
    """The mean of a − b over the shared units and its bootstrap interval."""
    d = paired(a, b)
    return bootstrap_mean([d[k] for k in sorted(d, key=repr)], **options)


def paired_t(a: Mapping[object, float], b: Mapping[object, float], **options) -> Interval:
    """The mean of a − b over the shared units (seeds) and its Student-t interval."""
    d = paired(a, b)
    return t_mean([d[k] for k in sorted(d, key=repr)], **options)


def binomial(k: int, n: int, *, confidence: float = CONFIDENCE) -> Interval:
    """k of n as a proportion with its exact (Clopper–Pearson) interval."""
    if n <= 0:
        return Interval(math.nan, math.nan, math.nan, 0, "clopper-pearson")
    k = max(0, min(int(k), int(n)))
    from scipy import stats as _sp

    ci = _sp.binomtest(k, int(n)).proportion_ci(confidence_level=confidence, method="exact")
    return Interval(k / n, float(ci.low), float(ci.high), int(n), "clopper-pearson")


def auc_interval(scores: Sequence[float], is_member: Sequence[bool], *, confidence: float = CONFIDENCE,
                 resamples: int = 2000, seed: int = SEED) -> Interval:
    """ROC AUC (Mann–Whitney) with a stratified bootstrap interval (members and non-members resampled apart).

    ``n`` is the number of points.  Raises ``ValueError`` when a class is missing or a score is not finite.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    m = np.asarray(is_member).astype(bool).ravel()
    if s.shape != m.shape or not np.isfinite(s).all():
        raise ValueError(f"expected finite scores, one per is_member flag; got {s.shape} and {m.shape}")
    pos, neg = s[m], s[~m]
    if pos.size == 0 or neg.size == 0:
        raise ValueError("expected members and non-members both present")

    def auc(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        # batched Mann–Whitney U / (|p||q|) over the leading axis, ties counted one half
        from scipy import stats as _sp

        ranks = _sp.rankdata(np.concatenate([p, q], axis=-1), axis=-1)
        u = ranks[..., : p.shape[-1]].sum(-1) - p.shape[-1] * (p.shape[-1] + 1) / 2
        return u / (p.shape[-1] * q.shape[-1])

    point = float(auc(pos, neg))
    rng = np.random.default_rng(seed)
    bp = pos[rng.integers(0, pos.size, size=(resamples, pos.size))]
    bq = neg[rng.integers(0, neg.size, size=(resamples, neg.size))]
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(auc(bp, bq), [alpha, 1 - alpha])
    return Interval(point, float(low), float(high), int(s.size), "stratified bootstrap")


def measurable_fpr(fpr: float, nonmembers: int) -> bool:
    """TPR at ``fpr`` is measurable only with at least 10 / fpr non-members (ten false positives allowed)."""
    return nonmembers >= math.ceil(10.0 / fpr - 1e-9)


__all__ = ["Interval", "EMPTY", "CONFIDENCE", "RESAMPLES", "MIN_N", "SEED", "bootstrap_mean", "t_mean", "paired",
           "paired_bootstrap", "paired_t", "binomial", "auc_interval", "measurable_fpr"]
