"""Observations from what a user captured: a client's gradient or its model update, and input normalisation.

A user who runs their own federated set-up has a model and what one client sent (the
gradient of FedSGD, or θ_after − θ_before of FedAvg).  :func:`gradient_fields` and
:func:`update_fields` check them (as :func:`~leakbench.threat.observe` checks its inputs, with
the same :func:`check_model`) and return the fields of the observation, which
:meth:`Observation.from_gradients <leakbench.threat.Observation.from_gradients>` and
:meth:`~leakbench.threat.Observation.from_update` build; this module sits left of
:mod:`leakbench.threat` and never imports it.

Most pipelines normalise inputs, x̃ = (x − μ)/σ, inside the data loader.  Passing
``normalize=(μ, σ)`` makes that part of the threat model: the attacker's model becomes
``Normalize(μ, σ) → model``, so attacks search pixel space [0, 1] and return images a
person can look at, while the gradients are those of the user's model (the normalisation
has no parameters, so nothing changes in what was shared).
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .errors import ConfigError, expect, expect_same_shape
from .losses import get_loss
from .models.custom import Normalize
from .text_batch import check_token_labels, takes_tokens, text_grants

__all__ = ["with_normalization", "check_model", "non_finite_tensor", "out_dim", "gradient_fields", "update_fields"]


def with_normalization(model: nn.Module, normalize: tuple | None) -> nn.Module:
    """``Sequential(normalize=Normalize(μ, σ), model=copy of model)`` (a copy of ``model`` when ``normalize`` is None)."""
    if normalize is None:
        return copy.deepcopy(model)
    expect(isinstance(normalize, (tuple, list)) and len(normalize) == 2,
           f"expected normalize=(mean, std), got {normalize!r} (argument normalize)")
    param = next(model.parameters(), None)
    norm = Normalize(*normalize)
    if param is not None:
        norm = norm.to(device=param.device, dtype=param.dtype if param.is_floating_point() else torch.float32)
    wrapped = nn.Sequential(OrderedDict(normalize=norm, model=copy.deepcopy(model)))
    for name in ("input_shape", "spec", "build_options"):
        if hasattr(model, name):
            setattr(wrapped, name, getattr(model, name))
    return wrapped


def non_finite_tensor(named) -> tuple[str, int] | None:
    """(name, count) of the first floating tensor of ``(name, tensor)`` pairs holding NaN/inf; None if all finite."""
    for name, t in named:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.device.type != "meta":
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                return name, int((~finite).sum())
    return None


def check_model(model: nn.Module, field: str = "model") -> None:
    """Refuse a model with meta (data-less), sparse or non-finite parameters or buffers, naming the tensor."""
    expect(isinstance(model, nn.Module), f"expected a torch.nn.Module, got {type(model).__name__} (argument {field})")
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in tensors:
        expect(t.device.type != "meta", f"expected a model with materialised weights, got meta tensor {name!r} "
               f"(argument {field}); load its weights first (model.to_empty(device=...) + load_state_dict)")
        expect(t.layout == torch.strided, f"expected dense tensors, got a {t.layout} tensor {name!r} "
               f"(argument {field}); convert it with .to_dense()")
    bad = non_finite_tensor(tensors)
    expect(bad is None, lambda: f"expected finite weights, got {bad[1]} NaN/inf value(s) in {bad[0]!r} "
           f"(argument {field}); load or train a model whose weights are finite")


def out_dim(model: nn.Module, x: torch.Tensor) -> int:
    """The number of outputs (logits) of ``model`` on one input of ``x``, refusing a model that cannot run on it."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x[:1])
    except RuntimeError as err:
        raise ConfigError(f"the model cannot run on inputs of shape {tuple(x.shape[1:])}: "
                          f"{' '.join(str(err).split())[:200]} (argument model / x)") from None
    finally:
        model.train(was)
    expect(isinstance(out, torch.Tensor) and out.dim() >= 1,
           f"expected the model to return one tensor of logits B×K, got {type(out).__name__} (argument model); "
           "wrap it so forward returns the logits only")
    return int(out.shape[-1])


def _check_models(**models: nn.Module) -> None:
    """Each model (by argument name) materialised, dense and finite (:func:`check_model`)."""
    for field, model in models.items():
        check_model(model, field)


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    expect(len(named) > 0, "the model has no trainable parameters (argument model)")
    return named


def _tensors(values: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], named, what: str) -> list[torch.Tensor]:
    """The captured tensors in the model's parameter order, checked for presence, shape and finiteness."""
    if isinstance(values, Mapping):
        missing = [n for n, _ in named if n not in values]
        expect(not missing, f"expected a {what} for every trainable parameter, missing {missing[:3]}"
               f"{' …' if len(missing) > 3 else ''} (argument {what}s); keys are model.named_parameters() names")
        extra = sorted(set(values) - {n for n, _ in named})
        expect(not extra, f"unknown parameter name(s) {extra[:3]} in the {what}s; expected names of "
               "model.named_parameters()")
        out = [values[n] for n, _ in named]
    else:
        out = list(values)
        expect(len(out) == len(named), f"expected {len(named)} {what} tensors (one per trainable parameter, in "
               f"model.parameters() order), got {len(out)} (argument {what}s)")
    for (name, p), t in zip(named, out):
        expect(isinstance(t, torch.Tensor), f"expected a tensor for parameter {name!r}, got {type(t).__name__}")
        expect_same_shape(t, p, f"the {what} of {name!r}", f"argument {what}s")
    param = named[0][1]
    cast = [t.detach().to(device=param.device, dtype=param.dtype).clone() for t in out]
    for (name, _), t in zip(named, cast):  # after the cast to the model's dtype: 1e300 in float64 is inf in float32
        expect(bool(torch.isfinite(t).all()), f"expected finite values in the {what} of {name!r} in the model's "
               f"dtype {param.dtype}, got NaN/inf (argument {what}s)")
    return cast


def _input_shape(model: nn.Module, input_shape) -> tuple[int, ...]:
    shape = input_shape if input_shape is not None else getattr(model, "input_shape", None)
    expect(shape is not None and len(tuple(shape)) >= 1 and all(isinstance(s, int) and s > 0 for s in shape),
           f"expected input_shape as positive sizes (C, H, W) or (d,), got {shape!r} (argument input_shape; "
           "models built by leakbench.build carry it)")
    return tuple(shape)


def _labels(labels, batch_size: int, classes: int) -> torch.Tensor | None:
    if labels is None:
        return None
    y = torch.as_tensor(labels)
    expect(y.dim() == 1 and y.shape[0] == batch_size and not y.is_floating_point(),
           f"expected labels as {batch_size} integer class indices, got shape {tuple(y.shape)} dtype {y.dtype} "
           "(argument labels)")
    expect(int(y.min()) >= 0 and int(y.max()) < max(classes, 2),
           f"expected labels in 0..{max(classes, 2) - 1}, got range {int(y.min())}..{int(y.max())} (argument labels)")
    return y.long()


def _fields(kind, model, shared, *, batch_size, labels, loss, input_shape, normalize, train, defense,
            local_steps, local_lr, extras, local_batches=None) -> dict:
    get_loss(loss)
    expect(isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1,
           f"expected batch_size ≥ 1 (the number of samples behind the {kind}), got {batch_size!r} "
           "(argument batch_size)")
    attacker = with_normalization(model, normalize).train(train)
    param = next(attacker.parameters())
    text = normalize is None and takes_tokens(model)
    probe = torch.zeros((1, *input_shape), device=param.device, dtype=torch.int64 if text else param.dtype)
    try:
        classes = out_dim(attacker, probe)
    except RuntimeError as err:
        raise ConfigError(f"the model does not accept inputs of shape {input_shape}: {err} "
                          "(argument input_shape)") from None
    names = [("model." + n if normalize is not None else n) for n, _ in _trainable(model)]
    if text:  # token ids: next-token targets B × T or one class per sequence (leakbench.text_batch)
        extras = {**extras, "text": text_grants(model, input_shape[0])}
        if labels is not None:
            labels = torch.as_tensor(labels)
            check_token_labels(labels, probe.expand(batch_size, -1), classes)
            labels = labels.long()
    else:
        labels = _labels(labels, batch_size, classes)
    return dict(kind=kind, model=attacker, shared=shared, param_names=names, loss=loss,
                batch_size=batch_size, input_shape=input_shape, num_classes=classes,
                labels=labels, local_steps=local_steps, local_lr=local_lr,
                local_batches=local_batches, train_mode=train, defense=defense, extras=extras)


def gradient_fields(model: nn.Module, grads: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], *,
                    batch_size: int, labels=None, loss: str = "ce", input_shape=None, normalize=None,
                    train: bool = False, defense: str = "none") -> dict:
    """The checked fields of :meth:`Observation.from_gradients <leakbench.threat.Observation.from_gradients>`."""
    _check_models(model=model)
    named = _trainable(model)
    shared = _tensors(grads, named, "gradient")
    return _fields("gradient", model, shared, batch_size=batch_size, labels=labels, loss=loss,
                   input_shape=_input_shape(model, input_shape), normalize=normalize, train=train,
                   defense=defense, local_steps=1, local_lr=0.0, extras={"captured": True})


def _schedule(batch_size: int, epochs: int, minibatch: int, order) -> tuple[list[list[int]], str]:
    """The minibatches of ``epochs`` epochs, in ``order`` (one permutation of the slots per epoch) or unshuffled."""
    if order is None:
        perms = [list(range(batch_size))] * epochs
        known = "unshuffled (order=None)"
    else:
        perms = [[int(i) for i in torch.as_tensor(p).reshape(-1).tolist()] for p in order]
        expect(len(perms) == epochs, f"expected one permutation per epoch ({epochs}), got {len(perms)} (argument order)")
        for e, p in enumerate(perms):
            expect(sorted(p) == list(range(batch_size)),
                   f"expected order[{e}] to be a permutation of 0..{batch_size - 1} (argument order)")
        known = "known"
    return [p[i:i + minibatch] for p in perms for i in range(0, batch_size, minibatch)], known


def update_fields(model_before: nn.Module, model_after: nn.Module, *, batch_size: int, lr: float, steps: int = 1,
                  epochs: int | None = None, minibatch: int | None = None, order=None, labels=None, loss: str = "ce",
                  input_shape=None, normalize=None, train: bool = False, defense: str = "none") -> dict:
    """The checked fields of :meth:`Observation.from_update <leakbench.threat.Observation.from_update>`."""
    _check_models(model_before=model_before, model_after=model_after)
    named_before = _trainable(model_before)
    after = dict(model_after.named_parameters())
    expect(set(after) >= {n for n, _ in named_before},
           "expected model_after with the same parameters as model_before (argument model_after)")
    expect(isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr), f"expected lr > 0, got {lr!r} (argument lr)")
    extras: dict = {"captured": True}
    batches = None
    if epochs is not None:
        expect(isinstance(epochs, int) and epochs >= 1, f"expected epochs ≥ 1, got {epochs!r} (argument epochs)")
        mb = batch_size if minibatch is None else minibatch
        expect(isinstance(mb, int) and 1 <= mb <= batch_size,
               f"expected 1 ≤ minibatch ≤ batch_size ({batch_size}), got {minibatch!r} (argument minibatch)")
        steps = epochs * math.ceil(batch_size / mb)
        extras.update(epochs=epochs, minibatch=mb)
        if mb < batch_size:
            batches, extras["local_order"] = _schedule(batch_size, epochs, mb, order)
    else:
        expect(order is None, "order= describes minibatch epochs: pass epochs= and minibatch= with it (argument order)")
    expect(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1,
           f"expected steps ≥ 1 local SGD steps, got {steps!r} (argument steps)")
    for n, p in named_before:  # before the subtraction, which would broadcast a (1,) bias against (10,)
        expect_same_shape(after[n], p, f"model_after's {n!r} (model_before's shape)", "argument model_after")
    delta = {n: after[n].detach() - p.detach() for n, p in named_before}
    shared = _tensors(delta, named_before, "update")
    return _fields("update", model_before, shared, batch_size=batch_size, labels=labels, loss=loss,
                   input_shape=_input_shape(model_before, input_shape), normalize=normalize, train=train,
                   defense=defense, local_steps=steps, local_lr=float(lr), extras=extras,
                   local_batches=batches)
