"""The gradient-matching engine shared by DLG, Inverting Gradients and the attacks built on them.

Given an observation (a gradient or a local update), find inputs x̂ — and, for
DLG, soft labels — whose simulated gradient/update matches the observed one:

    x̂ = argmin_x  D(∇θ L(f_θ(x), ŷ), G_obs) + α_TV·TV(x) + α_BN·R_BN(x)

with D one of :mod:`.objectives` (L2 of Zhu et al. 2019; cosine of Geiping et al.
2020 eq. 4; per-tensor cosine with ℓ0 weights of Liu et al. 2024 App. F).  For
an update observation the client's k SGD steps are simulated differentiably
(Geiping et al. 2020, Sec. 5), each on its minibatch of the candidate batch when the client ran
minibatch epochs (``Observation.local_batches``; Dimitrov et al. 2022's FedAvg simulation), or to first order in the
learning rate (``local_model="first-order"``: Δθ ≈ −η Σ_s ∇L_{b_s}(θ₀), every step's gradient at the received
weights).  The first-order model is ours, for trained networks: a candidate far from the data has a large
gradient there, the simulated first step moves θ far and the later steps blow up (measured on ``convnet-16``
trained to 0.98 on 16 × 16 digits, one epoch in minibatches of 2 at η = 0.05: a uniform-noise batch of 4 simulates
an update of norm 1.4·10⁵ against the observed 0.077, whose cosine with the one-step gradient is 0.999), and the
search in ``gias``'s latent space stalled at a match of 0.95–0.99.  Optimisers: Adam on the signed gradient with
the box constraint enforced after every step (Geiping et al.), L-BFGS (Zhu et
al.), or plain SGD; step decay ×0.1 at 3/8, 5/8, 7/8 of the run; several
restarts keeping the best final match, optionally run as one batched
computation with ``torch.func.vmap``.

Wide linear layers (``factorise``): the simulated weight gradient of a linear layer is δᵀz (input
rows z, upstream rows δ = ∂L/∂(its output)).  The engine asks autograd for δ instead of δᵀz and
hands the distance the pair (:class:`~.objectives.LinearFactors`), whose terms cost one n×v×d
matrix product instead of several passes over a v×d outer product: s/step grows linearly with the
width.  Same objective to float rounding (tested); gradient observations and one-step updates,
not the batched (vmap) restarts or several local steps, which stay dense.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call

from ...errors import ConfigError, expect
from ...losses import get_loss
from ...progress import keep_here
from ...threat import Observation
from .group_matching import run_grouped
from .last_layer import LastLayerInputs, last_layer_inputs
from .matching_settings import FACTORISE_MIN, MatchingSettings, MatchResult, initial_images, step_schedule
from .objectives import GradientDistance, LinearFactors, bn_statistics, layer_weights, total_variation


class _Interrupted(Exception):
    """A Ctrl-C inside the steps, kept as a partial result (``where``: the step; ``last_match``: its loss)."""

    def __init__(self, where: str, last_match: float) -> None:
        super().__init__(where)
        self.where, self.last_match = where, last_match


class GradientMatcher:
    """Simulates the client's shared quantity for candidate inputs and scores it against the observation."""

    #: why a subclass's objective cannot be stacked with other problems' (None: it is the engine's own)
    extra_terms: str | None = None

    def __init__(self, obs: Observation, settings: MatchingSettings) -> None:
        settings.check()
        if settings.tv_growth:  # the batch's α_TV, fixed for the run (the trace reports it as ``tv``)
            settings = dataclasses.replace(settings, tv=settings.tv * obs.batch_size ** settings.tv_growth,
                                           tv_growth=0.0)
        self.obs, self.s = obs, settings
        self.model = copy.deepcopy(obs.model)
        self.model.train(obs.train_mode)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.names = list(obs.param_names)
        base = obs.params()
        self.params = {n: base[n].clone().requires_grad_(True) for n in self.names}
        self.loss_fn = get_loss(obs.loss)
        weights = layer_weights(settings.weights, [base[n] for n in self.names])
        self.distance = GradientDistance(obs.shared, kind=settings.distance, weights=weights)
        self.use_bn = settings.bn > 0
        if self.use_bn:
            expect(obs.bn_stats is not None,
                   "option bn > 0 needs the batch-norm statistics: observe(..., train=True, bn_stats=True)")
        self._bn_layers = [m for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self._bn_seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.use_bn:
            for m in self._bn_layers:
                m.register_forward_hook(self._record_bn)
        if obs.train_mode:
            for m in self._bn_layers:  # no running-stat side effects on the attacker's copy
                m.track_running_stats = False
                m.running_mean = m.running_var = None
        self._steps = self._local_steps()
        self._linear = self._factorisable()
        self._captures: dict[int, list] | None = None
        self._verified = False
        self._feature_in: torch.Tensor | None = None  # the output layer's input in the last forward pass
        self._feature_target: LastLayerInputs | None = None
        self._feature_counts = torch.ones(0)
        self._feature_value = torch.zeros(())
        self._feature_hooked = False

    def _local_steps(self) -> list[torch.Tensor | None]:
        """The slots each simulated local step trains on (None: the whole batch)."""
        obs = self.obs
        if obs.kind != "update":
            return []
        if not obs.local_batches:
            return [None] * obs.local_steps
        expect(len(obs.local_batches) == obs.local_steps,
               f"the observation lists {len(obs.local_batches)} minibatches for {obs.local_steps} local steps")
        expect(all(0 <= i < obs.batch_size for b in obs.local_batches for i in b),
               f"the observation's minibatches index beyond its batch of {obs.batch_size}")
        return [torch.as_tensor(b, dtype=torch.long, device=obs.device) for b in obs.local_batches]

    # -- factorised linear layers ----------------------------------------------------------
    def _factorisable(self) -> list[tuple[int, nn.Linear]]:
        """(index in ``names``, module) of the linear layers whose weight gradient may stay factorised."""
        obs = self.obs
        if self.s.factorise == "off" or (obs.kind == "update" and obs.local_steps != 1):
            return []
        uses: dict[int, int] = {}
        for _, p in self.model.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        index = {n: i for i, n in enumerate(self.names)}
        layers = []
        for name, m in self.model.named_modules():
            k = index.get(f"{name}.weight" if name else "weight")
            if not isinstance(m, nn.Linear) or k is None or uses[id(m.weight)] != 1:
                continue  # (a zero-weight layer is factorised too: its δ is cheap, its δᵀz is never read)
            if self.s.factorise == "auto" and m.weight.numel() < FACTORISE_MIN:
                continue
            m.register_forward_hook(lambda mod, inputs, out, k=k: self._capture(k, inputs[0], out))
            layers.append((k, m))
        return layers

    def _capture(self, k: int, z: torch.Tensor, out: torch.Tensor) -> None:
        if self._captures is not None and k in self._captures:
            self._captures[k].append((z, out, z._version, out._version))

    @property
    def factorised(self) -> list[str]:
        """Names of the weights whose gradients the engine keeps factorised."""
        return [self.names[k] for k, _ in self._linear]

    def _usable(self, captures: dict[int, list]) -> dict[int, list]:
        """Captured calls per layer that can stand for the weight gradient (inputs not changed in place)."""
        use = {}
        for k, m in self._linear:
            seen = captures[k]
            if not seen or any(z._version != vz or o._version != vo for z, o, vz, vo in seen):
                continue
            rows = sum(z.numel() // m.in_features for z, *_ in seen)
            if self.s.factorise == "auto" and 2 * rows >= min(m.in_features, m.out_features):
                continue
            use[k] = seen
        return use

    def _factorised_gradient(self, x: torch.Tensor, target: torch.Tensor) -> list:
        """The gradient with the weights of wide linear layers as :class:`LinearFactors` (δ, z)."""
        self._captures = {k: [] for k, _ in self._linear}
        try:
            loss = self.loss_fn(self.forward(self.params, x), target)
        finally:
            captures, self._captures = self._captures, None
        use = self._usable(captures)
        if use and not self._verified:
            use = self._verify(loss, use)
        dense = [i for i in range(len(self.names)) if i not in use]
        outs = [o for k in use for _, o, _, _ in use[k]]
        grads = torch.autograd.grad(loss, [self.params[self.names[i]] for i in dense] + outs, create_graph=True)
        result: list = [None] * len(self.names)
        for i, g in zip(dense, grads):
            result[i] = g
        pos = len(dense)
        for k, seen in use.items():
            v, d = self._linear_module(k).out_features, self._linear_module(k).in_features
            deltas = grads[pos:pos + len(seen)]
            pos += len(seen)
            result[k] = LinearFactors(torch.cat([g.reshape(-1, v) for g in deltas]),
                                      torch.cat([z.reshape(-1, d) for z, *_ in seen]))
        return result

    def _linear_module(self, k: int) -> nn.Linear:
        return next(m for j, m in self._linear if j == k)

    def _verify(self, loss: torch.Tensor, use: dict[int, list]) -> dict[int, list]:
        """Once: δᵀz against autograd's weight gradient; a layer that disagrees (its weight is used outside
        the module's own call) stays dense from then on."""
        self._verified = True
        keys = list(use)
        outs = [o for k in keys for _, o, _, _ in use[k]]
        grads = torch.autograd.grad(loss, [self.params[self.names[k]] for k in keys] + outs, retain_graph=True)
        pos, wrong = len(keys), set()
        for j, k in enumerate(keys):
            m, seen = self._linear_module(k), use[k]
            delta = torch.cat([g.reshape(-1, m.out_features) for g in grads[pos:pos + len(seen)]])
            pos += len(seen)
            z = torch.cat([z.detach().reshape(-1, m.in_features) for z, *_ in seen])
            ref = grads[j]
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            if not torch.allclose(delta.T @ z, ref, rtol=1e-3, atol=1e-4 * scale + 1e-30):
                wrong.add(k)
        self._linear = [(k, m) for k, m in self._linear if k not in wrong]
        return {k: seen for k, seen in use.items() if k not in wrong}

    def _record_bn(self, module, inputs, _output) -> None:
        (inp,) = inputs
        dims = [0] + list(range(2, inp.dim()))
        self._bn_seen.append((inp.mean(dims), inp.var(dims, unbiased=False)))

    @property
    def lr(self) -> float:
        """The step size in the data's units: ``lr`` itself, or with ``step_unit="normalised"`` ``lr`` times
        a quarter of the data box — the standard deviation of normalised data that Geiping et al. optimise
        in (their lr 0.1 moves a CIFAR pixel by 0.1·σ ≈ 0.025, not 0.1), the scale ``init="gaussian"`` uses."""
        if self.s.step_unit == "normalised":
            lo, hi = self.obs.data_range
            return self.s.lr * (hi - lo) / 4
        return self.s.lr

    # -- the simulated client -------------------------------------------------------------
    def forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, params, (x,), strict=False)

    def shared_of(self, x: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor | LinearFactors]:
        """The gradient (or local update) the client would share for inputs ``x`` and targets ``target``
        (wide linear weights as :class:`LinearFactors`, see :attr:`factorised`)."""
        obs = self.obs
        if self._linear:  # gradient, or an update of one local step: θ₁ − θ₀ = −η∇θ
            grads = self._factorised_gradient(x, target)
            if obs.kind == "gradient":
                return grads
            return [g.scaled(-obs.local_lr) if isinstance(g, LinearFactors)
                    else (self.params[n] - obs.local_lr * g) - self.params[n] for n, g in zip(self.names, grads)]
        if obs.kind == "gradient":
            loss = self.loss_fn(self.forward(self.params, x), target)
            return list(torch.autograd.grad(loss, list(self.params.values()), create_graph=True))
        current, first_order = dict(self.params), self.s.local_model == "first-order"
        for idx in self._steps:
            xb, tb = (x, target) if idx is None else (x[idx], target[idx])
            at = self.params if first_order else current  # first order: every step's gradient at θ₀
            loss = self.loss_fn(self.forward(at, xb), tb)
            grads = torch.autograd.grad(loss, list(at.values()), create_graph=True)
            current = {n: p - obs.local_lr * g for (n, p), g in zip(current.items(), grads)}
        return [current[n] - self.params[n] for n in self.names]

    def objective(self, x: torch.Tensor, target: torch.Tensor, *,
                  match: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(total loss, gradient-match term) for candidate ``x``; ``match=False``: the feature term and the
        priors only (one forward pass, no simulated gradient), the match term None."""
        self._bn_seen.clear()
        if match:
            value = self.distance(self.shared_of(x, target))
            total = value
        else:
            self.forward(self.params, x)
            value, total = None, torch.zeros((), device=x.device, dtype=x.dtype)
        if self._feature_target is not None:
            self._feature_value = self._feature_term()
            total = total + self.s.features * self._feature_value
        if self.s.tv:
            total = total + self.s.tv * total_variation(x)
        if self.use_bn:
            total = total + self.s.bn * bn_statistics(self._bn_seen[: len(self._bn_layers)], self.obs.bn_stats)
        return total, value

    # -- the feature term --------------------------------------------------------------------
    def _prepare_features(self, labels: torch.Tensor | None) -> dict:
        """Recover the output layer's per-label mean inputs for the ``features`` term; its trace entry."""
        self._feature_target = None
        if self.s.features <= 0:
            return {}
        if self.obs.batch_size < self.s.features_from:
            return {"used": False, "reason": f"off below a batch of {self.s.features_from} (option features_from)"}
        found = last_layer_inputs(self.obs, None if self.s.soft_labels else labels)
        entry = {"used": found.features is not None, "layer": found.layer, "reason": found.reason}
        if math.isfinite(found.residual):
            entry["residual"] = found.residual
        if found.features is not None:
            counts = torch.bincount(found.groups, minlength=len(found.features))
            weight = (counts == 1) if self.s.features_labels == "unique" else counts > 0
            if not bool(weight.any()):
                return {**entry, "used": False, "reason": "no label is carried by one image only (features_labels="
                        "unique): each recovered feature is a mean over several images"}
            most = self.s.features_max_images
            if most and not bool((weight & (counts <= most)).any()):
                return {**entry, "used": False, "reason": f"every label is carried by more than {most} images "
                        f"(features_max_images={most}): each recovered feature is a mean over "
                        f"{int(counts.min())} or more images, a weak pull that measured a cost"}
            if most:
                weight = weight & (counts <= most)
            self._feature_weight = weight.to(found.features.dtype)
            layer = dict(self.model.named_modules())[found.layer]
            if not self._feature_hooked:
                layer.register_forward_hook(self._record_feature_input)
                self._feature_hooked = True
            self._feature_target = found
            self._feature_counts = torch.bincount(found.groups, minlength=len(found.features)).to(
                found.features.dtype)[:, None]
            entry["labels"] = int(weight.sum())
        return entry

    def _record_feature_input(self, _module, inputs, _output) -> None:
        self._feature_in = inputs[0]

    def _feature_term(self) -> torch.Tensor:
        """Mean over labels of ‖mean input of the label's slots − recovered‖² / ‖recovered‖²."""
        found, z = self._feature_target, self._feature_in
        means = torch.zeros_like(found.features).index_add(0, found.groups, z.reshape(len(z), -1)) / self._feature_counts
        ratio = (means - found.features).pow(2).sum(1) / found.features.pow(2).sum(1).clamp_min(1e-30)
        return (ratio * self._feature_weight).sum() / self._feature_weight.sum()

    # -- batched restarts (torch.func) -----------------------------------------------------
    def _batched_objective(self, xs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        expect(self.obs.kind == "gradient" and not self.use_bn,
               "batched_restarts supports gradient observations without the BN prior")
        params = {n: p.detach() for n, p in self.params.items()}

        def one(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            grads = torch.func.grad(lambda p: self.loss_fn(self.forward(p, x), target))(params)
            match = self.distance([grads[n] for n in self.names])
            total = match + self.s.tv * total_variation(x) if self.s.tv else match
            return total, match

        def summed(xs_):
            totals, matches = torch.func.vmap(one)(xs_)
            return totals.sum(), matches

        grad, matches = torch.func.grad(summed, has_aux=True)(xs)
        return grad, matches

    # -- optimisation ----------------------------------------------------------------------
    def targets(self, labels: torch.Tensor, label_logits: torch.Tensor | None) -> torch.Tensor:
        return torch.softmax(label_logits, dim=-1) if label_logits is not None else labels

    def apply_step(self, x: torch.Tensor, grad: torch.Tensor, opt: torch.optim.Optimizer, sched) -> None:
        """One optimiser step on ``x`` from ``grad`` (its sign with ``signed``), then the box and the schedule."""
        x.grad = grad.sign() if self.s.signed else grad
        opt.step()
        self._clamp(x)
        if sched is not None:
            sched.step()

    def _clamp(self, x: torch.Tensor) -> None:
        if self.s.box:
            with torch.no_grad():
                x.clamp_(*self.obs.data_range)

    def run(self, labels: torch.Tensor | None, *, seed: int = 0, init: torch.Tensor | None = None,
            callback: Callable[[int, torch.Tensor], None] | None = None,
            progress: Callable[[int, int, float], None] | None = None) -> MatchResult:
        """Optimise; ``labels`` are the class indices per slot (ignored with soft labels)."""
        s, obs = self.s, self.obs
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        shape = (obs.batch_size, *obs.input_shape)
        if labels is None and not s.soft_labels:
            raise ConfigError("labels are needed unless soft_labels=True")
        if init is not None:
            expect(tuple(init.shape) == shape, f"expected init of shape {shape}, got {tuple(init.shape)}")
        start = time.perf_counter()
        feature_entry = self._prepare_features(labels)
        if s.group > 0:
            result = run_grouped(self, labels, gen, shape, init, callback, progress)
        elif s.batched_restarts and s.restarts > 1 and not s.soft_labels:
            result = self._run_batched(labels, gen, shape, init, callback, progress)
        else:
            result = self._run_sequential(labels, gen, shape, init, callback, progress)
        self._against_grey(result)
        result.trace["seconds"] = time.perf_counter() - start
        if feature_entry:
            result.trace["features"] = feature_entry
        if self._linear:
            result.trace["factorised"] = self.factorised
        return result

    def _against_grey(self, result: MatchResult) -> None:
        """The gradient distance of a grey image (the data-range centre, the usual chance level) with the same
        labels, beside the result's; where the result does no better, the trace says the attack ended at chance
        by its own measure (the attacker sees no originals, so its own objective is what it can judge)."""
        final = result.trace.get("final_match", math.inf)
        lo, hi = self.obs.data_range
        grey = torch.full((self.obs.batch_size, *self.obs.input_shape), (lo + hi) / 2, device=self.obs.device,
                          dtype=self.obs.dtype)
        with torch.enable_grad():
            _, value = self.objective(grey, result.labels)
        grey_match = float(value.detach())
        result.trace["grey_match"] = grey_match
        if math.isfinite(grey_match) and not final < grey_match:
            result.trace["chance"] = (f"ended no better than a grey image: gradient distance {final:.4g}, a grey "
                                      f"image's {grey_match:.4g}; these images are no evidence of leakage")

    def _start(self, gen, shape, init) -> torch.Tensor:
        if init is not None:
            return init.detach().clone().to(self.obs.device, self.obs.dtype)
        return initial_images(shape, self.s.init, self.obs.data_range, generator=gen,
                              device=self.obs.device, dtype=self.obs.dtype, std=self.s.init_std)

    def _run_sequential(self, labels, gen, shape, init, callback, progress) -> MatchResult:
        s, obs = self.s, self.obs
        best = (math.inf, torch.empty(0), torch.empty(0))
        history: list[list[float]] = []
        finals: list[float] = []
        phase_one = int(s.feature_phase * s.iterations) if self._feature_target is not None else 0
        feature_curve: list[float] = []
        stopped: str | None = None
        for r in range(s.restarts):
            x = self._start(gen, shape, init if r == 0 else None).requires_grad_(True)
            variables = [x]
            label_logits = None
            if s.soft_labels:
                label_logits = torch.randn((obs.batch_size, obs.num_classes), generator=gen).to(
                    obs.device, obs.dtype).requires_grad_(True)
                variables.append(label_logits)
            curve: list[float] = []
            if s.optimizer == "lbfgs":
                opt = torch.optim.LBFGS(variables, lr=self.lr, max_iter=s.lbfgs_max_iter,
                                        line_search_fn="strong_wolfe")
            elif s.optimizer == "adam":
                opt = torch.optim.Adam(variables, lr=self.lr)
            else:
                opt = torch.optim.SGD(variables, lr=self.lr, momentum=0.9)
            sched = step_schedule(opt, s.schedule, s.iterations)
            try:
                self._steps_of(r, x, variables, labels, label_logits, opt, sched, phase_one, curve, feature_curve,
                               callback, progress)
            except _Interrupted as stop:  # Ctrl-C where a caller keeps partial results: the best so far
                stopped, last_match = stop.where, stop.last_match
                final_labels = label_logits.detach().argmax(-1) if label_logits is not None else labels
                if r == 0 or not math.isfinite(best[0]) or last_match < best[0]:
                    best = (last_match, x.detach().clone(), final_labels.detach().clone())
                finals.append(last_match)
                history.append(curve)
                break
            with torch.enable_grad():
                _, match = self.objective(x, self.targets(labels, label_logits))
            final = float(match.detach())
            finals.append(final)
            history.append(curve)
            final_labels = (label_logits.detach().argmax(-1) if label_logits is not None else labels)
            if r == 0 or (math.isfinite(final) and final < best[0]):
                best = (final, x.detach().clone(), final_labels.detach().clone())
        chosen = finals.index(best[0]) if best[0] in finals else 0
        trace = {"loss": history[chosen],
                 "restart_losses": finals, "iterations": s.iterations, "restarts": s.restarts, "tv": s.tv,
                 "trace_every": s.trace_every, "final_match": best[0]}
        if phase_one:  # the loss curve starts after the feature-only steps; their feature term (all restarts)
            trace.update(feature_steps=phase_one, feature_loss=feature_curve)
        if stopped is not None:
            trace["partial"] = stopped
        return MatchResult(images=best[1], labels=best[2], trace=trace)

    def _steps_of(self, r, x, variables, labels, label_logits, opt, sched, phase_one, curve, feature_curve,
                  callback, progress) -> None:
        """The optimisation steps of restart ``r`` (``curve``, ``feature_curve`` filled in place); a Ctrl-C
        becomes :class:`_Interrupted` when the caller keeps partial results (:func:`~leakbench.progress.keep_partial`)."""
        s = self.s
        total_steps = s.iterations * s.restarts
        last_match, step = math.inf, 0
        try:
            for step in range(s.iterations):
                full = step >= phase_one  # the first steps match the recovered features only
                if s.optimizer == "lbfgs":
                    def closure():
                        opt.zero_grad(set_to_none=True)
                        total, _ = self.objective(x, self.targets(labels, label_logits), match=full)
                        grads = torch.autograd.grad(total, variables)
                        for v, g in zip(variables, grads):
                            v.grad = g
                        return total
                    opt.step(closure)
                    self._clamp(x)
                    if step % s.trace_every == 0 or step == s.iterations - 1:
                        with torch.enable_grad():
                            _, match = self.objective(x, self.targets(labels, label_logits), match=full)
                        last_match = float((match if full else self._feature_value).detach())
                else:
                    total, match = self.objective(x, self.targets(labels, label_logits), match=full)
                    grads = torch.autograd.grad(total, variables)
                    for v, g in zip(variables, grads):
                        v.grad = g.sign() if (s.signed and v is x) else g
                    opt.step()
                    self._clamp(x)
                    if step % s.trace_every == 0 or step == s.iterations - 1:
                        last_match = float((match if full else self._feature_value).detach())
                if sched is not None:
                    sched.step()
                if step % s.trace_every == 0 or step == s.iterations - 1:
                    if not math.isfinite(last_match):
                        break
                    (curve if full else feature_curve).append(last_match)
                    if callback is not None:
                        callback(r * s.iterations + step, x.detach())
                if progress is not None:  # every step: a slow model still reports (and meets its deadline)
                    progress(r * s.iterations + step + 1, total_steps, last_match)
        except KeyboardInterrupt:
            where = f"interrupted at step {step + 1} of {s.iterations}" + (
                f" (restart {r + 1} of {s.restarts})" if s.restarts > 1 else "")
            if not keep_here(where):
                raise
            raise _Interrupted(where, last_match) from None

    def _run_batched(self, labels, gen, shape, init, callback, progress) -> MatchResult:
        s = self.s
        starts = [self._start(gen, shape, init if r == 0 else None) for r in range(s.restarts)]
        xs = torch.stack(starts).requires_grad_(True)
        opt = (torch.optim.Adam([xs], lr=self.lr) if s.optimizer == "adam"
               else torch.optim.SGD([xs], lr=self.lr, momentum=0.9))
        sched = step_schedule(opt, s.schedule, s.iterations)
        curve: list[list[float]] = []
        matches = None
        for step in range(s.iterations):
            grad, matches = self._batched_objective(xs.detach(), labels)
            self.apply_step(xs, grad, opt, sched)
            if step % s.trace_every == 0 or step == s.iterations - 1:
                values = matches.detach().tolist()
                curve.append(values)
                best_r = int(torch.tensor(values).argmin())
                if callback is not None:
                    callback(step, xs[best_r].detach())
            if progress is not None:  # every step (the loss as last traced)
                progress(step + 1, s.iterations, min(curve[-1]))
        _, matches = self._batched_objective(xs.detach(), labels)
        finals = matches.detach().tolist()
        best_r = int(torch.tensor(finals).argmin())
        trace = {"loss": [c[best_r] for c in curve], "restart_losses": finals, "iterations": s.iterations,
                 "restarts": s.restarts, "tv": s.tv, "trace_every": s.trace_every, "final_match": finals[best_r],
                 "batched": True}
        return MatchResult(images=xs[best_r].detach().clone(), labels=labels, trace=trace)



class MaskedMatcher(GradientMatcher):
    """Gradient matching with the simulated gradient multiplied entry-wise by fixed 0/1 masks."""

    def __init__(self, obs: Observation, settings: MatchingSettings, masks: list[torch.Tensor]) -> None:
        super().__init__(obs, dataclasses.replace(settings, factorise="off"))
        self.masks = [m.to(obs.device, obs.dtype) for m in masks]

    def shared_of(self, x, target):
        return [g * m for g, m in zip(super().shared_of(x, target), self.masks)]


__all__ = ["GradientMatcher", "MaskedMatcher"]
