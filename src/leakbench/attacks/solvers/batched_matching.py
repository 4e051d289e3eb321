"""Independent gradient-matching problems of one shape solved as one optimisation (stacked trials).

k observations that share the model's weights, the attack's settings, the batch size and the input shape
(different images, seeds or defense draws) are independent problems.  Stacking their candidates into one
tensor and mapping the per-problem objective with ``torch.func.vmap`` gives every problem exactly the
gradient it has alone; Adam and SGD are per-element, so one optimiser over the stack takes, for every
problem, the step its own optimiser takes.  Each problem's images therefore equal the sequential run's
(:meth:`.GradientMatcher.run`) for the same seed up to float rounding (tested per attack).  Restarts are
stacked too: row t·R + r is restart r of problem t, started from problem t's generator as the sequential
run starts it.

What is mapped: the simulated gradient or local update (``torch.func.grad`` per problem), the distance to
each problem's own target (:func:`~.objectives.gradient_distance`), the TV prior, and the output-layer
feature term (each problem's recovered per-label features, padded to the widest label count and masked).
A problem whose objective turns non-finite is frozen at once (its gradient masked to zero and its values
held), so it cannot disturb the others, and it comes back as a :class:`DivergedMatch` error.

Not stacked (:func:`batch_refusal` says why; :func:`leakbench.attacks.attack_batch` runs those one after
the other): L-BFGS (its line search and history couple all coordinates of the optimised tensor: one
problem's curvature would set the others' steps), the batch-norm prior, and the factorised wide-linear
path (the stack stays dense).

Two ways to compute the stacked objective (:data:`STACKING`): ``vmap`` maps each problem's objective, its
simulated gradient by ``torch.func.grad``; ``block`` (the default) gives every row a zero-copy expanded copy of
the parameters and takes one ordinary autograd gradient of the summed losses (each row's Jacobian block is
its own).  Measured on 2 CPU cores (``benchmarks/bench_batched.py``, k = 16): within noise of each other
(0.27 against 0.26 s a trial for IG ``quick`` at B = 1, 1.03 against 0.93 s for ``fast`` at B = 4); both
equal the sequential run (tested).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call

from ...errors import LeakbenchError
from .gradient_matching import GradientMatcher
from .matching_settings import MatchResult, step_schedule
from .objectives import gradient_distance, total_variation

#: how the stacked objective is computed (``benchmarks/bench_batched.py`` measures both; the faster is default)
STACKING = ("vmap", "block")


class DivergedMatch(LeakbenchError):
    """A stacked problem's objective turned non-finite (a diverged run is a failure, not a result)."""


def batch_refusal(matcher: GradientMatcher) -> str | None:
    """Why ``matcher``'s problem cannot be stacked with others (None when it can)."""
    s, obs = matcher.s, matcher.obs
    if matcher.extra_terms:
        return matcher.extra_terms
    if s.optimizer == "lbfgs":
        return ("L-BFGS couples every coordinate of the optimised tensor through its line search and history: "
                "stacked problems would share steps, so it runs one problem at a time")
    if matcher.use_bn:
        return "the batch-norm prior is not stacked: it runs one problem at a time"
    if s.group > 0:
        return "group consistency couples a problem's restarts: it runs one problem at a time"
    if obs.kind not in ("gradient", "update"):
        return f"an observation of kind {obs.kind!r} holds no gradient to match"
    return None


def group_key(matcher: GradientMatcher) -> tuple:
    """Problems with equal keys (and equal model weights) can share one stacked optimisation."""
    obs, s = matcher.obs, matcher.s
    found = matcher._feature_target
    return (obs.kind, obs.batch_size, tuple(obs.input_shape), obs.num_classes, obs.loss, obs.local_steps,
            obs.local_lr, repr(obs.local_batches), obs.train_mode, tuple(obs.data_range), str(obs.device),
            obs.dtype, repr(s), tuple(matcher.distance.weights), tuple(matcher.names),
            None if found is None else found.layer)


def same_weights(a: GradientMatcher, b: GradientMatcher) -> bool:
    return a.names == b.names and all(torch.equal(a.params[n], b.params[n]) for n in a.names)


@dataclass
class _Rows:
    """The stacked per-row inputs (row = problem t, restart r)."""

    targets: list[torch.Tensor]       # one (rows, *shape) tensor per parameter
    labels: torch.Tensor | None       # (rows, B) class indices; None with soft labels
    features: torch.Tensor | None     # (rows, G, d) recovered per-label features, zero-padded
    onehot: torch.Tensor | None       # (rows, B, G) slot → label row
    counts: torch.Tensor | None       # (rows, G, 1) slots per label row (1 on padding)
    mask: torch.Tensor | None         # (rows, G) 1 on real label rows


class StackedMatching:
    """k :class:`GradientMatcher` problems of one :func:`group_key` (features prepared), solved together."""

    def __init__(self, matchers: Sequence[GradientMatcher], labels: Sequence[torch.Tensor | None], *,
                 stacking: str = "block") -> None:
        if not matchers:
            raise LeakbenchError("expected at least one problem to stack")
        keys = {group_key(m) for m in matchers}
        if len(keys) != 1 or not all(same_weights(matchers[0], m) for m in matchers[1:]):
            raise LeakbenchError("stacked problems must share the model weights, settings and shapes")
        for m in matchers:
            reason = batch_refusal(m)
            if reason:
                raise LeakbenchError(reason)
        if stacking not in STACKING:
            raise LeakbenchError(f"expected stacking in {STACKING}, got {stacking!r}")
        self.matchers, self.labels, self.stacking = list(matchers), list(labels), stacking
        ref = self.matchers[0]
        self.s, self.obs, self.names = ref.s, ref.obs, ref.names
        self.model, self.loss_fn = ref.model, ref.loss_fn
        self.params = {n: p.detach() for n, p in ref.params.items()}
        self.weights = list(ref.distance.weights)
        self.features_on = ref._feature_target is not None
        self._z: list[torch.Tensor] = []
        if self.features_on:
            layer = dict(self.model.named_modules())[ref._feature_target.layer]
            layer.register_forward_hook(lambda _m, inputs, _o: self._z.append(inputs[0]))
        self._steps = ref._steps

    # -- the stacked inputs ----------------------------------------------------------------
    def _rows(self, repeat: int) -> _Rows:
        ms = self.matchers
        index = torch.arange(len(ms)).repeat_interleave(repeat)

        def stack(ts: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(ts)[index.to(ts[0].device)]

        targets = [stack([m.distance.target[i] for m in ms]) for i in range(len(self.names))]
        labels = None if self.s.soft_labels else stack([lab.reshape(-1) for lab in self.labels])
        if not self.features_on:
            return _Rows(targets, labels, None, None, None, None)
        found = [m._feature_target for m in ms]
        width = max(len(f.features) for f in found)
        b = self.obs.batch_size
        feats, onehot, counts, mask = [], [], [], []
        for m, f in zip(ms, found):
            g = len(f.features)
            feats.append(torch.cat([f.features, f.features.new_zeros(width - g, f.features.shape[1])]))
            hot = torch.zeros(b, width, dtype=f.features.dtype, device=f.features.device)
            hot[torch.arange(b, device=hot.device), f.groups] = 1.0
            onehot.append(hot)
            counts.append(hot.sum(0).clamp_min(1.0)[:, None])
            mask.append(torch.cat([m._feature_weight, hot.new_zeros(width - g)]))  # real, matched label rows
        return _Rows(targets, labels, stack(feats), stack(onehot), stack(counts), stack(mask))

    # -- the per-row objective ---------------------------------------------------------------
    def _forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, params, (x,), strict=False)

    def _shared(self, params, x, target) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The simulated gradient (or update) of one row, by ``torch.func.grad``; the output layer's input."""
        obs = self.obs

        def loss_of(p, xb, tb):
            self._z.clear()
            out = self.loss_fn(self._forward(p, xb), tb)
            return out, (self._z[-1] if self._z else out.new_zeros(()))

        if obs.kind == "gradient":
            grads, z = torch.func.grad(loss_of, has_aux=True)(params, x, target)
            return [grads[n] for n in self.names], z
        current, z = dict(params), None
        for idx in self._steps:
            xb, tb = (x, target) if idx is None else (x[idx], target[idx])
            at = params if self.s.local_model == "first-order" else current
            grads, z = torch.func.grad(loss_of, has_aux=True)(at, xb, tb)
            current = {n: current[n] - obs.local_lr * grads[n] for n in current}
        return [current[n] - params[n] for n in self.names], z

    def _features(self, z, feats, onehot, counts, mask) -> torch.Tensor:
        means = onehot.T @ z.reshape(z.shape[0], -1) / counts
        ratio = (means - feats).pow(2).sum(1) / feats.pow(2).sum(1).clamp_min(1e-30)
        return (ratio * mask).sum() / mask.sum()

    def _row(self, full: bool):
        """(total, match, feature term) of one row as a function of its candidate and its stacked inputs."""
        s = self.s

        def one(x, logits, targets, labels, feats, onehot, counts, mask):
            target = torch.softmax(logits, dim=-1) if s.soft_labels else labels
            if full:
                shared, z = self._shared(self.params, x, target)
                match = gradient_distance(shared, targets, kind=s.distance, weights=self.weights)
                total = match
            else:
                self._z.clear()
                self._forward(self.params, x)
                z = self._z[-1]
                match = total = x.new_zeros(())
            fval = x.new_zeros(())
            if self.features_on:
                fval = self._features(z, feats, onehot, counts, mask)
                total = total + s.features * fval
            if s.tv:
                total = total + s.tv * total_variation(x)
            return total, match, fval

        return one

    def objective(self, xs: torch.Tensor, logits: torch.Tensor | None, rows: _Rows, *, full: bool):
        """(∂/∂xs, ∂/∂logits or None, match per row, feature term per row, total per row)."""
        one = self._row(full)
        inputs = (rows.targets, rows.labels, rows.features, rows.onehot, rows.counts, rows.mask)
        dims = (0, None if logits is None else 0, 0, None if rows.labels is None else 0,
                *[None if t is None else 0 for t in inputs[2:]])

        def summed(xs_, logits_):
            totals, matches, fvals = torch.func.vmap(one, in_dims=dims)(xs_, logits_, *inputs)
            return totals.sum(), (matches, fvals, totals)

        if self.stacking == "block":
            return self._block(xs, logits, rows, full=full)
        argnums = (0, 1) if logits is not None else 0
        grads, (matches, fvals, totals) = torch.func.grad(summed, argnums=argnums, has_aux=True)(xs, logits)
        gx, gl = grads if logits is not None else (grads, None)
        return gx, gl, matches.detach(), fvals.detach(), totals.detach()

    def _block(self, xs, logits, rows: _Rows, *, full: bool):
        """The same objective through ordinary autograd: every row gets its own (expanded, zero-copy) copy of
        the parameters, the forward pass is mapped over rows and parameters together, and one gradient of the
        summed losses with respect to the copies is each row's simulated gradient (its Jacobian is
        block-diagonal); the distances, priors and feature terms are mapped over rows, and a last gradient
        gives ∂/∂xs."""
        s, obs = self.s, self.obs
        n = xs.shape[0]
        x = xs.detach().requires_grad_(True)
        lg = None if logits is None else logits.detach().requires_grad_(True)

        def forward(p, xb):
            self._z.clear()
            out = self._forward(p, xb)
            return out, (self._z[-1] if self._z else out.new_zeros(()))

        def row_loss(out, target):
            return self.loss_fn(out, target)

        with torch.enable_grad():
            target = torch.softmax(lg, dim=-1) if lg is not None else rows.labels
            if full:
                base = {k: v.unsqueeze(0).expand(n, *v.shape).requires_grad_(True) for k, v in self.params.items()}
                current, z = base, None
                steps = self._steps if obs.kind == "update" else [None]
                for idx in steps:
                    xb, tb = (x, target) if idx is None else (x[:, idx], target[:, idx])
                    at = base if s.local_model == "first-order" else current  # first order: gradients at θ₀
                    out, zb = torch.func.vmap(forward)(at, xb)
                    z = zb
                    losses = torch.func.vmap(row_loss)(out, tb)
                    grads = torch.autograd.grad(losses.sum(), [at[k] for k in self.names], create_graph=True)
                    if obs.kind == "gradient":
                        shared = list(grads)
                    else:
                        current = {k: current[k] - obs.local_lr * g for k, g in zip(self.names, grads)}
                if obs.kind == "update":
                    shared = [current[k] - base[k] for k in self.names]
                matches = torch.func.vmap(lambda d, t: gradient_distance(d, t, kind=s.distance, weights=self.weights))(
                    shared, rows.targets)
                totals = matches
            else:
                _, z = torch.func.vmap(forward, in_dims=(None, 0))(self.params, x)
                matches = totals = x.new_zeros(n)
            fvals = x.new_zeros(n)
            if self.features_on:
                fvals = torch.func.vmap(self._features)(z, rows.features, rows.onehot, rows.counts, rows.mask)
                totals = totals + s.features * fvals
            if s.tv:
                totals = totals + s.tv * torch.func.vmap(total_variation)(x)
            grads = torch.autograd.grad(totals.sum(), [x] + ([lg] if lg is not None else []))
        return grads[0], grads[1] if lg is not None else None, matches.detach(), fvals.detach(), totals.detach()

    # -- optimisation ----------------------------------------------------------------------
    def run(self, seeds: Sequence[int], *,
            progress: Callable[[int, int, float], None] | None = None) -> list[MatchResult | DivergedMatch]:
        """Optimise every problem (problem t from ``seeds[t]``); one result (or the divergence) per problem."""
        s, obs, ms = self.s, self.obs, self.matchers
        start = time.perf_counter()
        R, k = s.restarts, len(ms)
        shape = (obs.batch_size, *obs.input_shape)
        starts, logit_starts = [], []
        for m, seed in zip(ms, seeds):
            gen = torch.Generator(device="cpu").manual_seed(int(seed))
            for _ in range(R):
                starts.append(m._start(gen, shape, None))
                if s.soft_labels:
                    logit_starts.append(torch.randn((obs.batch_size, obs.num_classes), generator=gen).to(
                        obs.device, obs.dtype))
        xs = torch.stack(starts).requires_grad_(True)
        logits = torch.stack(logit_starts).requires_grad_(True) if s.soft_labels else None
        variables = [xs] + ([logits] if logits is not None else [])
        lr = ms[0].lr
        opt = (torch.optim.Adam(variables, lr=lr) if s.optimizer == "adam"
               else torch.optim.SGD(variables, lr=lr, momentum=0.9))
        sched = step_schedule(opt, s.schedule, s.iterations)
        rows = self._rows(R)
        n = k * R
        dead = torch.zeros(n, dtype=torch.bool, device=xs.device)
        died_at = [-1] * n
        curves: list[list[float]] = [[] for _ in range(n)]
        feature_curves: list[list[float]] = [[] for _ in range(n)]
        phase_one = int(s.feature_phase * s.iterations) if self.features_on else 0
        last = math.nan
        for step in range(s.iterations):
            full = step >= phase_one
            gx, gl, matches, fvals, totals = self.objective(xs.detach(), None if logits is None else logits.detach(),
                                                            rows, full=full)
            bad = ~torch.isfinite(totals) | ~torch.isfinite(gx.flatten(1)).all(1)
            if gl is not None:
                bad |= ~torch.isfinite(gl.flatten(1)).all(1)
            newly = bad & ~dead
            dead |= bad
            if bool(newly.any()):
                for i in newly.nonzero().flatten().tolist():
                    died_at[i] = step
            frozen = died_at != [-1] * n
            held = [v.detach().clone() for v in variables] if frozen else []
            for v, g in zip(variables, (gx, gl)):
                g = g.sign() if (s.signed and v is xs) else g
                v.grad = torch.where(dead.view(-1, *[1] * (g.dim() - 1)), torch.zeros_like(g), g) if frozen else g
            opt.step()
            with torch.no_grad():
                for v, h in zip(variables, held):  # a diverged row stays where it was
                    v.copy_(torch.where(dead.view(-1, *[1] * (v.dim() - 1)), h, v))
            if s.box:
                with torch.no_grad():
                    xs.clamp_(*obs.data_range)
            if sched is not None:
                sched.step()
            if step % s.trace_every == 0 or step == s.iterations - 1:
                values = (matches if full else fvals).tolist()
                for i, v in enumerate(values):
                    if died_at[i] < 0:
                        (curves[i] if full else feature_curves[i]).append(v)
                alive = [v for i, v in enumerate(values) if died_at[i] < 0]
                last = min(alive) if alive else math.nan
            if progress is not None:  # every step (the loss as last traced): deadlines hold on slow steps
                progress(step + 1, s.iterations, last)
        _, _, finals_t, _, _ = self.objective(xs.detach(), None if logits is None else logits.detach(), rows,
                                              full=True)
        finals = [math.nan if died_at[i] >= 0 else v for i, v in enumerate(finals_t.tolist())]
        seconds = time.perf_counter() - start
        results: list[MatchResult | DivergedMatch] = []
        for t in range(k):
            rs = list(range(t * R, (t + 1) * R))
            if all(died_at[i] >= 0 for i in rs):
                results.append(DivergedMatch(f"the matching objective turned non-finite at step "
                                             f"{min(died_at[i] for i in rs)} of {s.iterations} (a diverged run is a "
                                             "failure, not a score)"))
                continue
            best = rs[0]
            for i in rs[1:]:
                if math.isfinite(finals[i]) and (not math.isfinite(finals[best]) or finals[i] < finals[best]):
                    best = i
            final_labels = logits[best].detach().argmax(-1) if logits is not None else self.labels[t]
            trace = {"loss": curves[best], "restart_losses": [finals[i] for i in rs], "iterations": s.iterations,
                     "restarts": R, "tv": s.tv, "trace_every": s.trace_every, "final_match": finals[best],
                     "stacked": k, "seconds": seconds / k, "stack_seconds": seconds}
            if phase_one:
                trace.update(feature_steps=phase_one, feature_loss=[v for i in rs for v in feature_curves[i]])
            results.append(MatchResult(images=xs[best].detach().clone(), labels=final_labels.detach().clone(),
                                       trace=trace))
        return results


class _FromProgress(Exception):
    """An exception raised by the caller's progress report (a deadline): it ends the stack, no fallback."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _guarded(progress):
    if progress is None:
        return None

    def report(done: int, total: int, loss: float) -> None:
        try:
            progress(done, total, loss)
        except Exception as err:
            raise _FromProgress(err) from err

    return report


def solve_many(matchers: Sequence[GradientMatcher], labels: Sequence[torch.Tensor | None], seeds: Sequence[int], *,
               progress: Callable[[int, int, float], None] | None = None,
               stacking: str = "block") -> list[MatchResult | Exception]:
    """Every problem's result (or its error): stackable problems of one group in one optimisation, the rest
    (and a group whose stacked run fails for a reason of its own, e.g. an operation ``vmap`` cannot map) one
    after the other with :meth:`.GradientMatcher.run`.  An error of ``progress`` (a deadline) ends the group
    it interrupts: each of its problems gets that error."""
    results: list[MatchResult | Exception | None] = [None] * len(matchers)
    entries = [m._prepare_features(lab) for m, lab in zip(matchers, labels)]
    stackable = [i for i, m in enumerate(matchers) if batch_refusal(m) is None]
    alone = {i: batch_refusal(m) for i, m in enumerate(matchers) if i not in stackable}
    for members in stacked_groups([matchers[i] for i in stackable]):
        chosen = [stackable[j] for j in members]
        if len(chosen) == 1:  # a stack of one only adds the stack's overhead
            alone[chosen[0]] = "no other problem of its shape"
            continue
        try:
            solved = StackedMatching([matchers[i] for i in chosen], [labels[i] for i in chosen],
                                     stacking=stacking).run([seeds[i] for i in chosen], progress=_guarded(progress))
        except _FromProgress as stop:
            for i in chosen:
                results[i] = stop.error
            continue
        except Exception as err:  # noqa: BLE001 (the problems still run, one at a time, with the reason)
            alone.update({i: f"stacking failed ({type(err).__name__}: {err}); ran alone" for i in chosen})
            continue
        for i, result in zip(chosen, solved):
            if isinstance(result, MatchResult):
                matchers[i]._against_grey(result)
                if entries[i]:
                    result.trace["features"] = entries[i]
            results[i] = result
    for i, reason in sorted(alone.items()):
        try:
            result = matchers[i].run(labels[i], seed=seeds[i], progress=progress)
            result.trace["stacked"] = 1
            result.trace["alone"] = reason
            results[i] = result
        except Exception as err:  # noqa: BLE001 (one problem's failure is its own)
            results[i] = err
    return results  # type: ignore[return-value]


def solve_observations(observations: Sequence, seeds: Sequence[int],
                       prepare: Callable[[object, int], tuple[GradientMatcher, torch.Tensor | None]], *,
                       progress: Callable[[int, int, float], None] | None = None) -> list[MatchResult | Exception]:
    """:func:`solve_many` on the problems ``prepare(observation, seed) → (matcher, labels)`` sets up; an error
    while setting one up is that problem's result."""
    prepared: dict[int, tuple[GradientMatcher, torch.Tensor | None]] = {}
    results: list[MatchResult | Exception | None] = [None] * len(observations)
    for i, (obs, seed) in enumerate(zip(observations, seeds)):
        try:
            prepared[i] = prepare(obs, seed)
        except Exception as err:  # noqa: BLE001 (one problem's failure is its own)
            results[i] = err
    keys = sorted(prepared)
    solved = solve_many([prepared[i][0] for i in keys], [prepared[i][1] for i in keys], [seeds[i] for i in keys],
                        progress=progress)
    for i, result in zip(keys, solved):
        results[i] = result
    return results  # type: ignore[return-value]


def stacked_groups(matchers: Sequence[GradientMatcher]) -> list[list[int]]:
    """Indices of ``matchers`` in groups that can be stacked (each group shares a key and the model weights)."""
    groups: list[tuple[tuple, list[int]]] = []
    for i, m in enumerate(matchers):
        key = group_key(m)
        for gkey, members in groups:
            if gkey == key and same_weights(matchers[members[0]], m):
                members.append(i)
                break
        else:
            groups.append((key, [i]))
    return [members for _, members in groups]


__all__ = ["StackedMatching", "DivergedMatch", "solve_many", "solve_observations", "batch_refusal", "group_key", "stacked_groups", "STACKING"]
