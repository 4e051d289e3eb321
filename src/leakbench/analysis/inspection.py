"""Is the model I was sent malicious?  The client's check of a received model, before it trains on it.

:func:`inspect` compares the model a client received with the one it held (``model_before``, e.g. the previous
round's global model; None in the first round) and, given the client's own batch, runs it the way the client is
about to.  Each check looks for the footprint a known server modification leaves, and a finding carries the
evidence (the layer, the count, what an honest model shows):

- ``architecture`` — parameters added, removed or reshaped since ``model_before`` (an imprint block, a trap block,
  a random head: every server *block* changes the architecture the client agreed to train);
- ``duplicated-rows`` — rows of a weight matrix parallel to another row (|cos| ≥ 1 − 10⁻⁶): the imprint block's
  K copies of one query (Fowl et al. 2022), the random head's output rows (Liu et al. 2024, App. F);
- ``constant-rows`` — rows whose entries are all equal and non-zero: the imprint block's back-projection, the
  random head's A₂[i, :] = i/v, class fishing's target row (Wen et al. 2022);
- ``zero-rows`` — some (not all) rows exactly zero: fishing switches off the classes (or features) it does not
  target;
- ``scaled-rows`` — a weight or bias of magnitude ≥ 100, or a row whose norm is ≥ 50× the median row norm of its
  matrix: fishing's magnified target row and its large biases (Wen et al. 2022, Sec. 3–4);
- ``sign-balance`` — most rows of a matrix with exactly ⌊d/2⌋ negative entries: Boenisch et al.'s trap rows (a
  random half negative, EuroS&P 2023, Sec. 4.2), where an honest draw puts Binomial(d, ½) negatives in a row;
- ``weight-change`` — a weight tensor nearly uncorrelated with the same tensor in ``model_before`` (cosine < 0.2:
  a layer replaced rather than trained), or whose norm grew or shrank tenfold;
- with the client's batch ``x, y``: ``isolation`` — the fraction of the batch that some row of a fully connected
  layer receives its gradient from alone (≥ 99.9 % of the row's per-sample gradient mass): exactly the samples
  a trap-weight attack reads back (∇W_k / ∇b_k).  Honest wide layers isolate some samples too (the leak
  Boenisch et al. start from), so it fires when the fraction is ≥ 25 % *and* ≥ 1.5× that of an honest model of
  the same architecture (the model held before, and a fresh default draw).

A model passes when no check fires.  The thresholds were set on the library's own honest models (fresh
initialisations of every family, and checkpoints of SGD and FedAvg training runs) and measured against its own
malicious ones (``python -m benchmarks malicious``; docs/feature-attacks.md has the tables with intervals).

**What this does not catch: the adaptive server.**  Every check reads a footprint of a *published* construction.
A server that knows the checks can avoid them: trap rows with a Binomial number of negatives, imprint bins with
slightly perturbed queries, fishing with moderate scales, or SEER (Garov et al., ICLR 2024), which trains an
ordinary-looking model and a secret decoder so that no weight looks unusual.  Then only ``isolation`` (which
measures the leak itself on the client's data, not a weight pattern) and ``weight-change`` (which needs the
previous model) remain, and a server that disaggregates through many layers (SEER) evades both.  A pass means
"none of the known footprints", never "safe".
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["inspect", "Inspection", "Finding", "CHECKS", "THRESHOLDS", "honest_draw"]

#: every check :func:`inspect` runs, in the order of its report
CHECKS = ("architecture", "duplicated-rows", "constant-rows", "zero-rows", "scaled-rows", "sign-balance",
          "weight-change", "isolation")

#: the thresholds of the checks (set on honest models, see the module docstring)
THRESHOLDS: dict[str, float] = {
    "parallel_cos": 1 - 1e-6,       # two rows are duplicates when |cos| ≥ this
    "min_columns": 8,               # row checks need rows of at least this many entries
    "constant_spread": 1e-6,        # a row is constant when (max − min) ≤ this · max |entry|
    "extreme_value": 100.0,         # a parameter entry this large is a magnified row or bias
    "row_norm_ratio": 50.0,         # a row norm this many times the median row norm is a scaled row
    "balanced_fraction": 0.5,       # sign-balance fires when at least this fraction of rows has exactly ⌊d/2⌋ …
    "balanced_p": 1e-12,            # … and that count is this improbable under 4× the honest rate
    "change_cosine": 0.2,           # a weight tensor this uncorrelated with the one held before was replaced
    "min_change_entries": 64,       # … checked on weight tensors of at least this many entries
    "norm_ratio": 10.0,             # ‖θ_received‖ / ‖θ_before‖ above this (or below its inverse): a rescaled layer
    "isolated_share": 0.999,        # a row isolates a sample when that sample holds this share of its gradient mass
    "isolated_fraction": 0.25,      # isolation fires when the rows isolate at least this fraction of the batch …
    "isolated_ratio": 1.5,          # … and this many times what an honest model of the architecture isolates
}

#: rows of one matrix compared pairwise at most (a seeded subset beyond)
MAX_ROWS = 4096


@dataclass
class Finding:
    """One check that fired: where (a parameter or module name), the evidence in words, and its statistic."""

    check: str
    where: str
    evidence: str
    value: float

    def __str__(self) -> str:
        return f"{self.check} at {self.where}: {self.evidence}"


@dataclass
class Inspection:
    """The verdict on a received model: ``suspicious`` when any check fired (``findings``), with every check's
    statistic (``statistics``: the largest value over the layers — the fraction of rows for the row checks, the
    largest entry for ``scaled-rows``, the fraction of the batch for ``isolation`` beside
    ``isolation-reference``, the *lowest* cosine for ``weight-change`` — NaN when the check could not run) and
    what was not run (``skipped``: check → why)."""

    findings: list[Finding] = field(default_factory=list)
    statistics: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def suspicious(self) -> bool:
        return bool(self.findings)

    @property
    def checks(self) -> list[str]:
        """The checks that fired, in :data:`CHECKS` order, each once."""
        fired = {f.check for f in self.findings}
        return [c for c in CHECKS if c in fired]

    @property
    def reason(self) -> str:
        """One line: the findings (at most three, the rest counted), or that none of the checks fired."""
        if not self.findings:
            ran = [c for c in CHECKS if c not in self.skipped]
            return f"no check fired ({', '.join(ran)})"
        shown = "; ".join(str(f) for f in self.findings[:3])
        more = len(self.findings) - 3
        return shown + (f"; and {more} more finding(s)" if more > 0 else "")

    def __str__(self) -> str:
        return ("SUSPICIOUS: " if self.suspicious else "passed: ") + self.reason


def _matrices(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, rows × rest) of the weight of every fully connected and convolutional layer (and of any other
    ≥ 2-dimensional parameter outside an embedding table, whose padding row is zero by design), float64, CPU."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out = []
    for name, p in model.named_parameters():
        if p.dim() >= 2 and p.shape[0] >= 2 and id(p) not in skip:
            out.append((name, p.detach().reshape(p.shape[0], -1).double().cpu()))
    return out


def _rows_subset(m: torch.Tensor) -> torch.Tensor:
    if m.shape[0] <= MAX_ROWS:
        return m
    pick = torch.randperm(m.shape[0], generator=torch.Generator().manual_seed(0))[:MAX_ROWS]
    return m[pick]


def _duplicated(name: str, m: torch.Tensor, out: list[Finding], stats: dict[str, float]) -> None:
    if m.shape[1] < THRESHOLDS["min_columns"]:
        return
    rows = _rows_subset(m)
    norms = rows.norm(dim=1)
    live = norms > 0
    if int(live.sum()) < 2:
        return
    unit = rows[live] / norms[live, None]
    cos = (unit @ unit.T).abs()
    cos.fill_diagonal_(0)
    dup = (cos >= THRESHOLDS["parallel_cos"]).any(1)
    count = int(dup.sum())
    stats["duplicated-rows"] = max(stats.get("duplicated-rows", 0.0), count / rows.shape[0])
    if count:
        out.append(Finding("duplicated-rows", name, f"{count} of {rows.shape[0]} rows are parallel to another row "
                           f"(|cos| ≥ {THRESHOLDS['parallel_cos']:.6f}; an honest draw or training gives none)",
                           count / rows.shape[0]))


def _constant(name: str, m: torch.Tensor, out: list[Finding], stats: dict[str, float]) -> None:
    if m.shape[1] < THRESHOLDS["min_columns"]:
        return
    top = m.abs().amax(1)
    spread = m.amax(1) - m.amin(1)
    const = (top > 0) & (spread <= THRESHOLDS["constant_spread"] * top)
    count = int(const.sum())
    stats["constant-rows"] = max(stats.get("constant-rows", 0.0), count / m.shape[0])
    if count:
        value = float(m[const][0, 0])
        out.append(Finding("constant-rows", name, f"{count} of {m.shape[0]} rows hold one value each (e.g. "
                           f"{value:.4g} in all {m.shape[1]} entries)", count / m.shape[0]))


def _zero(name: str, m: torch.Tensor, out: list[Finding], stats: dict[str, float]) -> None:
    zero = (m == 0).all(1)
    count = int(zero.sum())
    stats["zero-rows"] = max(stats.get("zero-rows", 0.0), count / m.shape[0] if count < m.shape[0] else 0.0)
    if 0 < count < m.shape[0] and m.shape[1] >= 2:
        out.append(Finding("zero-rows", name, f"{count} of {m.shape[0]} rows are exactly zero (the others are not)",
                           count / m.shape[0]))


def _scaled(model: nn.Module, out: list[Finding], stats: dict[str, float]) -> None:
    extreme = THRESHOLDS["extreme_value"]
    top = 0.0
    for name, p in model.named_parameters():
        if p.numel() == 0 or not p.is_floating_point():
            continue
        big = float(p.detach().abs().max())
        top = max(top, big)
        if big >= extreme:
            out.append(Finding("scaled-rows", name, f"entries up to {big:.4g} in magnitude (≥ {extreme:g}; honest "
                               "weights and biases stay orders of magnitude below)", big))
    stats["scaled-rows"] = top
    for name, m in _matrices(model):
        norms = m.norm(dim=1)
        live = norms[norms > 0]
        if live.numel() < 4:
            continue
        ratio = float(live.max() / live.median())
        stats["row-norm-ratio"] = max(stats.get("row-norm-ratio", 0.0), ratio)
        if ratio >= THRESHOLDS["row_norm_ratio"]:
            out.append(Finding("scaled-rows", name, f"a row of norm {float(live.max()):.4g}, {ratio:.0f}× the median "
                               f"row norm {float(live.median()):.4g}", ratio))


def _balanced(name: str, m: torch.Tensor, out: list[Finding], stats: dict[str, float]) -> None:
    from scipy.stats import binom  # lazy: `import leakbench` skips scipy
    rows, d = m.shape
    if d < 16 or rows < 16:
        return
    negatives = (m < 0).sum(1)
    half = (negatives == d // 2) | (negatives == (d + 1) // 2)
    count = int(half.sum())
    honest = float(binom.pmf(d // 2, d, 0.5) + (binom.pmf((d + 1) // 2, d, 0.5) if d % 2 else 0.0))
    rate = min(1.0, 4 * honest)
    p_value = float(binom.sf(count - 1, rows, rate))
    stats["sign-balance"] = max(stats.get("sign-balance", 0.0), count / rows)
    if count >= THRESHOLDS["balanced_fraction"] * rows and p_value < THRESHOLDS["balanced_p"]:
        out.append(Finding("sign-balance", name, f"{count} of {rows} rows have exactly {d // 2} of {d} entries "
                           f"negative (an honest draw: {honest * rows:.1f} expected; P ≤ {p_value:.1e} even at 4× "
                           "that rate): trap rows", count / rows))


def _architecture(before: nn.Module, received: nn.Module, out: list[Finding], stats: dict[str, float]) -> bool:
    old = {n: tuple(p.shape) for n, p in before.named_parameters()}
    new = {n: tuple(p.shape) for n, p in received.named_parameters()}
    added = [n for n in new if n not in old]
    removed = [n for n in old if n not in new]
    reshaped = [n for n in new if n in old and new[n] != old[n]]
    changed = bool(added or removed or reshaped)
    stats["architecture"] = float(len(added) + len(removed) + len(reshaped))
    if changed:
        parts = []
        if added:
            parts.append(f"new parameters {', '.join(f'{n} {tuple(new[n])}' for n in added[:4])}"
                         + (f" (+{len(added) - 4})" if len(added) > 4 else ""))
        if removed:
            parts.append(f"removed {', '.join(removed[:4])}" + (f" (+{len(removed) - 4})" if len(removed) > 4 else ""))
        if reshaped:
            parts.append(f"reshaped {', '.join(f'{n} {old[n]} → {new[n]}' for n in reshaped[:4])}")
        out.append(Finding("architecture", "model", "; ".join(parts) + " since the model held before",
                           float(len(added) + len(removed) + len(reshaped))))
    return changed


def _change(before: nn.Module, received: nn.Module, out: list[Finding], stats: dict[str, float]) -> None:
    """Weight tensors uncorrelated with the model held before (replaced, not trained), or rescaled tenfold."""
    old = dict(before.named_parameters())
    low = 1.0
    for name, p in received.named_parameters():
        q = old.get(name)
        if q is None or q.shape != p.shape or p.dim() < 2 or p.numel() < THRESHOLDS["min_change_entries"]:
            continue
        a, b = p.detach().double().cpu().reshape(-1), q.detach().double().cpu().reshape(-1)
        na, nb = float(a.norm()), float(b.norm())
        if na == 0 or nb == 0:
            continue
        cos = float(a @ b) / (na * nb)
        low = min(low, cos)
        if cos < THRESHOLDS["change_cosine"]:
            out.append(Finding("weight-change", name, f"cosine {cos:.3f} with the same weights one round before (a "
                               f"layer replaced, not trained: honest rounds keep it ≥ {THRESHOLDS['change_cosine']:g})",
                               cos))
        elif na / nb > THRESHOLDS["norm_ratio"] or na / nb < 1 / THRESHOLDS["norm_ratio"]:
            out.append(Finding("weight-change", name, f"its norm changed {na / nb:.3g}× in one round", na / nb))
    stats["weight-change"] = low


def _isolated(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str) -> dict[str, tuple[float, int, int]]:
    """Per fully connected layer: (fraction of the batch isolated, rows isolating, active rows) — a sample is
    isolated by a row that receives ≥ ``isolated_share`` of its per-sample gradient mass from it."""
    from ..losses import get_loss

    probe = copy.deepcopy(model).eval()
    linears = [(n, m) for n, m in probe.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        return {}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name):
        def capture(_m, inputs, output):
            output.retain_grad()
            seen[name] = (inputs[0].detach(), output)
        return capture

    handles = [m.register_forward_hook(hook(n)) for n, m in linears]
    p0 = next(probe.parameters())
    try:
        with torch.enable_grad():
            logits = probe(x.to(p0.device, p0.dtype))
            total = get_loss(loss)(logits, y.to(p0.device)) * x.shape[0]   # per-sample losses, summed
            total.backward()
    finally:
        for h in handles:
            h.remove()
    b = x.shape[0]
    result: dict[str, tuple[float, int, int]] = {}
    for name, layer in linears:
        if name not in seen or seen[name][1].grad is None:
            continue
        h, z = seen[name]
        if h.dim() != 2 or z.dim() != 2 or h.shape[0] != b:
            continue
        delta = z.grad.detach().double().abs()                                   # (B, K)
        mass = delta * (h.double().pow(2).sum(1, keepdim=True) + (layer.bias is not None)).sqrt()
        per_row = mass.sum(0)
        live = per_row > 1e-9 * float(per_row.max()) if float(per_row.max()) > 0 else per_row > 0
        if not bool(live.any()):
            continue
        share, owner = (mass[:, live] / per_row[live]).max(0)
        alone = owner[share >= THRESHOLDS["isolated_share"]].unique()
        result[name] = (alone.numel() / b, int((share >= THRESHOLDS["isolated_share"]).sum()), int(live.sum()))
    return result


def honest_draw(model: nn.Module, *, seed: int = 0) -> nn.Module:
    """A copy of ``model`` with every module's own ``reset_parameters()`` (PyTorch's default initialisation),
    seeded: what an honest server's fresh model of the same architecture looks like."""
    fresh = copy.deepcopy(model)
    state = torch.random.get_rng_state()
    torch.manual_seed(int(seed))
    try:
        for m in fresh.modules():
            if hasattr(m, "reset_parameters") and callable(m.reset_parameters):
                m.reset_parameters()
    finally:
        torch.random.set_rng_state(state)
    return fresh


def _isolation(before: nn.Module | None, received: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str,
               out: list[Finding], stats: dict[str, float]) -> None:
    """Fire where the received model isolates far more of the batch than an honest model of its architecture.

    Honest wide ReLU layers isolate samples too (digits, ``mlp:1000`` at initialisation: 39 % of a batch of 64;
    Boenisch et al.'s point that FL leaks without any malice), so the measure is relative: the reference is the
    larger of the model held before (same architecture) and a fresh default draw of the received architecture.
    """
    got = _isolated(received, x, y, loss)
    refs = [_isolated(honest_draw(received), x, y, loss)]
    if before is not None:
        try:
            refs.append(_isolated(before, x, y, loss))
        except Exception:  # noqa: BLE001 - another architecture: the fresh draw is the reference
            pass
    top = max((v[0] for v in got.values()), default=0.0)
    stats["isolation"] = top
    reference = max((r.get(name, (0.0,))[0] for r in refs for name in got), default=0.0)
    stats["isolation-reference"] = reference
    for name, (fraction, rows, live) in got.items():
        ref = max(r.get(name, (0.0, 0, 0))[0] for r in refs)
        if fraction >= THRESHOLDS["isolated_fraction"] and fraction >= THRESHOLDS["isolated_ratio"] * ref:
            b = x.shape[0]
            out.append(Finding("isolation", name, f"{rows} of {live} active rows each take their gradient from one "
                               f"sample alone: {round(fraction * b)} of your {b} samples would be readable exactly as "
                               f"∇W_k / ∇b_k (an honest model of this architecture: {round(ref * b)})", fraction))


def inspect(model_before: nn.Module | None, model_received: nn.Module, *, x: torch.Tensor | None = None,
            y: torch.Tensor | None = None, loss: str = "ce") -> Inspection:
    """Check ``model_received`` for the footprints of known server modifications (see the module docstring).

    ``model_before``: the model the client held (the previous round's global model), or None in the first
    round (then ``architecture`` and ``weight-change`` are skipped).  ``x, y``: the client's own batch (the
    samples it is about to train on); without them ``isolation`` is skipped.  Neither model is changed.
    Returns an :class:`Inspection`: ``suspicious``, ``findings`` (each with its evidence), ``reason`` (one
    line) and ``statistics`` (every check's value, for calibration).
    """
    if not isinstance(model_received, nn.Module):
        raise ConfigError(f"expected the received model as a torch.nn.Module, got {type(model_received).__name__} "
                          "(argument model_received)")
    if model_before is not None and not isinstance(model_before, nn.Module):
        raise ConfigError(f"expected the model held before as a torch.nn.Module or None, got "
                          f"{type(model_before).__name__} (argument model_before)")
    if (x is None) != (y is None):
        raise ConfigError("expected both x and y (the client's batch) or neither (arguments x, y)")
    report = Inspection()
    out, stats = report.findings, report.statistics
    if model_before is None:
        report.skipped["architecture"] = report.skipped["weight-change"] = "no model held before (first round)"
    else:
        if not _architecture(model_before, model_received, out, stats):
            _change(model_before, model_received, out, stats)
        else:
            stats["weight-change"] = math.nan
            report.skipped["weight-change"] = "the architecture changed"
    for name, m in _matrices(model_received):
        _duplicated(name, m, out, stats)
        _constant(name, m, out, stats)
        _zero(name, m, out, stats)
        _balanced(name, m, out, stats)
    _scaled(model_received, out, stats)
    if x is None:
        report.skipped["isolation"] = "no client batch given (arguments x, y)"
    else:
        try:
            _isolation(model_before, model_received, x, y, loss, out, stats)
        except Exception as err:  # noqa: BLE001 - a model the batch cannot run through: said, not fatal
            report.skipped["isolation"] = f"the batch does not run through the model: {type(err).__name__}: {err}"
    order = {c: i for i, c in enumerate(CHECKS)}
    out.sort(key=lambda f: order[f.check])
    for check in CHECKS:
        stats.setdefault(check, math.nan if check in report.skipped else 0.0)
    return report
