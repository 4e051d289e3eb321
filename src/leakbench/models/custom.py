"""Your own model class by import path (``my_pkg.nets:ResNet``), and input normalisation as part of a model.

A model spec of the form ``module.path:ClassName`` names a :class:`torch.nn.Module` subclass
that leakbench imports and constructs — **running that module's code is the user's explicit
choice**, made by writing the path into a sweep spec, ``--model`` or :func:`~leakbench.build`.
Nothing else imports code: model files are read as tensors only, and a model file whose
metadata names a class is refused (:mod:`.files`).

Construction (:func:`build_class`): ``Class(**options)``, plus ``input_shape=(C, H, W)`` and
``num_classes=K`` (or ``classes=K``) from the dataset when the constructor has a parameter of
that name and ``options`` does not set it (``**kwargs`` receives neither).  The constructor runs
under a fixed torch seed (``seed``) with the global RNG restored afterwards, so its random
initialisation is reproducible; the model is then probed on a zero batch of two samples, in eval and
in train mode (buffers restored), and must return a float tensor with one row of K ≥ ``classes`` logits
per sample each time (more outputs than the dataset's classes are allowed: an
unlabelled folder has one class, "unknown"; your model its own ``num_classes``).

The module is imported from ``sys.path`` only: installed packages, ``PYTHONPATH``, and the directories the
user names (:func:`add_code_paths`, ``leakbench evaluate --code-path DIR``).  Never from the current
directory: a spec received from someone else must not run a ``.py`` file that happens to lie where it is
run.  The sweep's spawned workers inherit the parent's ``sys.path`` (and :func:`add_code_paths` puts the
directories on ``PYTHONPATH`` for other executors), so a module importable when the sweep starts is
importable in its workers.  Under :func:`deferred_imports` (``evaluate --dry-run``) nothing is imported: the
modules a run would import are recorded, and only whether ``sys.path`` holds them is checked.

:func:`class_digest` keys trials on the source of the file that defines the class (and the
class's qualified name): an edited file never reuses old results.  Edits in *other* files the
class imports are not seen — give the model entry a new ``label`` (or bump an option) then.

Normalisation: ``normalize=(mean, std)`` (one value per channel) makes the model
``Sequential(normalize=Normalize(mean, std), model=model)``: attacks search pixel space [0, 1]
and return images a person can look at, while the gradients are those of the user's model
(:class:`Normalize` has buffers only, no parameter).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import re
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from collections import OrderedDict
from typing import Any
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..errors import ConfigError, expect
from .size import check_size

__all__ = ["Normalize", "normalized", "is_normalized", "is_class_spec", "import_class", "class_digest",
           "build_class", "CONSTRUCTOR_ARGUMENTS", "add_code_paths", "deferred_imports", "imports_deferred"]

#: ``module.path:ClassName`` (the class may be nested: ``module:Outer.Inner``).
_CLASS_SPEC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
#: constructor parameters leakbench fills from the dataset when the class accepts them and options leave them out.
CONSTRUCTOR_ARGUMENTS = ("input_shape", "num_classes", "classes")
_FIX_PATH = "give an importable 'module.path:ClassName' (e.g. my_pkg.nets:ResNet)"


class Normalize(nn.Module):
    """x ↦ (x − mean) / std per channel (buffers only: no parameter, so no gradient is shared for it)."""

    def __init__(self, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor) -> None:
        super().__init__()
        mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        std_t = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        expect(mean_t.numel() == std_t.numel() and mean_t.numel() >= 1,
               f"expected mean and std with one value per channel, got {mean_t.numel()} and {std_t.numel()} "
               "(argument normalize)")
        expect(bool(torch.isfinite(mean_t).all()) and bool((std_t > 0).all()),
               "expected finite means and positive standard deviations (argument normalize)")
        self.register_buffer("mean", mean_t)
        self.register_buffer("std", std_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - self.mean.to(x.dtype).reshape(shape)) / self.std.to(x.dtype).reshape(shape)


def normalized(model: nn.Module, normalize: Any) -> nn.Module:
    """``Sequential(normalize=Normalize(μ, σ), model=model)`` (``model`` itself, not a copy), or ``model`` when
    ``normalize`` is None."""
    if normalize is None:
        return model
    expect(isinstance(normalize, (tuple, list)) and len(normalize) == 2,
           f"expected normalize=(mean, std), got {normalize!r} (argument normalize)")
    norm = Normalize(*normalize)
    param = next(model.parameters(), None)
    if param is not None:
        norm = norm.to(device=param.device, dtype=param.dtype if param.is_floating_point() else torch.float32)
    return nn.Sequential(OrderedDict(normalize=norm, model=model))


def is_normalized(model: nn.Module) -> bool:
    """Whether ``model`` is :func:`normalized`'s wrapper (its weights are those of ``model.model``)."""
    return isinstance(model, nn.Sequential) and isinstance(getattr(model, "normalize", None), Normalize) \
        and isinstance(getattr(model, "model", None), nn.Module)


def is_class_spec(spec: Any, families: Sequence[str] = ()) -> bool:
    """Whether ``spec`` has the form ``module.path:ClassName`` (and its module part is no model family)."""
    if not isinstance(spec, str) or not _CLASS_SPEC.fullmatch(spec.strip()):
        return False
    return spec.split(":", 1)[0].lower() not in families


#: while set (:func:`deferred_imports`), the modules that :func:`import_class` would import, instead of importing
_DEFERRED: ContextVar[dict[str, list[str]] | None] = ContextVar("leakbench_deferred_imports", default=None)


@contextmanager
def deferred_imports():
    """Within it no user module is imported: yields {module: [fields naming it]} of what a run would import."""
    seen: dict[str, list[str]] = {}
    token = _DEFERRED.set(seen)
    try:
        yield seen
    finally:
        _DEFERRED.reset(token)


def imports_deferred() -> bool:
    """Whether :func:`deferred_imports` is in force (a dry run: user classes are named, not imported)."""
    return _DEFERRED.get() is not None


def add_code_paths(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Put the directories the user named (``--code-path``) first on ``sys.path`` and ``PYTHONPATH`` (so workers of
    any executor see them); a :class:`ConfigError` for one that is no directory.  Returns them, absolute."""
    out = []
    for raw in paths:
        path = os.path.abspath(os.fspath(raw))
        expect(os.path.isdir(path), f"expected a directory of Python modules, got {os.fspath(raw)!r} (option "
               "--code-path)")
        out.append(path)
    for path in reversed(out):
        if path not in sys.path:
            sys.path.insert(0, path)
    if out:
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([*out, *([old] if old else [])])
    return out


@contextmanager
def _without_cwd():
    """``sys.path`` without the current directory (``''``, which ``python -m`` adds, or its absolute path) unless
    the user named it (``PYTHONPATH``, ``--code-path``): a spec from elsewhere never runs a file lying here."""
    here = os.path.realpath(os.getcwd())
    named = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    removed = [(i, p) for i, p in enumerate(sys.path)
               if isinstance(p, str) and os.path.realpath(p or ".") == here and here not in named]
    for i, _ in reversed(removed):
        del sys.path[i]
    try:
        yield
    finally:
        for i, p in removed:
            sys.path.insert(i, p)


class _Deferred(nn.Module):
    """What :func:`import_class` returns under :func:`deferred_imports`: the class is not imported."""


def _import_module(name: str, spec: str, field: str):
    try:
        with _without_cwd():
            return importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = err.name or name
        if missing != name.split(".")[0] and not name.startswith(missing):
            raise ConfigError(f"importing {name!r} for model {spec!r} failed: {err} (field {field}); install "
                              "what the module needs") from None
        raise ConfigError(f"no module {name!r} to import for model {spec!r} (field {field}); install it, put its "
                          "directory on PYTHONPATH or name it with --code-path DIR (the current directory is "
                          "never searched), or " + _FIX_PATH) from None
    except Exception as err:  # noqa: BLE001 - the user's module raised while importing: one line
        first = " ".join(str(err).split())[:200]
        raise ConfigError(f"importing {name!r} for model {spec!r} raised {type(err).__name__}: {first} "
                          f"(field {field}); fix the module") from None


def _defer(module_name: str, spec: str, field: str) -> type[nn.Module]:
    """Record ``module_name`` as one a run would import; check only that ``sys.path`` holds its top package
    (finding it runs no code)."""
    import importlib.util

    top = module_name.split(".")[0]
    with _without_cwd():
        found = top in sys.modules or importlib.util.find_spec(top) is not None
    if not found:
        raise ConfigError(f"no module {top!r} to import for model {spec!r} (field {field}); install it, put its "
                          "directory on PYTHONPATH or name it with --code-path DIR (the current directory is never "
                          "searched)")
    _DEFERRED.get().setdefault(module_name, [])  # type: ignore[union-attr]
    if field not in _DEFERRED.get()[module_name]:  # type: ignore[index]
        _DEFERRED.get()[module_name].append(field)  # type: ignore[index]
    return _Deferred


def import_class(spec: str, *, field: str = "model spec") -> type[nn.Module]:
    """The :class:`torch.nn.Module` subclass that ``module.path:ClassName`` names (imports the module)."""
    if not isinstance(spec, str) or not _CLASS_SPEC.fullmatch(spec.strip()):
        raise ConfigError(f"expected 'module.path:ClassName', got {spec!r} (field {field}); " + _FIX_PATH)
    module_name, qualname = spec.strip().split(":", 1)
    if imports_deferred():
        return _defer(module_name, spec, field)
    obj: Any = _import_module(module_name, spec, field)
    for part in qualname.split("."):
        if not hasattr(obj, part):
            known = sorted(n for n, v in vars(_import_module(module_name, spec, field)).items()
                           if inspect.isclass(v) and issubclass(v, nn.Module) and v.__module__ == module_name)
            raise ConfigError(f"module {module_name!r} has no {qualname!r} (field {field}); its nn.Module classes: "
                              f"{', '.join(known) or 'none'}")
        obj = getattr(obj, part)
    if not (inspect.isclass(obj) and issubclass(obj, nn.Module)):
        what = f"class {obj.__name__}" if inspect.isclass(obj) else type(obj).__name__
        raise ConfigError(f"expected {spec!r} to name a torch.nn.Module subclass, got a {what} (field {field}); "
                          "name the model's class (wrap a factory function in a small nn.Module class)")
    return obj


def class_digest(spec: str, *, field: str = "model spec") -> str:
    """SHA-256 (16 hex digits) of the source file that defines the class, and of the class's qualified name."""
    cls = import_class(spec, field=field)
    if cls is _Deferred:  # a dry run: the class is not imported, so its source is not read either
        return "deferred"
    digest = hashlib.sha256(f"{cls.__module__}:{cls.__qualname__}\n".encode())
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        path = None
    if path and os.path.isfile(path):
        with open(path, "rb") as fh:
            digest.update(fh.read())
    else:  # no source file (an extension module): the class's source if inspect finds it, else the package version
        try:
            digest.update(inspect.getsource(cls).encode())
        except (OSError, TypeError):
            top = sys.modules.get(cls.__module__.split(".")[0])
            digest.update(str(getattr(top, "__version__", "")).encode())
    return digest.hexdigest()[:16]


def build_class(spec: str, input_shape: tuple[int, ...], classes: int, *, seed: int | None,
                options: Mapping[str, Any], dtype: torch.dtype, device: torch.device,
                field: str = "model spec") -> nn.Module:
    """Construct the class of ``spec`` (see the module docstring), probe it, and record how it was built."""
    cls = import_class(spec, field=field)
    kwargs = dict(options)
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    filled = {"input_shape": tuple(input_shape), "num_classes": int(classes), "classes": int(classes)}
    for name in CONSTRUCTOR_ARGUMENTS:
        param = params.get(name)
        if name not in kwargs and param is not None and param.kind is not inspect.Parameter.VAR_KEYWORD:
            kwargs[name] = filled[name]
    seed_used = int(seed) if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    check_size(lambda: cls(**kwargs), spec, dtype)  # sized on the meta device before it is built
    with torch.random.fork_rng(devices=[]):  # a reproducible initialisation; the global RNG is left alone
        torch.manual_seed(seed_used)
        try:
            model = cls(**kwargs)
        except Exception as err:  # noqa: BLE001 - the user's constructor: one line naming the options
            first = " ".join(str(err).split())[:200]
            args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            raise ConfigError(f"constructing {spec}({args}) raised {type(err).__name__}: {first}; fix the model's "
                              "options (the constructor's keyword arguments) or its constructor") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"constructing {spec} returned a {type(model).__name__}, not a torch.nn.Module "
                          f"(field {field})")
    model.to(device=device, dtype=dtype)
    _probe(model, spec, input_shape, classes, field, dtype, device)
    return model


#: the batch of the probe: more than one sample, as every attack and training step runs batches.
PROBE_BATCH = 2


def _probe(model: nn.Module, spec: str, input_shape, classes: int, field: str, dtype, device) -> None:
    """Forward passes of a zero batch of :data:`PROBE_BATCH` samples in eval and in train mode (BN statistics
    and every buffer restored afterwards): each must return one row of ``classes`` or more float logits a sample.

    A model that works on one sample only, returns integer logits or a tuple in train mode is refused here, in
    one line, rather than deep inside an attack or a training step.
    """
    modes = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    x = torch.zeros((PROBE_BATCH, *input_shape), dtype=dtype, device=device)
    try:
        for mode in ("eval", "train"):
            try:
                model.train(mode == "train")
                with torch.no_grad():
                    out = model(x)
            except Exception as err:  # noqa: BLE001
                first = " ".join(str(err).split())[:200]
                raise ConfigError(f"model {spec} fails in {mode} mode on a batch of shape ({PROBE_BATCH}, "
                                  f"{', '.join(map(str, input_shape))}): {type(err).__name__}: {first} (field "
                                  f"{field}); the dataset's samples have shape {tuple(input_shape)} and attacks run "
                                  "batches of several") from None
            _check_logits(out, spec, classes, field, mode)
    finally:
        for m, mode in modes.items():
            m.training = mode
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _check_logits(out: Any, spec: str, classes: int, field: str, mode: str) -> None:
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != PROBE_BATCH or out.shape[1] < classes:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"expected model {spec} to return logits of shape ({PROBE_BATCH}, K ≥ {classes}) for a "
                          f"batch of {PROBE_BATCH} in {mode} mode (the dataset has {classes} "
                          f"class{'es' if classes > 1 else ''}), got {got} (field {field}); return one tensor of "
                          "logits in both modes, and accept num_classes in the constructor or set it in options")
    if not out.is_floating_point():
        raise ConfigError(f"expected model {spec} to return float logits, got dtype {out.dtype} in {mode} mode "
                          f"(field {field}); return the scores before any argmax or rounding")
