"""Reading an observation: the shared tensor of each parameter of the model, and the model as the attacker runs it.

``Observation.shared[i]`` belongs to the parameter named ``Observation.param_names[i]`` (the
gradient, or the update θ_k − θ_0 for ``kind="update"``, which ``Observation.gradients`` turns
back into the average gradient ÷ −lr·k).  Every attack reads it through the functions here:

* :func:`param_index` — id(parameter of ``obs.model``) → its position in ``obs.shared``;
* :func:`shared_gradient` — the gradient of one parameter (None when it is not shared);
* :func:`layer_gradients` — the weight and bias gradients of one layer;
* :func:`attacker_model`, :func:`block_input` — a frozen copy of the model in the client's mode and
  the (differentiable) input of one of its modules;
* :func:`output_gradients` — what one layer's output gradient would be for each of some inputs alone, under
  each candidate label (the per-sample prediction the malicious-server attacks check their slots against).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..errors import UnsupportedThreatModel
from ..threat import Observation

__all__ = ["param_index", "shared_gradient", "layer_gradients", "attacker_model", "block_input",
           "bin_differences", "output_gradients"]


def param_index(obs: Observation) -> dict[int, int]:
    """id(parameter of ``obs.model``) → its index in ``obs.shared``."""
    position = {n: i for i, n in enumerate(obs.param_names)}
    return {id(p): position[n] for n, p in obs.model.named_parameters() if n in position}


def shared_gradient(obs: Observation, param: torch.Tensor, *, grads: list[torch.Tensor] | None = None,
                    index: dict[int, int] | None = None) -> torch.Tensor | None:
    """The shared gradient (or update ÷ −lr·k) of parameter ``param`` of ``obs.model``; None if not shared.

    ``grads`` (``obs.gradients``) and ``index`` (:func:`param_index`) may be passed to avoid recomputing them.
    """
    index = param_index(obs) if index is None else index
    if id(param) not in index:
        return None
    return (obs.gradients if grads is None else grads)[index[id(param)]]


def layer_gradients(obs: Observation, layer: nn.Module, grads: list[torch.Tensor], index: dict[int, int],
                    dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shared gradient of ``layer``'s weight and bias (None without bias) in ``dtype``."""
    if id(layer.weight) not in index:
        raise UnsupportedThreatModel(f"the weight of {layer} is not among the shared gradients")
    gw = grads[index[id(layer.weight)]].to(dtype)
    gb = None
    if layer.bias is not None and id(layer.bias) in index:
        gb = grads[index[id(layer.bias)]].to(dtype)
    return gw, gb


def attacker_model(obs: Observation) -> nn.Module:
    """A frozen copy of ``obs.model`` in the client's mode, without running-statistics side effects."""
    model = copy.deepcopy(obs.model)
    model.train(obs.train_mode)
    for p in model.parameters():
        p.requires_grad_(False)
    if obs.train_mode:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.track_running_stats = False
                m.running_mean = m.running_var = None
    return model


class _Stop(Exception):
    pass


def block_input(model: nn.Module, module: nn.Module, x: torch.Tensor, *, stop: bool = True) -> torch.Tensor:
    """The (flattened) input of ``module`` when ``model`` runs on ``x``; differentiable.

    With ``stop`` the forward pass ends at ``module`` (nothing after it is computed).
    """
    seen: list[torch.Tensor] = []

    def hook(_m, inputs):
        seen.append(inputs[0])
        if stop:
            raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        model(x)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise UnsupportedThreatModel("the feature block is not on the model's forward path")
    return seen[0].reshape(seen[0].shape[0], -1)


def bin_differences(grad_w: torch.Tensor, grad_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(∇W_k − ∇W_{k+1}, ∇b_k − ∇b_{k+1}) for k = 0..K−1, with the (K+1)-th bin zero."""
    zero_w = torch.zeros_like(grad_w[:1])
    zero_b = torch.zeros_like(grad_b[:1])
    return grad_w - torch.cat([grad_w[1:], zero_w]), grad_b - torch.cat([grad_b[1:], zero_b])


def output_gradients(obs: Observation, layer: nn.Module, images: torch.Tensor, labels: torch.Tensor, *,
                     chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """((n, L, K) ∂ℓ(x_j, y_l)/∂z, (n, K) z > 0): the gradient of one sample's loss with respect to the output z
    of ``layer`` (K outputs) when ``obs.model`` runs on ``images[j]`` (n × d, flattened) alone with label
    ``labels[l]``, and which outputs are positive.  One forward pass per image, one backward pass per label
    through the part of the model after ``layer``; nothing of ``obs.model`` changes (no gradient is accumulated).
    """
    from ..losses import get_loss

    loss_fn = get_loss(obs.loss)
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda _m, _i, out: seen.append(out))
    grads, fired = [], []
    try:
        with torch.enable_grad():
            for s in range(0, images.shape[0], chunk):
                seen.clear()
                part = images[s:s + chunk].reshape(-1, *obs.input_shape)
                logits = obs.model(part)
                z = seen[0]
                per_label = []
                for i, y in enumerate(labels):
                    target = torch.full((part.shape[0],), int(y), dtype=torch.long, device=part.device)
                    loss = loss_fn(logits, target) * part.shape[0]  # the sum of per-sample losses
                    (g,) = torch.autograd.grad(loss, z, retain_graph=i + 1 < len(labels))
                    per_label.append(g.detach())
                grads.append(torch.stack(per_label, 1))
                fired.append(z.detach() > 0)
    finally:
        handle.remove()
    return torch.cat(grads), torch.cat(fired)
