"""Model specs: short strings → models.

``build("cnn:3-6-1-0,4-3-2-0", input_shape=(3, 32, 32), classes=10, act="tanh")``
parses the spec, makes the architecture of :mod:`leakbench.models.zoo`,
initialises it from a local generator (:mod:`leakbench.models.init`) and
records how to rebuild it (``model.spec``, ``model.build_options``).

Spec grammar (whitespace and case are ignored)::

    mlp | mlp: | mlp:W1-W2-...        hidden widths (Haim et al. 2022: "mlp:1000-1000")
    cnn:k-c-s-p,k-c-s-p,...           kernel-channels-stride-padding per conv
                                      (Chen & Campbell 2022, Table 1)
    lenet                             sigmoid LeNet of DLG (Zhu et al. 2019)
    convnet | convnet-W               ConvNet of Inverting Gradients (Geiping et al. 2020)
    resnet18                          CIFAR ResNet-18 (option width=64)
    twolayer:M                        f(x) = Σ_j a_j σ(w_jᵀx + b_j), M hidden units
    gpt:layers=L,width=W,heads=H      causal text decoder (next-token logits; classes = vocabulary,
                                      input_shape = (context,)); keys optional (2, 64, 4)
    bert:layers=L,width=W,heads=H,vocab=V
                                      text encoder with a classification head (:mod:`.transformers`)
    module.path:ClassName             your own nn.Module subclass, imported (:mod:`.custom`)

The families live in the registry :data:`MODELS`; the CLI, sweeps and the
Python API all resolve names through it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from ..registry import Registry
from .custom import build_class, import_class, is_class_spec, normalized
from .init import check_init_scale, initialize, make_generator, resolve_init
from .layers import activation_factory, canonical_activation
from .size import check_size
from .transformers import TextTransformer
from .zoo import CNN, MLP, ConvLayerSpec, ConvNet, LeNet, ResNet18, TwoLayer, flat_size

__all__ = [
    "MODELS",
    "Family",
    "parse_spec",
    "build",
    "count_parameters",
    "describe",
    "LayerInfo",
]

MODELS: Registry[nn.Module] = Registry("model")

#: Options every family accepts besides its own.
COMMON_OPTIONS = ("negative_slope", "init_scale")


# --------------------------------------------------------------------------- parsing helpers


def _bad(spec: str, expected: str, got: str, where: str = "") -> ConfigError:
    suffix = f" ({where})" if where else ""
    return ConfigError(f"bad model spec {spec!r}: expected {expected}, got {got!r}{suffix}")


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _no_args(name: str) -> Callable[[str | None, str], tuple]:
    def parse(argstr: str | None, spec: str) -> tuple:
        if argstr:
            raise _bad(spec, f"{name!r} with no arguments", f"{name}:{argstr}")
        return ()

    return parse


def _parse_mlp(argstr: str | None, spec: str) -> tuple[int, ...]:
    if not argstr:
        return ()
    widths = []
    for i, part in enumerate(argstr.split("-"), start=1):
        w = _int(part)
        if w is None or w < 1:
            raise _bad(spec, "hidden widths as positive integers like mlp:1000-1000", argstr, f"width {i}: {part!r}")
        widths.append(w)
    return tuple(widths)


def _parse_cnn(argstr: str | None, spec: str) -> tuple[ConvLayerSpec, ...]:
    if not argstr:
        raise _bad(spec, "conv layers kernel-channels-stride-padding like cnn:3-6-1-0,4-3-2-0", spec)
    layers = []
    for i, part in enumerate(argstr.split(","), start=1):
        fields = part.split("-")
        nums = [_int(f) for f in fields]
        if len(fields) != 4 or any(n is None for n in nums):
            raise _bad(spec, "kernel-channels-stride-padding like 3-6-1-0", part, f"layer {i}")
        k, c, s, p = nums  # type: ignore[misc]
        for label, value, low in (("kernel", k, 1), ("channels", c, 1), ("stride", s, 1)):
            if value < low:
                raise _bad(spec, f"{label} ≥ {low} in kernel-channels-stride-padding", part, f"layer {i}")
        layers.append(ConvLayerSpec(k, c, s, p))
    return tuple(layers)


def _parse_width(default: int) -> Callable[[str | None, str], tuple[int]]:
    def parse(argstr: str | None, spec: str) -> tuple[int]:
        if argstr is None or argstr == "":
            return (default,)
        w = _int(argstr)
        if w is None or w < 1:
            raise _bad(spec, "a positive width like convnet-32", argstr)
        return (w,)

    return parse


def _parse_twolayer(argstr: str | None, spec: str) -> tuple[int]:
    m = _int(argstr or "")
    if m is None or m < 1:
        raise _bad(spec, "the number of hidden units like twolayer:1000", argstr or "")
    return (m,)


_TEXT_KEYS = {"gpt": {"layers": 2, "width": 64, "heads": 4}, "bert": {"layers": 2, "width": 64, "heads": 4, "vocab": 0}}


def _parse_text(name: str) -> Callable[[str | None, str], tuple]:
    """``gpt:layers=2,width=64,heads=4`` → ((key, value), ...) in the family's key order, defaults filled."""
    defaults = _TEXT_KEYS[name]

    def parse(argstr: str | None, spec: str) -> tuple:
        given: dict[str, int] = {}
        for part in (argstr or "").split(","):
            if not part:
                continue
            key, _, value = part.partition("=")
            if key not in defaults:
                raise _bad(spec, f"keys {', '.join(defaults)} like {name}:layers=2,width=64,heads=4", part)
            number = _int(value)
            if number is None or number < 1:
                raise _bad(spec, f"a positive integer for {key}", part)
            given[key] = number
        values = {**defaults, **given}
        if values.get("vocab") == 0:
            raise _bad(spec, f"the vocabulary size, e.g. {name}:vocab=2000", argstr or "")
        return tuple(values.items())

    return parse


def _format_text(name: str) -> Callable[[tuple], str]:
    return lambda args: f"{name}:" + ",".join(f"{k}={v}" for k, v in args)


def _make_text(causal: bool):
    def make(args, *, input_shape, classes, act, bias, pad_id):
        values = dict(args)
        if len(input_shape) != 1:
            raise ConfigError(f"expected input_shape (context,) for a text model, got {tuple(input_shape)} "
                              "(field input_shape; pass input_shape=data.shape of a text dataset)")
        vocab = classes if causal else values["vocab"]
        return TextTransformer(vocab, input_shape[0], classes, layers=values["layers"], width=values["width"],
                               heads=values["heads"], causal=causal, pad_id=pad_id, act=act)

    return make


# --------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """One model family: how its spec arguments parse, print and build."""

    name: str
    help: str
    parse: Callable[[str | None, str], tuple]
    format: Callable[[tuple], str]
    make: Callable[..., nn.Module]
    default_act: str = "relu"
    options: Mapping[str, Any] = field(default_factory=dict)
    dash_argument: bool = False  # accepts "name-N" as well as "name:N"

    def __call__(self, args: tuple = (), **build_options: Any) -> nn.Module:
        """Build this family with parsed ``args`` (``MODELS.create(name, args=..., ...)``)."""
        return build(self.format(tuple(args)), **build_options)

    def check_options(self, given: Mapping[str, Any], spec: str) -> dict[str, Any]:
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            known = ", ".join([*self.options, *COMMON_OPTIONS]) or "none"
            raise ConfigError(
                f"unknown option {', '.join(unknown)} for model {spec!r}; options of {self.name}: {known}"
            )
        merged = {**self.options, **given}
        for key, default in self.options.items():
            value = merged[key]
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"expected True or False for {key}, got {value!r} (model {spec!r})")
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int) or value < min(default, 1):
                    low = "a non-negative" if default == 0 else "a positive"
                    raise ConfigError(f"expected {low} integer for {key}, got {value!r} (model {spec!r})")
        return merged


def _make_mlp(args, *, input_shape, classes, act, bias):
    return MLP(flat_size(input_shape), args, classes, act=act, bias=bias["linear"])


def _make_cnn(args, *, input_shape, classes, act, bias):
    return CNN(input_shape, args, classes, act=act, conv_bias=bias["conv"], linear_bias=bias["linear"])


def _make_lenet(args, *, input_shape, classes, act, bias):
    return LeNet(input_shape, classes, act=act, conv_bias=bias["conv"], linear_bias=bias["linear"])


def _make_convnet(args, *, input_shape, classes, act, bias, norm):
    return ConvNet(
        input_shape, classes, width=args[0], act=act, norm=norm,
        conv_bias=bias["conv"], linear_bias=bias["linear"],
    )


def _make_resnet18(args, *, input_shape, classes, act, bias, width, norm):
    return ResNet18(
        input_shape, classes, width=width, act=act, norm=norm,
        conv_bias=bias["conv"], linear_bias=bias["linear"],
    )


def _make_twolayer(args, *, input_shape, classes, act, bias):
    return TwoLayer(flat_size(input_shape), args[0], classes, act=act, bias=bias["linear"])


_FAMILIES = (
    Family(
        "mlp", "fully connected net, mlp:W1-W2-... hidden widths (mlp = linear model)",
        _parse_mlp, lambda a: "mlp:" + "-".join(map(str, a)) if a else "mlp", _make_mlp,
    ),
    Family(
        "cnn", "convs kernel-channels-stride-padding + one linear layer (Chen & Campbell 2022)",
        _parse_cnn, lambda a: "cnn:" + ",".join(map(str, a)), _make_cnn,
    ),
    Family(
        "lenet", "sigmoid LeNet of DLG (Zhu et al. 2019), U(-0.5, 0.5) init",
        _no_args("lenet"), lambda a: "lenet", _make_lenet, default_act="sigmoid",
    ),
    Family(
        "convnet", "ConvNet of Inverting Gradients (Geiping et al. 2020), convnet-W (W=32)",
        _parse_width(32), lambda a: f"convnet-{a[0]}", _make_convnet,
        options={"norm": True}, dash_argument=True,
    ),
    Family(
        "resnet18", "CIFAR ResNet-18 (3x3 stem, no max-pool), option width=64",
        _no_args("resnet18"), lambda a: "resnet18", _make_resnet18,
        options={"width": 64, "norm": True},
    ),
    Family(
        "twolayer", "two-layer net sum_j a_j act(w_j.x + b_j), twolayer:M, no output bias",
        _parse_twolayer, lambda a: f"twolayer:{a[0]}", _make_twolayer,
    ),
    Family(
        "gpt", "causal text decoder, gpt:layers=2,width=64,heads=4 (classes = vocabulary, input_shape = (T,))",
        _parse_text("gpt"), _format_text("gpt"), _make_text(True), options={"pad_id": 0},
    ),
    Family(
        "bert", "text encoder + classification head, bert:layers=2,width=64,heads=4,vocab=V",
        _parse_text("bert"), _format_text("bert"), _make_text(False), options={"pad_id": 0},
    ),
)
for _family in _FAMILIES:
    MODELS.register(_family.name, _family, help=_family.help)


def _family(name: str, spec: str) -> Family:
    try:
        return MODELS.get(name)  # type: ignore[return-value]
    except ConfigError as err:
        raise ConfigError(f"bad model spec {spec!r}: {err}") from None


def parse_spec(spec: str) -> tuple[str, tuple]:
    """Split a spec into its family name and parsed arguments.

    ``"mlp:1000-1000"`` → ``("mlp", (1000, 1000))``;
    ``"cnn:3-6-1-0"`` → ``("cnn", (ConvLayerSpec(3, 6, 1, 0),))``;
    ``"convnet"`` → ``("convnet", (32,))``; ``"lenet"`` → ``("lenet", ())``;
    ``"my_pkg.nets:ResNet"`` → ``("class", ("my_pkg.nets:ResNet",))`` after importing the class
    (:mod:`.custom`: naming a class is the user's choice to run its module).
    """
    if not isinstance(spec, str):
        raise ConfigError(f"expected a model spec string like 'mlp:1000-1000', got {type(spec).__name__}")
    if is_class_spec(spec, MODELS.names()):
        import_class(spec)
        return "class", (spec.strip(),)
    text = "".join(spec.split()).lower()
    if not text:
        raise ConfigError(f"expected a model spec like 'mlp:1000-1000', got {spec!r}; known families: "
                          f"{', '.join(MODELS.names())}")
    if ":" in text:
        name, argstr = text.split(":", 1)
    else:
        name, argstr = text, None
        match = re.fullmatch(r"(.+?)-(\d+)", text)
        if name not in MODELS and match and match.group(1) in MODELS:
            if MODELS.get(match.group(1)).dash_argument:  # type: ignore[attr-defined]
                name, argstr = match.group(1), match.group(2)
    family = _family(name, spec)
    return family.name, family.parse(argstr, spec)


def canonical_spec(spec: str) -> str:
    """The canonical spelling of ``spec`` (``" MLP: 10-10"`` → ``"mlp:10-10"``)."""
    name, args = parse_spec(spec)
    return args[0] if name == "class" else _family(name, spec).format(args)


# --------------------------------------------------------------------------- build


def _check_input_shape(input_shape: Any) -> tuple[int, ...]:
    if isinstance(input_shape, int) and not isinstance(input_shape, bool):
        input_shape = (input_shape,)
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = None
    if (
        not shape
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape)
    ):
        raise ConfigError(
            f"expected input_shape as positive sizes (C, H, W) or (d,), got {input_shape!r} (field input_shape)"
        )
    return shape  # type: ignore[return-value]


def _check_classes(classes: Any) -> int:
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
        raise ConfigError(f"expected a positive integer output width, got {classes!r} (field classes)")
    return classes


def _check_bias(bias: Any) -> dict[str, bool]:
    if isinstance(bias, bool):
        return {"conv": bias, "linear": bias}
    if isinstance(bias, Mapping):
        unknown = sorted(set(bias) - {"conv", "linear"})
        if unknown or not all(isinstance(v, bool) for v in bias.values()):
            raise ConfigError(
                f"expected bias as True/False or {{'conv': bool, 'linear': bool}}, got {dict(bias)!r} (field bias)"
            )
        return {"conv": bias.get("conv", True), "linear": bias.get("linear", True)}
    raise ConfigError(f"expected bias as True/False or {{'conv': bool, 'linear': bool}}, got {bias!r} (field bias)")


def _check_dtype_device(dtype: Any, device: Any) -> tuple[torch.dtype, torch.device]:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"expected a floating torch dtype like torch.float32, got {dtype!r} (field dtype)")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"expected a torch device like 'cpu' or 'cuda:0', got {device!r} (field device)") from None
    return dtype, dev


def build(
    spec: str | nn.Module,
    input_shape: Sequence[int] | None = None,
    classes: int | None = None,
    *,
    act: str | None = None,
    bias: bool | Mapping[str, bool] = True,
    init: str = "default",
    seed: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    normalize: tuple | list | None = None,
    **family_options: Any,
) -> nn.Module:
    """Make the model ``spec`` for samples of shape ``input_shape`` and ``classes`` outputs.

    ``spec`` is a spec string (see the module docstring) or a
    :class:`torch.nn.Module`, returned as is after moving it to
    ``device``/``dtype`` (the other options must then keep their defaults).  A ``transformers``
    ``GPT2LMHeadModel`` comes back as the :class:`~.transformers.TextTransformer` computing the same
    logits, any other ``*ForCausalLM`` or encoder ``*ForSequenceClassification`` wrapped as a
    :class:`~.huggingface.HFTextModel` (:mod:`.huggingface`; ``pad_id=`` the batches' padding token, default 0).

    ``act``: one of :data:`~leakbench.models.ACTIVATIONS` (``None`` = the
    family's default: sigmoid for lenet, ReLU otherwise); ``negative_slope=``
    sets the leaky ReLU's slope.  ``bias``: for every layer, or per kind
    ``{"conv": bool, "linear": bool}`` (BatchNorm's affine shift is not
    affected; the output layer of ``twolayer`` never has a bias).  ``init``:
    a scheme of :mod:`leakbench.models.init` (``init_scale=`` for "small" and
    "uniform").  ``seed`` fixes the initialisation (a local generator; the
    global RNG is left alone); ``None`` draws one, recorded in ``model.seed``.
    Family options: ``norm`` (convnet, resnet18), ``width`` (resnet18).

    ``spec`` may name your own class, ``"module.path:ClassName"``: it is imported and built with
    ``family_options`` as its constructor's keyword arguments (:func:`~.custom.build_class`; ``act``,
    ``bias`` and ``init`` do not apply).  ``normalize=(mean, std)`` (per channel) puts
    :class:`~.custom.Normalize` in front of the model, so attacks work on pixels in [0, 1]
    (:func:`~.custom.normalized`; weights files still load into the inner model).

    The model carries ``spec`` (canonical), ``family``, ``input_shape``,
    ``classes``, ``act``, ``init``, ``seed`` and ``build_options`` such that
    ``build(m.spec, m.input_shape, m.classes, **m.build_options)`` makes an
    identical model.
    """
    dtype, dev = _check_dtype_device(dtype, device)
    if isinstance(spec, nn.Module):
        if normalize is not None:
            raise ConfigError("normalize applies to spec strings only, got a module; wrap it yourself with "
                              "leakbench.models.custom.normalized(module, (mean, std))")
        from .huggingface import HFTextModel, from_gpt2, is_gpt2, is_hf_model

        if is_gpt2(spec):  # a transformers GPT-2: the same function as a TextTransformer (.huggingface)
            spec = from_gpt2(spec, pad_id=int(family_options.pop("pad_id", 0)))
        elif is_hf_model(spec):  # any other causal LM / encoder classifier: wrapped (.huggingface)
            spec = HFTextModel(spec, pad_id=int(family_options.pop("pad_id", 0)))
        if getattr(spec, "takes_tokens", False) and hasattr(spec, "outputs") and classes is not None \
                and classes != spec.outputs:
            raise ConfigError(f"the model has {spec.outputs} outputs ({'its vocabulary' if spec.causal else 'classes'}), "
                              f"got classes={classes} (argument classes); the tokenizer or labels do not match the model")
        return _adopt(spec, input_shape, classes, act=act, bias=bias, init=init, seed=seed,
                      options=family_options, dtype=dtype, device=dev)
    name, args = parse_spec(spec)
    if name == "class":
        return _build_class(args[0], input_shape, classes, act=act, bias=bias, init=init, seed=seed,
                            options=family_options, dtype=dtype, device=dev, normalize=normalize)
    family = _family(name, spec)
    canonical = family.format(args)
    if input_shape is None or classes is None:
        raise ConfigError(f"model {canonical!r} needs input_shape and classes (e.g. input_shape=(3, 32, 32), classes=10)")
    shape = _check_input_shape(input_shape)
    classes = _check_classes(classes)
    options = dict(family_options)
    negative_slope = options.pop("negative_slope", None)
    init_scale = check_init_scale(options.pop("init_scale", None))
    options = family.check_options(options, canonical)
    act_name = canonical_activation(act) if act is not None else family.default_act
    make_act = activation_factory(act_name, negative_slope=negative_slope)
    biases = _check_bias(bias)
    resolve_init(init)  # reject unknown names before any work
    generator, seed_used = make_generator(seed)

    def make() -> nn.Module:
        return family.make(args, input_shape=shape, classes=classes, act=make_act, bias=biases, **options)

    check_size(make, canonical, dtype)
    with torch.random.fork_rng(devices=[]):  # layer constructors draw from the global RNG
        model = make()
    model.to(dtype=dtype)
    scheme = resolve_init(init, model)
    initialize(model, scheme, generator=generator, init_scale=init_scale)
    model.to(device=dev)

    rebuild: dict[str, Any] = {
        "act": act_name, "bias": biases if biases["conv"] != biases["linear"] else biases["conv"],
        "init": scheme, "seed": seed_used, **options,
    }
    if negative_slope is not None:
        rebuild["negative_slope"] = float(negative_slope)
    if init_scale is not None:
        rebuild["init_scale"] = init_scale
    model.spec = canonical
    model.family = family.name
    model.input_shape = shape
    model.classes = classes
    model.act = act_name
    model.init = scheme
    model.seed = seed_used
    model.build_options = rebuild
    return _normalized(model, normalize)


def _normalized(model: nn.Module, normalize) -> nn.Module:
    """``model`` behind :class:`~.custom.Normalize` when ``normalize`` is given, carrying the same attributes."""
    if normalize is None:
        return model
    wrapped = normalized(model, normalize)
    for name in ("spec", "family", "input_shape", "classes", "act", "init", "seed"):
        if hasattr(model, name):
            setattr(wrapped, name, getattr(model, name))
    norm = wrapped.normalize
    wrapped.build_options = {**getattr(model, "build_options", {}),
                             "normalize": [norm.mean.tolist(), norm.std.tolist()]}
    return wrapped


def _build_class(spec: str, input_shape, classes, *, act, bias, init, seed, options, dtype, device,
                 normalize) -> nn.Module:
    given = [name for name, value in (("act", act), ("bias", None if bias is True else bias),
                                      ("init", None if init == "default" else init)) if value is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} apply to leakbench's model families, not to your class {spec!r}; "
                          "set them up in the class (or pass them in its options)")
    if input_shape is None or classes is None:
        raise ConfigError(f"model {spec!r} needs input_shape and classes (e.g. input_shape=(3, 32, 32), classes=10)")
    shape = _check_input_shape(input_shape)
    classes = _check_classes(classes)
    seed_used = seed if seed is not None else int(make_generator(None)[1])
    model = build_class(spec, shape, classes, seed=seed_used, options=options, dtype=dtype, device=device)
    recorded = {"spec": spec, "family": "class", "input_shape": shape, "classes": classes, "seed": seed_used,
                "build_options": {"seed": seed_used, **dict(options)}}
    for name, value in recorded.items():
        if not hasattr(model, name):  # never over the class's own attributes
            setattr(model, name, value)
    return _normalized(model, normalize)


def _adopt(model: nn.Module, input_shape, classes, *, act, bias, init, seed, options, dtype, device) -> nn.Module:
    given = {k: v for k, v in (("act", act), ("seed", seed)) if v is not None}
    if bias is not True:
        given["bias"] = bias
    if init != "default":
        given["init"] = init
    given.update(options)
    if given:
        raise ConfigError(
            f"options {', '.join(sorted(given))} apply to spec strings only, got a "
            f"{type(model).__name__} module; set the module up yourself or pass a spec like 'mlp:100'"
        )
    model.to(device=device, dtype=dtype)
    if input_shape is not None and getattr(model, "input_shape", None) is None:
        model.input_shape = _check_input_shape(input_shape)
    if classes is not None and getattr(model, "classes", None) is None:
        model.classes = _check_classes(classes)
    return model


# --------------------------------------------------------------------------- summaries


class LayerInfo(NamedTuple):
    """One row of :func:`describe`: per-sample shapes (batch dimension dropped)."""

    name: str
    type: str
    input_shape: tuple[int, ...] | None
    output_shape: tuple[int, ...] | None
    params: int


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of scalar parameters (only those with ``requires_grad`` if ``trainable_only``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


@torch.no_grad()
def describe(model: nn.Module, input_shape: Sequence[int] | None = None) -> list[LayerInfo]:
    """Every leaf layer in call order with its input/output shape and parameter count.

    Shapes come from one forward pass of a zero sample of ``input_shape``
    (default ``model.input_shape``) in eval mode, so BatchNorm statistics are
    left untouched; the training flags are restored afterwards.
    """
    shape = input_shape if input_shape is not None else getattr(model, "input_shape", None)
    if shape is None:
        raise ConfigError(f"describe needs input_shape for a {type(model).__name__} without .input_shape")
    shape = _check_input_shape(shape)
    ref = next(iter(model.parameters()), None)
    x = torch.zeros(1, *shape, dtype=ref.dtype if ref is not None else torch.float32,
                    device=ref.device if ref is not None else "cpu")
    rows: list[LayerInfo] = []

    def hook_for(name: str) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            rows.append(LayerInfo(
                name, type(module).__name__,
                tuple(first.shape[1:]) if first is not None else None,
                tuple(output.shape[1:]) if isinstance(output, torch.Tensor) else None,
                sum(p.numel() for p in module.parameters(recurse=False)),
            ))
        return hook

    modes = {m: m.training for m in model.modules()}
    handles = [m.register_forward_hook(hook_for(n or type(m).__name__)) for n, m in model.named_modules()
               if not any(True for _ in m.children())]
    try:
        model.eval()
        model(x)
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return rows
