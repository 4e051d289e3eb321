"""What an honest-but-curious server sees, and :func:`observe` to compute it.

In federated learning a client computes, on its private batch (x, y), either the
gradient of the mean training loss with respect to the model parameters
(FedSGD; Zhu et al. 2019, Geiping et al. 2020) or the parameter delta after
``local_steps`` of SGD (FedAvg; Geiping et al. 2020, Sec. 5).  The server
receives that quantity, possibly transformed by a defense, plus whatever the
threat model grants: the labels, the batch-norm statistics of the batch
(Liu et al. 2024, Sec. 4.3 assume them), the batch size.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from .defenses import parse as parse_defense
from .errors import ConfigError, expect
from .losses import get_loss

KINDS = ("gradient", "update", "weights")


@dataclass
class Observation:
    """The attacker's view of one client round.

    ``shared`` holds one tensor per trainable parameter of ``model`` (same order as
    ``param_names``): the gradient (``kind="gradient"``) or ``θ_k − θ_0``
    (``kind="update"``).  ``model`` carries the parameters the client started from.
    """

    kind: str
    model: nn.Module
    shared: list[torch.Tensor]
    param_names: list[str]
    loss: str
    batch_size: int
    input_shape: tuple[int, ...]
    num_classes: int
    labels: torch.Tensor | None = None
    bn_stats: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    local_steps: int = 1
    local_lr: float = 0.0
    train_mode: bool = False
    defense: str = "none"
    data_range: tuple[float, float] = (0.0, 1.0)
    extras: dict = field(default_factory=dict)

    @property
    def gradients(self) -> list[torch.Tensor]:
        """The shared tensors when they are gradients (the update ÷ −lr·k otherwise)."""
        if self.kind == "gradient":
            return self.shared
        expect(self.kind == "update", f"an observation of kind {self.kind!r} holds no gradient")
        scale = -1.0 / (self.local_lr * self.local_steps)
        return [s * scale for s in self.shared]

    @property
    def labels_known(self) -> bool:
        return self.labels is not None

    @property
    def device(self) -> torch.device:
        return self.shared[0].device if self.shared else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self.shared[0].dtype if self.shared else torch.float32

    def params(self) -> dict[str, torch.Tensor]:
        """name → tensor of the parameters the observation refers to (detached)."""
        named = dict(self.model.named_parameters())
        return {n: named[n].detach() for n in self.param_names}

    def to(self, device: "str | torch.device") -> "Observation":
        """A copy on ``device`` (model, shared tensors, labels and BN statistics)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self,
            model=copy.deepcopy(self.model).to(device),
            shared=[s.to(device) for s in self.shared],
            labels=move(self.labels),
            bn_stats=None if self.bn_stats is None else [(m.to(device), v.to(device)) for m, v in self.bn_stats],
        )


def _check_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    expect(isinstance(x, torch.Tensor) and x.dim() >= 2,
           f"expected x as a batch tensor B×C×H×W or B×d, got {type(x).__name__} "
           f"{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}".rstrip())
    expect(isinstance(y, torch.Tensor) and y.shape[0] == x.shape[0],
           f"expected y with one label per sample ({x.shape[0]}), got "
           f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__} (argument y)")
    shape = getattr(model, "input_shape", None)
    if shape is not None:
        expect(tuple(x.shape[1:]) == tuple(shape),
               f"expected inputs of shape {tuple(shape)} for this model, got {tuple(x.shape[1:])} "
               "(argument x; build the model with input_shape=data.shape)")


def _record_bn(model: nn.Module):
    stats: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, inputs, _output):
        (inp,) = inputs
        dims = [0] + list(range(2, inp.dim()))
        stats.append((inp.detach().mean(dims), inp.detach().var(dims, unbiased=False)))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return stats, handles


def observe(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss: str = "ce",
    local_steps: int = 0,
    local_lr: float = 0.1,
    train: bool = False,
    labels_known: bool = False,
    bn_stats: bool = False,
    defense: "str | object | None" = None,
    seed: int = 0,
) -> Observation:
    """Compute what the server sees when a client trains ``model`` on ``(x, y)``.

    ``local_steps=0`` shares the gradient of the mean loss (FedSGD); ``k ≥ 1``
    shares ``θ_k − θ_0`` after k full-batch SGD steps of size ``local_lr``.
    ``train=True`` runs the client's forward in training mode (batch-norm uses
    batch statistics; ``bn_stats=True`` then grants them to the attacker).
    ``defense`` is a spec such as ``"clip:4+noise:0.01"`` (seeded by ``seed``).
    The user's ``model`` is never modified.
    """
    _check_batch(model, x, y)
    loss_fn = get_loss(loss)
    expect(isinstance(local_steps, int) and local_steps >= 0,
           f"expected local_steps ≥ 0 (0 shares the gradient), got {local_steps!r}")
    expect(local_steps == 0 or local_lr > 0, f"expected local_lr > 0, got {local_lr!r}")
    expect(not bn_stats or train, "bn_stats=True needs train=True (batch statistics exist only in training mode)")
    defense_obj = parse_defense(defense)

    client = copy.deepcopy(model).to(x.device)
    client.train(train)
    named = [(n, p) for n, p in client.named_parameters() if p.requires_grad]
    expect(len(named) > 0, "the model has no trainable parameters")
    names = [n for n, _ in named]
    params = [p for _, p in named]
    start = [p.detach().clone() for p in params]

    stats, handles = _record_bn(client) if bn_stats else ([], [])
    try:
        if local_steps == 0:
            grads = torch.autograd.grad(loss_fn(client(x), y), params)
            shared = [g.detach() for g in grads]
        else:
            with torch.no_grad():
                current = [p.clone() for p in params]
            for step in range(local_steps):
                grads = torch.autograd.grad(loss_fn(client(x), y), params)
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.sub_(local_lr * g)
                if step == 0:
                    for h in handles:
                        h.remove()
                    handles = []
            shared = [(p.detach() - c) for p, c in zip(params, current)]
    finally:
        for h in handles:
            h.remove()

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    shared = defense_obj.apply_gradients(shared, generator=gen)

    attacker = copy.deepcopy(model).to(x.device)
    attacker.train(train)
    with torch.no_grad():
        for p, s in zip((p for p in attacker.parameters() if p.requires_grad), start):
            p.copy_(s)
    out_dim = _out_dim(attacker, x)
    return Observation(
        kind="gradient" if local_steps == 0 else "update",
        model=attacker,
        shared=shared,
        param_names=names,
        loss=loss,
        batch_size=int(x.shape[0]),
        input_shape=tuple(x.shape[1:]),
        num_classes=out_dim,
        labels=y.detach().clone() if labels_known else None,
        bn_stats=stats or None,
        local_steps=max(local_steps, 1),
        local_lr=float(local_lr) if local_steps else 0.0,
        train_mode=train,
        defense=defense_obj.spec,
    )


def _out_dim(model: nn.Module, x: torch.Tensor) -> int:
    was = model.training
    model.eval()
    with torch.no_grad():
        k = int(model(x[:1]).shape[-1])
    model.train(was)
    return k


__all__ = ["KINDS", "Observation", "observe", "ConfigError"]
