"""Reading a fully connected layer's rows as inputs: x = ∇W_k / ∇b_k for every sample alone on a row.

What ``trap-weights`` (Boenisch et al. 2023) and ``fishing`` (Wen et al. 2022) share: for z = W x + b followed by a
ReLU, a sample that alone activates row k in the batch is ∇W_k / ∇b_k exactly (docs of
:mod:`leakbench.attacks.gradient.trap_weights`).  :func:`read_rows` takes every row with a non-zero bias
gradient, merges rows that read the same input, proves which of them hold one sample alone (forward
consistency of their bias gradients with the shipped model, :func:`lone_scale`), and lays the results out as
slots, provably lone ones first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.sparse import csr_matrix
from torch import nn

from ...errors import NothingRecovered, expect
from ...threat import Observation
from ..base import Reconstruction
from ..observed import output_gradients, shared_gradient

__all__ = ["RowOptions", "read_rows", "lone_scale"]


@dataclass
class RowOptions:
    """Options of the attacks that read a layer's rows (``trap-weights``, ``fishing``)."""

    threshold: float = 1e-7   # a row is read when |∇b_k| > threshold · max_k |∇b_k|
    merge: float = 1e-4       # two rows read one sample when their inputs differ by ≤ merge·(hi − lo) RMS per pixel
    clamp: bool = True        # clamp reconstructions to the data range (exact ones already lie in it)
    #: relative tolerance of the lone-sample check |c·∂ℓ(x̂, y)/∂z_k − ∇b_k| ≤ consistency·|∇b_k|;
    #: None: 1e-5 below float64, 1e-9 in float64 (the measured spread is in docs/feature-attacks.md)
    consistency: float | None = None

    def check(self) -> None:
        expect(0 <= self.threshold < 1, f"expected 0 ≤ threshold < 1, got {self.threshold} (option threshold)")
        expect(0 < self.merge < 1, f"expected 0 < merge < 1, got {self.merge} (option merge)")
        expect(self.consistency is None or self.consistency > 0,
               f"expected consistency > 0 (or None for the dtype's default), got {self.consistency} "
               "(option consistency)")


def lone_scale(obs: Observation) -> tuple[float | None, str]:
    """(c, how) with ∇b_k = c·∂ℓ_i/∂z_k for a sample i alone on row k, or (None, why the check cannot apply)."""
    info = obs.extras.get("defense") or {}
    other = sorted(set(info) - {"secagg", "local"})
    if other or (obs.defense not in ("none", "", None) and not info):
        return None, f"defense {obs.defense!r} transforms the gradient: no slot is provably alone"
    if obs.kind == "update" and (obs.local_steps > 1 or (obs.local_batches is not None and len(obs.local_batches) > 1)):
        return None, (f"{obs.local_steps} local steps: the bias gradients sum several passes at moving weights, "
                      "no per-sample prediction")
    if obs.kind not in ("gradient", "update"):
        return None, f"a {obs.kind!r} observation holds no gradient"
    if obs.train_mode and any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout))
                              for m in obs.model.modules()):
        return None, "batch norm or dropout in training mode couples the samples: no per-sample prediction"
    secagg = info.get("secagg")
    if secagg is not None and secagg.get("reduce", "sum") == "sum":
        b = int(obs.extras.get("client_batch_size", obs.batch_size))
        return 1.0 / b, f"forward consistency of each cluster's bias gradients (secure aggregation: sum, c = 1/{b})"
    return 1.0 / obs.batch_size, f"forward consistency of each cluster's bias gradients (c = 1/{obs.batch_size})"


def _clusters(candidates: torch.Tensor, tol: float) -> np.ndarray:
    """Cluster label of every candidate: connected components of 'RMS difference ≤ tol'."""
    from scipy.sparse.csgraph import connected_components  # lazy: `import leakbench` skips scipy
    n = candidates.shape[0]
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    sq = candidates.pow(2).sum(1)
    dist = (sq[:, None] + sq[None, :] - 2 * candidates @ candidates.T).clamp_min(0) / candidates.shape[1]
    close = (dist <= tol ** 2).cpu().numpy()
    _, labels = connected_components(csr_matrix(close), directed=False)
    return labels


def _lone(options: RowOptions, obs: Observation, layer: nn.Linear, reps: torch.Tensor, members: list[torch.Tensor],
          grad_b: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(lone flags, labels (−1 where not lone), relative mismatch, how it was decided) per cluster."""
    n = reps.shape[0]
    scale, how = lone_scale(obs)
    none = torch.zeros(n, dtype=torch.bool), torch.full((n,), -1, dtype=torch.long), torch.full((n,), np.inf)
    if scale is None or n == 0:
        return (*none, how)
    dtype = obs.dtype
    kappa = options.consistency or (1e-9 if dtype == torch.float64 else 1e-5)
    if labels is None and obs.labels is not None:
        labels = obs.labels.detach().reshape(-1).unique().long()
    elif labels is None:
        labels = torch.arange(max(obs.num_classes, 2))
    predicted, fired = output_gradients(obs, layer, reps.to(dtype), labels.to(obs.device))  # (n, L, K), (n, K)
    predicted = predicted.double().cpu() * scale
    fired = fired.cpu()
    gb = grad_b.double().cpu()
    lo, hi = obs.data_range
    slack = kappa * (hi - lo)
    in_box = ((reps >= lo - slack) & (reps <= hi + slack)).all(1).cpu()
    best = torch.full((n,), np.inf, dtype=torch.float64)
    which = torch.zeros(n, dtype=torch.long)
    ok_fire = torch.ones(n, dtype=torch.bool)
    for c, rows in enumerate(members):
        rows = rows.cpu()
        rel = ((predicted[c][:, rows] - gb[rows]).abs() / gb[rows].abs()).amax(1)   # (L,)
        best[c], which[c] = rel.min(0)
        ok_fire[c] = bool(fired[c, rows].all())
    lone = (best <= kappa) & in_box & ok_fire
    labels_out = torch.where(lone, labels.cpu()[which], torch.full_like(which, -1))
    return lone, labels_out, best, how


def read_rows(obs: Observation, layer: nn.Linear, options: RowOptions, *, name: str,
              labels: torch.Tensor | None = None) -> Reconstruction:
    """Slots read from ``layer``'s rows (see the module docstring) by attack ``name``; ``labels``: the candidate
    labels of the lone check (default: the granted labels, else every class)."""
    grad_w = shared_gradient(obs, layer.weight).detach().double()
    grad_b = shared_gradient(obs, layer.bias).detach().double()
    size = grad_b.abs()
    top = float(size.max()) if size.numel() else 0.0
    if top == 0.0:
        raise NothingRecovered(f"{name} found no neuron with a non-zero bias gradient: no row of the layer it reads "
                               "fired for any sample, it determined nothing from this observation")
    rows = (size > options.threshold * top).nonzero().reshape(-1)
    candidates = grad_w[rows] / grad_b[rows, None]
    lo, hi = obs.data_range
    cluster = torch.as_tensor(_clusters(candidates, options.merge * (hi - lo)))
    members, reps, strength = [], [], []
    for c in range(int(cluster.max()) + 1):
        idx = (cluster == c).nonzero().reshape(-1)
        best = idx[size[rows[idx]].argmax()]
        members.append(rows[idx])
        reps.append(candidates[best])
        strength.append(float(size[rows[best]]))
    reps_t = torch.stack(reps)
    lone, labels, mismatch, how = _lone(options, obs, layer, reps_t, members, grad_b, labels)
    counts = torch.tensor([len(m) for m in members], dtype=torch.float64)
    strength_t = torch.tensor(strength, dtype=torch.float64)
    # lone first (strongest first), then more rows, then stronger
    order = sorted(range(len(members)), key=lambda c: (not bool(lone[c]), -float(counts[c]), -strength[c]))
    order = order[: obs.batch_size]
    images = reps_t[order]
    confidence = lone[order].double()
    n = len(order)
    if n < obs.batch_size:
        repeat = torch.arange(obs.batch_size - n) % n
        images = torch.cat([images, images[repeat]])
        confidence = torch.cat([confidence, torch.zeros(obs.batch_size - n, dtype=torch.float64)])
    images = images.reshape(obs.batch_size, *obs.input_shape)
    if options.clamp:
        images = images.clamp(lo, hi)
    trace = {"rows": int(layer.out_features), "rows_read": int(rows.numel()), "clusters": len(members),
             "slots": n, "padded": max(obs.batch_size - n, 0), "lone": int(lone.sum()),
             "rows_per_slot": counts[order].tolist(), "lone_labels": labels[order].tolist(),
             "lone_mismatch": [float(v) for v in mismatch[order]], "lone_check": how,
             "strength": strength_t[order].tolist(),
             "confidence": "1 = the slot's sample provably alone on its rows (exact); 0 = a mixture, or not "
                           "provable"}
    return Reconstruction(images=images.to(obs.dtype).to(obs.device).detach(),
                          confidence=confidence.to(obs.dtype).to(obs.device), trace=trace)
