"""Label recovery from the last layer's gradient.

* Batch of one — iDLG (Zhao et al. 2019, Sec. 3): with cross-entropy, the
  last layer's gradient is ∇W = (p − e_c) hᵀ and ∇b = p − e_c, so the true class
  c is the only row with a negative coefficient.  With a bias, c = argmin ∇b;
  without one, the rows are all multiples of h and c is the row whose
  coefficient has the minority sign (h ≥ 0 after ReLU/sigmoid fixes the sign).
* Batches — label counts: for the mean loss ∇b_k = p̄_k − n_k / B, so
  n_k = B (p̄_k − ∇b_k).  The mean prediction p̄ is unknown to the attacker; like
  LLG* (Wainakh et al. 2022) we estimate it from the model's outputs on
  random inputs in the data box, and round with the largest remainder so the
  counts sum to B (every class with ∇b_k < 0 gets at least one).  Without a
  bias the row sums of ∇W play the role of ∇b, divided by the estimated mean
  feature sum.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedThreatModel
from ..threat import Observation


def last_linear(obs: Observation) -> tuple[nn.Linear, int, int | None]:
    """The last ``nn.Linear`` producing the outputs, with the indices of its weight and bias in ``obs.shared``."""
    linears = [m for m in obs.model.modules() if isinstance(m, nn.Linear) and m.out_features == obs.num_classes]
    if not linears:
        raise UnsupportedThreatModel("label recovery needs a final nn.Linear layer with one output per class")
    layer = linears[-1]
    ids = {id(p): i for i, p in enumerate(p for p in obs.model.parameters() if p.requires_grad)}
    w = ids.get(id(layer.weight))
    if w is None:
        raise UnsupportedThreatModel("the final linear layer's weight is not among the shared parameters")
    b = ids.get(id(layer.bias)) if layer.bias is not None else None
    return layer, w, b


def _last_layer_signal(obs: Observation) -> tuple[torch.Tensor, nn.Linear, bool]:
    """Per-class ∇b (or ∇W row sums when there is no bias) from the shared gradient."""
    layer, w, b = last_linear(obs)
    grads = obs.gradients
    if b is not None:
        return grads[b].reshape(-1), layer, True
    return grads[w].sum(dim=1), layer, False


def idlg(obs: Observation) -> torch.Tensor:
    """The label of a batch of one (iDLG), as a LongTensor of shape (1,)."""
    if obs.loss in ("logistic", "exponential"):
        signal, _, _ = _last_layer_signal(obs)
        # ∂ℓ/∂f = −y·(positive); a bias gradient (or a non-negative feature sum) has the sign of −y.
        return (signal.sum() < 0).long().reshape(1)
    layer, w, b = last_linear(obs)
    grads = obs.gradients
    if b is not None:
        return grads[b].reshape(-1).argmin().reshape(1)
    gw = grads[w]
    # Rows are c_k·h: project on the dominant right singular vector to read the coefficients c_k.
    _, _, vh = torch.linalg.svd(gw.double(), full_matrices=False)
    u = vh[0] if vh[0].sum() >= 0 else -vh[0]
    coeff = gw.double() @ u
    negative = coeff < 0
    if obs.num_classes > 2 and int(negative.sum()) == obs.num_classes - 1:
        return (~negative).nonzero()[0].reshape(1)
    return coeff.argmin().reshape(1)


@torch.no_grad()
def _mean_prediction(obs: Observation, layer: nn.Linear, *, samples: int, seed: int) -> tuple[torch.Tensor, float]:
    """Mean softmax output and mean feature sum of the model on random inputs in the data box."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lo, hi = obs.data_range
    x = (lo + (hi - lo) * torch.rand((samples, *obs.input_shape), generator=gen)).to(obs.device, obs.dtype)
    feats: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda m, i, o: feats.append(i[0].detach()))
    model = obs.model
    was = model.training
    buffers = [b.clone() for b in model.buffers()]
    model.train(obs.train_mode)  # as the client ran it: batch statistics in BN layers when it trained
    try:
        out = model(x)
    finally:
        handle.remove()
        model.train(was)
        for b, saved in zip(model.buffers(), buffers):  # no running-statistics side effects
            b.copy_(saved)
    probs = torch.softmax(out, dim=-1) if obs.loss == "ce" else out
    return probs.mean(0), float(feats[0].sum(1).mean()) if feats else 1.0


def label_counts(obs: Observation, *, samples: int = 64, seed: int = 0) -> torch.Tensor:
    """How many samples of each class the batch holds (LongTensor of shape (K,))."""
    if obs.loss not in ("ce", "mse"):
        raise UnsupportedThreatModel(f"batch label counting needs loss 'ce' or 'mse', got {obs.loss!r}; "
                                     "grant the labels with observe(..., labels_known=True)")
    B, K = obs.batch_size, obs.num_classes
    if B == 1:
        return torch.bincount(idlg(obs).cpu(), minlength=K)
    signal, layer, has_bias = _last_layer_signal(obs)
    p_mean, feat_sum = _mean_prediction(obs, layer, samples=samples, seed=seed)
    if not has_bias:
        signal = signal / (feat_sum if abs(feat_sum) > 1e-12 else 1.0)
    if obs.loss == "mse":
        signal = signal / 2.0
    estimate = (B * (p_mean - signal)).double().cpu().clamp_min(0)
    counts = estimate.floor().long()
    minimum = (signal.cpu() < 0).long()
    counts = torch.maximum(counts, minimum)
    while int(counts.sum()) > B:  # too many: take from the class with the largest surplus
        surplus = counts.double() - estimate
        spare = counts > minimum  # a class with ∇b_k < 0 keeps its one sample while others can give
        surplus[~spare if bool(spare.any()) else counts == 0] = -float("inf")
        counts[int(surplus.argmax())] -= 1
    remainder = estimate - counts.double()
    for _ in range(B - int(counts.sum())):
        k = int(remainder.argmax())
        counts[k] += 1
        remainder[k] -= 1.0
    return counts


def recover_labels(obs: Observation, *, samples: int = 64, seed: int = 0) -> torch.Tensor:
    """Labels for each batch slot: the granted ones, iDLG for one sample, else from the counts."""
    if obs.labels is not None:
        return obs.labels.clone()
    if obs.batch_size == 1:
        return idlg(obs).to(obs.device)
    counts = label_counts(obs, samples=samples, seed=seed)
    return torch.repeat_interleave(torch.arange(obs.num_classes), counts).to(obs.device)
