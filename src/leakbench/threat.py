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
import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from .budget import memory_available
from .captured import check_model, gradient_fields, non_finite_tensor, out_dim, update_fields
from .defenses import parse as parse_defense
from .defenses import extend_model, share
from .errors import ConfigError, expect, expect_same_shape
from .losses import get_loss
from .text_batch import check_token_batch, check_token_labels, takes_tokens, text_grants

KINDS = ("gradient", "update", "weights")


@dataclass
class Observation:
    """The attacker's view of one client round.

    ``shared`` holds one tensor per trainable parameter of ``model`` (same order as
    ``param_names``): the gradient (``kind="gradient"``) or ``θ_k − θ_0``
    (``kind="update"``).  ``model`` carries the parameters the client started from.
    An update's ``local_steps`` SGD steps of size ``local_lr`` ran on the whole batch, or on the
    minibatches ``local_batches`` (slot indices per step) as the server takes them to be: the
    client's order when it is known (no shuffling, or a user who captured their own round),
    otherwise the unshuffled order of the same sizes (``extras["local_order"]`` says which).
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
    local_batches: list[list[int]] | None = None
    train_mode: bool = False
    defense: str = "none"
    data_range: tuple[float, float] = (0.0, 1.0)
    extras: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """An observation is consistent and finite, or it says which tensor is not (no silent NaN downstream)."""
        expect(self.kind in KINDS, f"expected an observation kind in {KINDS}, got {self.kind!r} (field kind)")
        expect(len(self.shared) == len(self.param_names),
               f"expected one shared tensor per parameter name ({len(self.param_names)}), got {len(self.shared)} "
               "(field shared)")
        named = dict(self.model.named_parameters())
        for name, t in zip(self.param_names, self.shared):
            expect(isinstance(t, torch.Tensor), f"expected a tensor for parameter {name!r}, got {type(t).__name__} "
                   "(field shared)")
            p = named.get(name)
            expect(p is not None, f"expected shared tensors named after the model's parameters, got {name!r} "
                   "(field param_names)")
            expect_same_shape(t, p, f"the shared tensor of {name!r} (the parameter's shape)", "field shared")
        if self.labels is not None:
            expect(isinstance(self.labels, torch.Tensor) and self.labels.dim() in (1, 2)
                   and self.labels.shape[0] == self.batch_size,
                   lambda: f"expected labels with one entry per sample ({self.batch_size}), got shape "
                   f"{tuple(getattr(self.labels, 'shape', ()))} (field labels)")
        for i, (mean, var) in enumerate(self.bn_stats or []):
            expect_same_shape(var, mean, "the BN variance (the mean's shape)", f"field bn_stats[{i}]")
        bad = non_finite_tensor(zip(self.param_names, self.shared))
        expect(bad is None, lambda: f"expected finite shared {self.kind} values, got {bad[1]} NaN/inf value(s) in "
               f"{bad[0]!r} (field shared; defense {self.defense!r}): the client's round overflowed — lower the "
               "learning rate, steps or noise")
        check_model(self.model)

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

    def to(self, device: str | torch.device) -> Observation:
        """A copy on ``device`` (model, shared tensors, labels and BN statistics)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self,
            model=copy.deepcopy(self.model).to(device),
            shared=[s.to(device) for s in self.shared],
            labels=move(self.labels),
            bn_stats=None if self.bn_stats is None else [(m.to(device), v.to(device)) for m, v in self.bn_stats],
        )

    @classmethod
    def from_gradients(cls, model: nn.Module, grads, *, batch_size: int, labels=None, loss: str = "ce",
                       input_shape=None, normalize=None, train: bool = False, defense: str = "none") -> Observation:
        """An observation of the gradient ``grads`` a client computed on ``batch_size`` samples at ``model``'s weights.

        ``grads``: one tensor per trainable parameter — a list in ``model.parameters()`` order, or a
        mapping from ``model.named_parameters()`` names (as ``{n: p.grad for n, p in ...}``) — of the
        *mean* loss over the batch, as ``loss.backward()`` gives it.  ``labels`` grants the batch's
        labels; ``normalize=(mean, std)`` (see :mod:`leakbench.captured`); ``defense`` records what the
        client applied (it is not applied again).  Equals :func:`observe` on the same batch (tested).
        """
        return cls(**gradient_fields(model, grads, batch_size=batch_size, labels=labels, loss=loss,
                                     input_shape=input_shape, normalize=normalize, train=train, defense=defense))

    @classmethod
    def from_update(cls, model_before: nn.Module, model_after: nn.Module, *, batch_size: int, lr: float,
                    steps: int = 1, epochs: int | None = None, minibatch: int | None = None, order=None,
                    labels=None, loss: str = "ce", input_shape=None, normalize=None, train: bool = False,
                    defense: str = "none") -> Observation:
        """An observation of the update θ_after − θ_before a client sent after local SGD on ``batch_size`` samples.

        The client ran ``steps`` SGD steps of size ``lr`` on its whole batch (FedAvg's local
        aggregation as :func:`observe` simulates it with ``local_steps``), or ``epochs`` epochs in
        minibatches of ``minibatch`` (FedAvg's client, Dimitrov et al. 2022):
        steps = epochs·⌈batch_size/minibatch⌉, the minibatches taken in ``order`` (one permutation of
        the samples per epoch, as a data loader drew them, when the client knows it) or unshuffled.
        The update-matching attacks simulate exactly those minibatch steps (``Observation.local_batches``).
        """
        return cls(**update_fields(model_before, model_after, batch_size=batch_size, lr=lr, steps=steps,
                                   epochs=epochs, minibatch=minibatch, order=order, labels=labels, loss=loss,
                                   input_shape=input_shape, normalize=normalize, train=train, defense=defense))


def _check_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    expect(isinstance(x, torch.Tensor) and x.dim() >= 2,
           f"expected x as a batch tensor B×C×H×W or B×d, got {type(x).__name__} "
           f"{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}".rstrip())
    expect(isinstance(y, torch.Tensor) and y.dim() >= 1,
           f"expected y with one label per sample ({x.shape[0]}), got "
           f"{'a 0-d tensor' if isinstance(y, torch.Tensor) else type(y).__name__} (argument y); pass y.reshape(-1)")
    expect(x.device.type != "meta" and y.device.type != "meta",
           "expected a batch with data, got meta tensors (argument x / y)")
    expect(y.shape[0] == x.shape[0],
           f"expected y with one label per sample ({x.shape[0]}), got "
           f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__} (argument y)")
    shape = getattr(model, "input_shape", None)
    if shape is not None:
        expect(tuple(x.shape[1:]) == tuple(shape),
               f"expected inputs of shape {tuple(shape)} for this model, got {tuple(x.shape[1:])} "
               "(argument x; build the model with input_shape=data.shape)")


def _check_values(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Refuse an empty batch, non-finite or integer pixels and non-index labels; ``x`` in the model's dtype.

    A float ``x`` of another precision than the model's parameters (float64 pixels, float32 model) is
    converted to the parameters' dtype, as a client's training loop would; nothing else is converted.
    """
    expect(x.shape[0] > 0, f"expected a batch of at least one sample, got an empty batch of shape {tuple(x.shape)} "
           "(argument x)")
    expect(x.is_floating_point(), f"expected float pixels in [0, 1], got dtype {x.dtype} (argument x); "
           "convert with x.float() / 255")
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is not None and x.dtype != param.dtype:  # checked after the cast: 1e300 in float64 is inf in float32
        x = x.to(param.dtype)
    finite = torch.isfinite(x)
    expect(bool(finite.all()), f"expected finite values, got {int((~finite).sum())} NaN/inf value(s) in x "
           "(argument x); clean the batch")
    expect(y.dtype != torch.bool and not y.is_complex(),
           f"expected integer class indices, got dtype {y.dtype} (argument y); pass y.long()")
    expect(y.is_floating_point() or y.dim() == 1,
           f"expected class indices of shape ({x.shape[0]},), got shape {tuple(y.shape)} (argument y)")
    if y.is_floating_point():
        finite = torch.isfinite(y)
        expect(bool(finite.all()), f"expected finite targets, got {int((~finite).sum())} NaN/inf value(s) in y "
               "(argument y)")
    return x


def _check_labels(y: torch.Tensor, outputs: int, loss: str) -> None:
    """Labels the loss can take for a model with ``outputs`` outputs (a one-line error otherwise).

    Class indices 0..K−1 (0/1 for the ±1 losses); float targets only where :mod:`leakbench.losses`
    takes them: soft targets B×K for ``ce``/``mse``, values ±1 (B or B×1) for ``logistic``/``exponential``.
    """
    binary = loss in ("logistic", "exponential")
    expect(not binary or outputs == 1,
           f"loss {loss!r} takes ±1 labels and a model with 1 output, got a model with {outputs} outputs "
           "(argument loss); use loss='ce' or build the model with classes=1")
    expect(binary or loss != "ce" or outputs > 1,
           "loss 'ce' on a model with 1 output: its loss and gradient are exactly 0, nothing is shared to attack "
           "(argument loss); give the model ≥ 2 outputs (a dataset with ≥ 2 classes, or your own class with "
           "num_classes in its options) or use loss='logistic'")
    if y.is_floating_point():
        b = y.shape[0]
        if binary:
            expect(y.numel() == b and bool((y.abs() == 1).all()),
                   f"expected float targets ±1 of shape ({b},) for loss {loss!r}, got shape {tuple(y.shape)} "
                   "with other values (argument y); pass class indices 0/1")
        else:
            expect(y.dim() == 2 and y.shape[1] == outputs,
                   f"expected class indices (integers) or soft targets of shape ({b}, {outputs}), got float "
                   f"targets of shape {tuple(y.shape)} (argument y); pass y.long() for class indices")
        return
    high = 1 if binary else outputs - 1
    lo, hi = int(y.min()), int(y.max())
    expect(lo >= 0 and hi <= high, f"expected labels in 0..{high} (the model has {outputs} output"
           f"{'s' if outputs > 1 else ''}{', labels 0/1 mean −1/+1' if binary else ''}), got range {lo}..{hi} "
           "(argument y)")


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
    local_batch: int | None = None,
    local_shuffle: bool = False,
    train: bool = False,
    labels_known: bool = False,
    bn_stats: bool = False,
    defense: str | object | None = None,
    population: object | None = None,
    seed: int = 0,
) -> Observation:
    """Compute what the server sees when a client trains ``model`` on ``(x, y)``.

    ``local_steps=0`` shares the gradient of the mean loss (FedSGD); ``k ≥ 1``
    shares ``θ_k − θ_0`` after k full-batch SGD steps of size ``local_lr``, or — with ``local_batch=b``
    — after k epochs of minibatch SGD over the batch (FedAvg's client, Dimitrov et al. 2022),
    reshuffled every epoch with ``local_shuffle`` (the same as ``defense="local:k,lr,b,shuffle"``).
    ``train=True`` runs the client's forward in training mode (batch-norm uses
    batch statistics; ``bn_stats=True`` then grants them to the attacker).
    ``defense`` is a spec such as ``"clip:4+noise:0.01"`` (seeded by ``seed``),
    applied where it belongs in the client's round (:func:`leakbench.defenses.share`):
    ``local:k,lr`` makes the observation an update, ``secagg:L`` needs ``population``
    (an ImageDataset the other clients' batches are drawn from) and observes the
    aggregate of all L batches (``batch_size`` L·B, the target batch first).
    What the server knows about the defense is in ``extras["defense"]``.
    ``x`` may be token ids B × T (int64) for a text model (:mod:`leakbench.text_batch`): ``y`` then holds
    next-token targets B × T (−100 where none) or one class per sequence, and ``extras["text"]`` states
    what the server is granted (tokenizer and vocabulary, the padded length, each sequence's length).
    The user's ``model`` is never modified.  Bad input is refused before any work with a
    :class:`~leakbench.errors.ConfigError` naming the argument (an empty batch, NaN/inf or integer
    pixels, labels that are neither class indices of the model's outputs nor the float targets the
    loss takes, a ±1 loss on a multi-output model); a float ``x`` of another precision than the model
    is converted to the model's dtype.
    """
    check_model(model)
    text = isinstance(x, torch.Tensor) and not x.is_floating_point() and takes_tokens(model)
    if text:  # token ids B × T (leakbench.text_batch); images go on as before
        expect(isinstance(y, torch.Tensor), f"expected targets as a tensor, got {type(y).__name__} (argument y)")
        check_token_batch(model, x)
    else:
        _check_batch(model, x, y)
        x = _check_values(model, x, y)
    loss_fn = get_loss(loss)
    expect(isinstance(local_steps, int) and not isinstance(local_steps, bool) and local_steps >= 0,
           f"expected local_steps ≥ 0 (0 shares the gradient), got {local_steps!r}")
    expect(local_steps == 0 or (isinstance(local_lr, (int, float)) and math.isfinite(local_lr) and local_lr > 0),
           f"expected local_lr > 0 (finite), got {local_lr!r} (argument local_lr)")
    expect(not bn_stats or train, "bn_stats=True needs train=True (batch statistics exist only in training mode)")
    defense_obj = parse_defense(defense)

    _check_memory(model, x)
    try:
        return _observe(model, x, y, text=text, loss=loss, loss_fn=loss_fn, local_steps=local_steps,
                        local_lr=local_lr, local_batch=local_batch, local_shuffle=local_shuffle, train=train,
                        labels_known=labels_known, bn_stats=bn_stats, defense_obj=defense_obj, population=population,
                        seed=seed)
    except MemoryError:
        raise ConfigError("out of memory while observing: the model and batch do not fit in this process's memory "
                          "(argument model); use a smaller model or batch") from None
    except RuntimeError as err:
        text_ = str(err)
        if "can't allocate memory" in text_ or "out of memory" in text_ or "Tried to allocate" in text_:
            raise ConfigError(f"out of memory while observing ({' '.join(text_.split())[:160]}) (argument model); "
                              "use a smaller model or batch") from None
        raise


#: copies of the model's parameters an observation holds at once: the client's model, its starting point, the
#: gradients, the shared tensors and the attacker's model.
OBSERVE_COPIES = 5


def requery(x: torch.Tensor, y: torch.Tensor, *, seed: int = 0, **options):
    """The client as a callable, for a server that queries it again (multi-round attacks: ``fishing-rounds``).

    Each call ``query(model)`` observes the same batch ``(x, y)`` under the model the server ships, with
    :func:`observe`'s ``options`` (defense, local steps, …); call k draws its randomness (a defense's noise, the
    other clients' batches) from its own seed, derived from ``seed`` and k, as a client's next round would.  Set it
    as ``obs.extras["query"]`` of the first round's observation."""
    calls = [0]

    def query(model: nn.Module) -> Observation:
        calls[0] += 1
        return observe(model, x, y, seed=(int(seed) * 1_000_003 + calls[0]) % (2 ** 62), **options)

    return query


def _check_memory(model: nn.Module, x: torch.Tensor) -> None:
    """Refuse, before any copy, a model whose copies in :func:`observe` exceed the memory this process has left."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    need = OBSERVE_COPIES * params + 4 * x.numel() * x.element_size()
    available, what = memory_available()
    if need > available:
        raise ConfigError(f"expected the observation to fit in memory, got a model of {params / 2**30:.3g} GiB of "
                          f"parameters: about {need / 2**30:.3g} GiB for its {OBSERVE_COPIES} copies, "
                          f"{max(available, 0) / 2**30:.3g} GiB left under {what} (argument model); use a smaller "
                          "model or raise the limit")


def _observe(model, x, y, *, text, loss, loss_fn, local_steps, local_lr, local_batch, local_shuffle, train,
             labels_known, bn_stats, defense_obj, population, seed) -> Observation:
    # a defense that adds layers (PRECODE) extends the client's and the attacker's copy alike (seeded by ``seed``)
    client = extend_model(defense_obj, copy.deepcopy(model), seed=seed).to(x.device)
    if text:
        check_token_labels(y, x, out_dim(client, x))
    else:
        _check_labels(y, out_dim(client, x), loss)
    client.train(train)
    named = [(n, p) for n, p in client.named_parameters() if p.requires_grad]
    expect(len(named) > 0, "the model has no trainable parameters")
    start = {n: p.detach().clone() for n, p in named}

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    expect(local_batch is None or (isinstance(local_batch, int) and not isinstance(local_batch, bool)
                                   and local_batch >= 1),
           f"expected local_batch ≥ 1 (the minibatch size of the local epochs) or None, got {local_batch!r}")
    result = share(defense_obj, client, start, x, y, loss_fn, generator=gen, local_steps=local_steps,
                   local_lr=local_lr, local_batch=local_batch, local_shuffle=local_shuffle, population=population)

    attacker = extend_model(defense_obj, copy.deepcopy(model), seed=seed).to(x.device)
    attacker.train(train)
    with torch.no_grad():
        for p, s in zip((p for p in attacker.parameters() if p.requires_grad), start.values()):
            p.copy_(s)
    stats = _batch_norm_stats(model, result.x) if bn_stats else []
    extras: dict = {}
    if result.info:
        extras["defense"] = result.info
    if result.clients > 1:
        extras["clients"] = result.clients
        extras["client_batch_size"] = int(x.shape[0])
    batches = local_schedule(result, extras)
    if text:
        # every sequence behind the shared tensors (secagg: all L clients' batches, as batch_size counts them)
        extras["text"] = text_grants(model, int(x.shape[1]), result.x if result.x.shape[0] != x.shape[0] else x)
    return Observation(
        kind=result.kind,
        model=attacker,
        shared=result.tensors,
        param_names=list(start),
        loss=loss,
        batch_size=int(result.x.shape[0]),
        input_shape=tuple(x.shape[1:]),
        num_classes=out_dim(attacker, x),
        labels=result.y.detach().clone() if labels_known else None,
        bn_stats=stats or None,
        local_steps=result.local_steps,
        local_lr=result.local_lr,
        local_batches=batches,
        train_mode=train,
        defense=defense_obj.spec,
        extras=extras,
    )


def local_schedule(result, extras: dict) -> list[list[int]] | None:
    """The minibatches the server may assume for a round's local epochs (see :class:`Observation`)."""
    if result.batches is None:
        return None
    if result.clients > 1:  # each client stepped on its own minibatches: no one schedule of the aggregate
        extras["local_order"] = "per client (aggregate): simulated as full-batch steps"
        return None
    if not result.shuffled:
        extras["local_order"] = "known"
        return [list(b) for b in result.batches]
    extras["local_order"] = "shuffled by the client: the server assumes the unshuffled order"
    n, sizes = int(result.x.shape[0]), [len(b) for b in result.batches]
    out, pos = [], 0
    for size in sizes:
        out.append(list(range(pos, pos + size)))
        pos = (pos + size) % n
    return out


def _batch_norm_stats(model: nn.Module, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Mean and (biased) variance of the input of every batch-norm layer for the batch ``x`` at θ_0."""
    probe = copy.deepcopy(model).to(x.device).train(True)
    stats, handles = _record_bn(probe)
    try:
        with torch.no_grad():
            probe(x)
    finally:
        for h in handles:
            h.remove()
    return stats


__all__ = ["KINDS", "Observation", "observe", "requery"]


def observe_weights(
    model: nn.Module | object,
    *,
    input_shape: tuple[int, ...] | None = None,
    num_classes: int | None = None,
    data_range: tuple[float, float] | None = None,
    data_mean: torch.Tensor | None = None,
    margin: float | None = None,
) -> Observation:
    """What someone who downloads a trained model sees: its weights, no gradient (``kind="weights"``).

    ``model`` is a trained ``nn.Module`` or a :class:`~leakbench.models.targets.TrainedTarget`
    (whose input shape, output width, input box and centring mean are then taken from it).
    ``data_range`` is the box of the network's inputs (for centred data, the [0, 1] box
    shifted by the mean); ``data_mean`` grants the training mean the inputs were centred
    by (Haim et al. 2022 add it back to show reconstructions); ``margin`` grants the
    margin value (the univariate attack of the provable-attacks paper assumes it known).
    ``shared`` holds the parameters themselves; the model is copied, never modified.
    """
    target = None
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "model", None), nn.Module):
        target, model = model, model.model
    expect(isinstance(model, nn.Module),
           f"expected a trained torch.nn.Module or TrainedTarget, got {type(model).__name__} (argument model)")
    if target is not None:
        input_shape = input_shape or tuple(target.x.shape[1:])
        data_range = data_range or target.input_range
        data_mean = data_mean if data_mean is not None else target.mean
    input_shape = input_shape or getattr(model, "input_shape", None)
    expect(input_shape is not None and all(isinstance(s, int) and s > 0 for s in input_shape),
           f"expected input_shape as positive sizes (C, H, W) or (d,), got {input_shape!r} (argument input_shape)")
    input_shape = tuple(input_shape)
    data_range = tuple(data_range) if data_range is not None else (0.0, 1.0)
    expect(len(data_range) == 2 and float(data_range[0]) < float(data_range[1]),
           f"expected data_range (low, high) with low < high, got {data_range!r} (argument data_range)")
    expect(margin is None or float(margin) > 0, f"expected a positive margin, got {margin!r} (argument margin)")
    check_model(model)
    attacker = copy.deepcopy(model).eval()
    named = [(n, p) for n, p in attacker.named_parameters() if p.requires_grad]
    expect(len(named) > 0, "the model has no trainable parameters")
    first = named[0][1]
    if num_classes is None:
        with torch.no_grad():
            num_classes = int(attacker(torch.zeros((1, *input_shape), dtype=first.dtype, device=first.device)).shape[-1])
    extras: dict = {}
    if data_mean is not None:
        extras["data_mean"] = data_mean.detach().clone().reshape(1, *input_shape)
    if margin is not None:
        extras["margin"] = float(margin)
    return Observation(
        kind="weights",
        model=attacker,
        shared=[p.detach().clone() for _, p in named],
        param_names=[n for n, _ in named],
        loss="none",
        batch_size=0,
        input_shape=input_shape,
        num_classes=int(num_classes),
        data_range=(float(data_range[0]), float(data_range[1])),
        extras=extras,
    )


__all__ += ["observe_weights"]
